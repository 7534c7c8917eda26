"""The engine's distribution as an engine gets it: `make dist`'s ferry-client wheel, installed with nothing but its
own dependencies into a clean virtualenv of each supported Python, attaches to a real agent and holds the seeded
bytes; Ferry's server stack is not importable there.

The venvs come from `uv` with its cache under $FERRY_CACHE/uv: installs hardlink from it, so only the first run
downloads torch (and its CUDA wheels)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ferry
from tests.support.agents import content_sha256, node, seed_arg, start_agent
from tests.support.consumers import engine_pod
from tests.support.objects import apply, ml_body, ml_status, wait_for, wv_body

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
PYTHONS = ("3.11", "3.12", "3.13")
# Ferry's server side and its dependencies: none of it may come with the engine's distribution.
SERVER_ONLY = ("kopf", "kubernetes", "boto3", "botocore", "grpc", "nixl", "pydantic", "ferry_agent", "ferry_operator")
UV = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")

CONSUMER = """
import hashlib, importlib.util, json, sys
import torch
import ferry
from ferry.client import attach
import ferry.trainer  # the trainer's publish API ships in the same wheel, torch only
with attach("serve", timeout=60) as a:
    tensors = a.tensors()
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(bytes(tensors[name].contiguous().view(torch.uint8).flatten().tolist()))  # numpy is not installed
    print(json.dumps({
        "version": a.version, "sha256": h.hexdigest(), "ferry": ferry.__file__, "ferry_version": ferry.__version__,
        "python": "%d.%d" % sys.version_info[:2],
        "importable": [m for m in sys.argv[1:] if importlib.util.find_spec(m) is not None],
    }))
"""


def interpreter(version: str) -> str:
    """Python `version`'s interpreter: on PATH (a pyenv shim answers only for its selected versions, so each
    candidate is asked), else pyenv's own install."""
    candidates = [shutil.which(f"python{version}")]
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    candidates += sorted(str(p) for p in pyenv.glob(f"{version}.*/bin/python{version}"))
    for candidate in filter(None, candidates):
        out = subprocess.run(
            [candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"], capture_output=True, text=True
        )
        if out.returncode == 0 and out.stdout.strip() == version:
            return candidate
    pytest.fail(f"Python {version} is not on this machine (ferry-client supports {', '.join(PYTHONS)}): install it")


# Offline (the suite runs in a loopback-only namespace): `make dist-cache`, which `make test` runs first, fills it.
UV_ENV = {
    "UV_CACHE_DIR": str(Path(os.environ["FERRY_CACHE"]) / "uv"),
    "UV_OFFLINE": "1",
    "UV_PYTHON_DOWNLOADS": "never",
}


def uv(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | UV_ENV
    out = subprocess.run([UV, *args], env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, f"uv {' '.join(args)} (has `make dist-cache` run?): {out.stdout}{out.stderr}"
    return out


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    """`make dist`'s wheels, built from this tree."""
    assert UV, "uv is not installed (it is in the test extra)"
    out = tmp_path_factory.mktemp("dist")
    make = ["make", "-s", "dist", f"DIST={out}", f"VENV={Path(sys.executable).parent.parent}"]
    proc = subprocess.run(make, cwd=ROOT, env=os.environ | UV_ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"make dist (has `make dist-cache` run?): {proc.stdout}{proc.stderr}"
    return out


def test_the_client_wheel_needs_only_torch_and_ships_the_one_version(wheels):
    (wheel,) = wheels.glob("ferry_client-*.whl")
    assert wheel.name == f"ferry_client-{ferry.__version__}-py3-none-any.whl"
    import zipfile

    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        metadata = z.read(f"ferry_client-{ferry.__version__}.dist-info/METADATA").decode()
        entry_points = z.read(f"ferry_client-{ferry.__version__}.dist-info/entry_points.txt").decode()
    packages = {n.split("/")[0] for n in names if not n.startswith("ferry_client-")}
    assert packages == {"ferry", "ferry_vllm"}
    assert {n for n in names if n.startswith("ferry/")} == {"ferry/__init__.py"} | {
        str(p.relative_to(ROOT)) for package in ("client", "trainer") for p in (ROOT / "ferry" / package).glob("*.py")
    }
    requires = [line.split(":", 1)[1].strip() for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    assert requires == ["torch>=2.4", "vllm>=0.33; extra == 'vllm'"]
    assert "Requires-Python: >=3.11" in metadata
    assert "ferry = ferry_vllm:register" in entry_points and "ferry-vllm-refit = ferry_vllm.refit:main" in entry_points


def test_the_client_wheel_attaches_from_a_clean_venv_of_each_python(
    wheels, cluster, namespace, operator, tmp_path, socket_root
):
    (wheel,) = wheels.glob("ferry_client-*.whl")
    venvs = {}
    for version in PYTHONS:
        venv = tmp_path / f"venv-{version}"
        uv("venv", "--quiet", "--python", interpreter(version), str(venv))
        uv("pip", "install", "--quiet", "--python", str(venv / "bin" / "python"), str(wheel))
        uv("pip", "check", "--python", str(venv / "bin" / "python"))
        venvs[version] = venv

    gen = torch.Generator().manual_seed(7)
    served = {
        "embed.weight": torch.randn(64, 32, generator=gen),
        "layer.0.weight": torch.randn(32, 32, generator=gen).to(torch.bfloat16),
        "layer.0.bias": torch.arange(32, dtype=torch.int64),
    }
    checkpoint = tmp_path / "v1.safetensors"
    save_file(served, str(checkpoint))
    node_name = f"{namespace}-n0"
    node(cluster, node_name, {"ferry.dev/pool": namespace})
    agent = start_agent(cluster, tmp_path, node_name, seed_arg(namespace, "v1", checkpoint), socket_dir=socket_root)

    def describe() -> str:
        return json.dumps(ml_status(cluster, namespace), indent=1) + agent.log_tail(30)

    try:
        pod_dir = socket_root / "pods" / engine_pod(cluster, namespace, node_name)
        apply(cluster, namespace, wv_body(namespace, "v1", fmt="PeerOnly"), ml_body(namespace, "v1", 1))
        wait_for(lambda: ml_status(cluster, namespace).get("ready") == "1/1", 90, "1/1 ready", describe)
        for version, venv in venvs.items():
            # The venv's own python, outside the source tree, with nothing of the repo on its path.
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            env |= {"FERRY_SOCKET_DIR": str(pod_dir), "OMP_NUM_THREADS": "1"}
            proc = subprocess.run(
                [str(venv / "bin" / "python"), "-c", CONSUMER, *SERVER_ONLY],
                env=env,
                cwd=tmp_path,
                capture_output=True,
                text=True,
                timeout=180,
            )
            assert proc.returncode == 0, proc.stderr + describe()
            out = json.loads(proc.stdout)
            assert out["python"] == version and out["ferry"].startswith(str(venv)), out
            assert out["importable"] == [], out
            assert out["version"] == "v1" and out["ferry_version"] == ferry.__version__
            assert out["sha256"] == content_sha256(served)
    finally:
        agent.stop()
