"""The container images: images/Dockerfile (the product) and ferry_dev.localimages (its daemonless dev twin) agree, and
the slim operator image really runs without torch, NIXL and gRPC."""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest
import yaml

from ferry_dev import localimages

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = (REPO / "images" / "Dockerfile").read_text()
AGENT_ONLY = {"torch", "nixl", "grpcio"}
DEV_ONLY = {"cryptography", "ferry_dev"}  # the test extra and the harness it serves


def _requirements(name: str) -> list[str]:
    lines = (REPO / "images" / name).read_text().splitlines()
    return [line.split("#")[0].strip() for line in lines if line.split("#")[0].strip()]


def _project_dependencies() -> list[str]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    return [d.split("#")[0].strip() for d in deps]


def _name(requirement: str) -> str:
    return re.split(r"[<>=!~ ]", requirement, maxsplit=1)[0]


def test_image_requirements_follow_pyproject():
    project = _project_dependencies()
    assert sorted(_requirements("agent-requirements.txt")) == sorted(project)
    assert sorted(_requirements("operator-requirements.txt")) == sorted(
        d for d in project if _name(d) not in AGENT_ONLY
    )


def test_operator_imports_without_agent_only_packages():
    """What the slim operator image lacks must not be imported by the operator (nor the agent's package)."""
    blocked = sorted(AGENT_ONLY - {"grpcio"} | {"grpc", "ferry_agent"})
    code = f"""
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError("not in the operator image: " + name)
sys.meta_path.insert(0, Block())
import ferry_operator.main, ferry_operator.handlers.retention
"""
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'operator'}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr


def test_runtime_imports_without_dev_packages():
    """The images hold ferry, the operator and the agent without the test extra: none of their modules (nor
    ferry_vllm's) imports `cryptography` or the dev harness `ferry_dev`."""
    blocked = sorted(DEV_ONLY)
    code = f"""
import importlib, importlib.abc, pkgutil, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError("dev only, not in the images: " + name)
sys.meta_path.insert(0, Block())
for top in ("ferry", "ferry_operator", "ferry_agent", "ferry_vllm"):
    package = importlib.import_module(top)
    for info in pkgutil.walk_packages(package.__path__, top + "."):
        try:
            importlib.import_module(info.name)
        except ImportError as exc:
            if (exc.name or "").split(".")[0] != "vllm":  # the vllm extra: not installed in CI
                raise
"""
    env = {"PYTHONPATH": f"{REPO}:{REPO / 'operator'}:{REPO / 'agent'}", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr
    assert not {_name(d) for d in _project_dependencies()} & DEV_ONLY


def _target(name: str) -> str:
    """The Dockerfile lines of one `FROM ... AS name` stage."""
    match = re.search(rf"^FROM \S+ AS {name}\n(.*?)(?=^FROM |\Z)", DOCKERFILE, re.M | re.S)
    assert match, name
    return match.group(1)


@pytest.mark.parametrize("component", ["operator", "agent"])
def test_dev_image_config_matches_dockerfile(component):
    stage = _target(component)
    config = localimages.image_config(component)
    assert f"USER {config['User']}" in stage
    assert json.loads(re.search(r"^ENTRYPOINT (.*)$", stage, re.M).group(1)) == config["Entrypoint"]
    assert json.loads(re.search(r"^CMD (.*)$", stage, re.M).group(1)) == config["Cmd"]
    copied = re.findall(r"^COPY (\S+) /opt/ferry/src/\1$", stage, re.M)
    assert tuple(copied) == localimages.IMAGE_SOURCES[component]
    base_pythonpath = re.search(r"PYTHONPATH=(\S+)", DOCKERFILE).group(1)
    env = dict(e.split("=", 1) for e in config["Env"])
    # The dev image reads the mounted venv last; everything before it is the product's path.
    assert env["PYTHONPATH"] == f"{base_pythonpath}:{localimages.SITE_PACKAGES}"


def test_dockerfile_user_has_a_passwd_entry():
    assert "useradd --system --uid 65532 --gid 65532" in DOCKERFILE
    assert localimages.UID == localimages.GID == 65532


def test_docker_archive_layout(tmp_path):
    """What `ctr images import` reads: manifest.json naming the config and the layer tars, the config's diff_ids
    being the layers' sha256."""
    layer_tar = tmp_path / "layer.tar"
    with tarfile.open(layer_tar, "w") as t:
        localimages._add_bytes(t, "hello", b"world")
    layer = localimages._layer(layer_tar)
    assert layer.diff_id == "sha256:" + hashlib.sha256(layer_tar.read_bytes()).hexdigest()
    out = localimages.docker_archive(tmp_path / "img.tar", "ferry-agent:t", [layer], localimages.image_config("agent"))
    with tarfile.open(out) as t:
        manifest = json.load(t.extractfile("manifest.json"))
        assert manifest[0]["RepoTags"] == ["ferry-agent:t"]
        config = json.load(t.extractfile(manifest[0]["Config"]))
        assert config["rootfs"]["diff_ids"] == [layer.diff_id]
        assert t.extractfile(manifest[0]["Layers"][0]).read() == layer_tar.read_bytes()
    assert config["config"]["User"] == "65532:65532"


def test_sources_layer_holds_only_its_trees():
    layer = localimages.sources_layer("operator")
    with tarfile.open(layer.tar) as t:
        names = t.getnames()
    assert "opt/ferry/src/operator/ferry_operator/main.py" in names
    assert "opt/ferry/src/ferry/storage.py" in names
    assert not any(n.startswith("opt/ferry/src/agent") or "__pycache__" in n for n in names)


def test_the_debian_mirror_is_the_hosts_own(tmp_path, monkeypatch):
    monkeypatch.delenv("FERRY_DEBIAN_MIRROR", raising=False)
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list.d" / "other.sources").write_text(
        "Types: deb\nURIs: http://mirror.invalid/other\nSuites: nodistro\nComponents: main\n"
    )
    with pytest.raises(localimages.ClusterError, match="no Debian mirror"):
        localimages.debian_mirror(tmp_path)
    (tmp_path / "sources.list").write_text(
        f"# deb http://mirror.invalid/commented {localimages.SUITE} main\n"
        f"deb [arch=amd64] http://mirror.invalid/one-line {localimages.SUITE} main\n"
    )
    assert localimages.debian_mirror(tmp_path) == "http://mirror.invalid/one-line"
    (tmp_path / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\n# a comment\nURIs: http://mirror.invalid/deb822\n"
        f"Suites: {localimages.SUITE} {localimages.SUITE}-updates\nComponents: main\n\n"
        "Types: deb\nURIs: http://mirror.invalid/security\nSuites: security\n"
    )
    assert localimages.debian_mirror(tmp_path) == "http://mirror.invalid/deb822"
    monkeypatch.setenv("FERRY_DEBIAN_MIRROR", "http://mirror.invalid/env")
    assert localimages.debian_mirror(tmp_path) == "http://mirror.invalid/env"


def test_engine_vllm_image_keeps_vllms_entrypoint_and_adds_ferrys_client():
    """examples/vllm-engine's args start with the model because its image's entrypoint is vLLM's `vllm serve`."""
    stage = _target("engine-vllm")
    assert re.search(r"^ARG VLLM_IMAGE=vllm/vllm-openai:v\S+$", DOCKERFILE, re.M)
    assert not re.search(r"^(ENTRYPOINT|CMD|USER) ", stage, re.M)
    assert "pip install --no-cache-dir --no-deps /tmp/ferry" in stage  # the distribution: its vLLM entry point
    values = yaml.safe_load((REPO / "examples" / "vllm-engine" / "values.yaml").read_text())
    assert f"-t {values['image']} ." in DOCKERFILE
