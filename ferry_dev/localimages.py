"""Daemonless images for the local cluster's kubelet nodes: a Debian rootfs (debootstrap), Ferry's sources and an image
config, packed as docker-archive tarballs that `ctr images import` loads into each node's containerd (no registry,
no Docker daemon). images/Dockerfile is the product; these images have its layout (uid/gid 65532 with a passwd entry,
tini as PID 1, sources on PYTHONPATH under /opt/ferry/src) with one dev shortcut:

DEV MODE: the Python dependencies (7 GB of CUDA torch and NIXL wheels) are not baked in. The image's PYTHONPATH ends
with /opt/ferry/site-packages, and the local cluster mounts the prebuilt venv's site-packages there, read-only, by
hostPath (`dev_chart_values`). An image is then ~60 MB and imports in seconds; it runs only on the machine whose venv
it mounts. Debian bookworm's python3.11 runs the venv's cp311 wheels.

Everything is cached under $FERRY_CACHE/images: the rootfs layer is built once per package list; the sources layer
and the image tarballs are rebuilt (seconds) only when a source file changes.

    python -m ferry_dev.localimages          # build (or reuse) the images, print their tarballs
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

from ferry_dev.localcluster import CACHE_DIR, REPO_ROOT, ClusterError

IMAGES_DIR = CACHE_DIR / "images"
SUITE = "bookworm"
BASE_PACKAGES = ("python3.11", "tini", "ca-certificates", "libibverbs1", "ibverbs-providers")
UID = GID = 65532
SRC_ROOT = "/opt/ferry/src"
SITE_PACKAGES = "/opt/ferry/site-packages"
PYTHONPATH = f"{SRC_ROOT}:{SRC_ROOT}/operator:{SRC_ROOT}/agent:{SITE_PACKAGES}"
PAUSE_TAG = "registry.k8s.io/pause:3.10"  # containerd's sandbox_image; no registry to pull it from
# Which source trees each image holds (as images/Dockerfile copies them).
IMAGE_SOURCES = {"operator": ("ferry", "operator"), "agent": ("ferry", "agent")}
_EPOCH = "1970-01-01T00:00:00Z"

PAUSE_C = r"""
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>
static void quit(int sig) { (void)sig; _exit(0); }
static void reap(int sig) { (void)sig; while (waitpid(-1, NULL, WNOHANG) > 0) {} }
int main(void) {
  struct sigaction q = {.sa_handler = quit}, r = {.sa_handler = reap, .sa_flags = SA_NOCLDSTOP};
  sigaction(SIGINT, &q, NULL);
  sigaction(SIGTERM, &q, NULL);
  sigaction(SIGCHLD, &r, NULL);
  for (;;) pause();
}
"""


@dataclass(frozen=True)
class Layer:
    tar: Path
    diff_id: str  # sha256 of the uncompressed tar, as the image config lists it


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest()


def _layer(tar: Path) -> Layer:
    digest_file = tar.with_suffix(".sha256")
    if digest_file.is_file() and digest_file.stat().st_mtime >= tar.stat().st_mtime:
        return Layer(tar, digest_file.read_text().strip())
    layer = Layer(tar, _sha256(tar))
    digest_file.write_text(layer.diff_id)
    return layer


def _run(argv: list[str], what: str) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True)
    if proc.returncode != 0:
        raise ClusterError(f"{what} failed ({proc.returncode}): {(proc.stderr or proc.stdout)[-2000:]}")


def debian_mirror(sources: Path = Path("/etc/apt")) -> str:
    """Where debootstrap fetches from: `FERRY_DEBIAN_MIRROR`, else the mirror this host's apt uses for `SUITE`
    (deb822 `*.sources` or one-line `sources.list`), so the repo names no mirror of its own."""
    if mirror := os.environ.get("FERRY_DEBIAN_MIRROR"):
        return mirror
    for path in sorted(sources.glob("sources.list.d/*.sources")):
        for stanza in path.read_text().split("\n\n"):
            fields = dict(re.findall(r"^(\w[\w-]*):\s*(.*)$", stanza, re.M))
            if "deb" in fields.get("Types", "").split() and SUITE in fields.get("Suites", "").split():
                return fields["URIs"].split()[0]
    one_line = sources / "sources.list"
    for line in one_line.read_text().splitlines() if one_line.is_file() else []:
        words = [w for w in re.sub(r"\[[^]]*\]", "", line).split() if w]
        if len(words) >= 3 and words[0] == "deb" and words[2] == SUITE:
            return words[1]
    raise ClusterError(f"no Debian mirror for {SUITE} in {sources}: set FERRY_DEBIAN_MIRROR")


def base_layer() -> Layer:
    """The Debian minbase rootfs with Python 3.11 and tini, a `ferry` user (65532) and `python` on PATH, as one
    layer. Built once per package list (debootstrap, ~1-2 min), then reused. It needs the network: `make images`
    (a step of `make test`) builds it before the tests enter their loopback-only namespace."""
    mirror = debian_mirror()
    key = hashlib.sha256(f"{SUITE} {mirror} {' '.join(BASE_PACKAGES)} {UID} v1".encode()).hexdigest()[:12]
    tar = IMAGES_DIR / f"base-{SUITE}-{key}.tar"
    if tar.is_file():
        return _layer(tar)
    if shutil.which("debootstrap") is None:
        raise ClusterError("debootstrap not found: install it (apt-get install debootstrap; .ci/run does)")
    IMAGES_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=IMAGES_DIR, prefix="rootfs-") as tmp:
        root = Path(tmp) / "rootfs"
        _run(
            ["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", SUITE, str(root), mirror],
            "debootstrap",
        )
        _slim(root)
        partial = tar.with_suffix(".partial")
        _run(
            [
                "tar",
                "-C",
                str(root),
                "--sort=name",
                "--mtime=@0",
                "--numeric-owner",
                "--xattrs",
                "-cf",
                str(partial),
                ".",
            ],
            "tar of the rootfs",
        )
        partial.rename(tar)
    return _layer(tar)


def _slim(root: Path) -> None:
    """What the image needs beyond debootstrap, minus what it does not (apt lists, docs, locales, man pages)."""
    with open(root / "etc/passwd", "a") as f:
        f.write(f"ferry:x:{UID}:{GID}:ferry:/nonexistent:/usr/sbin/nologin\n")
    with open(root / "etc/group", "a") as f:
        f.write(f"ferry:x:{GID}:\n")
    (root / "usr/local/bin/python").symlink_to("/usr/bin/python3.11")
    for d in (
        "var/lib/apt/lists",
        "var/cache/apt",
        "usr/share/doc",
        "usr/share/man",
        "usr/share/locale",
        "usr/share/info",
        "var/log",
    ):
        shutil.rmtree(root / d, ignore_errors=True)
        (root / d).mkdir(parents=True, exist_ok=True)
    (root / "tmp").chmod(0o1777)


def _add_bytes(t: tarfile.TarFile, name: str, data: bytes, mode: int = 0o644) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mode, info.mtime = len(data), mode, 0
    t.addfile(info, io.BytesIO(data))


def _add_dir(t: tarfile.TarFile, name: str) -> None:
    info = tarfile.TarInfo(name)
    info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o755, 0
    t.addfile(info)


def _source_files(trees: tuple[str, ...]) -> list[Path]:
    files = []
    for tree in trees:
        for p in sorted((REPO_ROOT / tree).rglob("*")):
            rel = p.relative_to(REPO_ROOT)
            if p.is_file() and "__pycache__" not in rel.parts and p.suffix != ".pyc":
                files.append(rel)
    return files


def sources_layer(component: str) -> Layer:
    """Ferry's sources for one image under /opt/ferry/src, root-owned and read-only to the image's user; the tar is
    named by the content hash, so an unchanged checkout reuses it."""
    files = _source_files(IMAGE_SOURCES[component])
    h = hashlib.sha256()
    for rel in files:
        h.update(str(rel).encode() + b"\0" + (REPO_ROOT / rel).read_bytes() + b"\0")
    tar = IMAGES_DIR / f"src-{component}-{h.hexdigest()[:16]}.tar"
    if not tar.is_file():
        IMAGES_DIR.mkdir(parents=True, exist_ok=True)
        partial = tar.with_suffix(".partial")
        dirs: set[str] = set()
        with tarfile.open(partial, "w", format=tarfile.PAX_FORMAT) as t:
            for d in ("opt", "opt/ferry", "opt/ferry/src", SITE_PACKAGES.lstrip("/")):
                _add_dir(t, d)
            for rel in files:
                for parent in reversed(rel.parents[:-1]):
                    name = f"{SRC_ROOT.lstrip('/')}/{parent}"
                    if name not in dirs:
                        dirs.add(name)
                        _add_dir(t, name)
                _add_bytes(t, f"{SRC_ROOT.lstrip('/')}/{rel}", (REPO_ROOT / rel).read_bytes())
        partial.rename(tar)
    return _layer(tar)


def docker_archive(out: Path, tag: str, layers: list[Layer], config: dict) -> Path:
    """A docker-archive (`docker save` layout, one tar per layer) that `ctr images import` reads."""
    image_config = {
        "architecture": "amd64",
        "os": "linux",
        "created": _EPOCH,
        "config": config,
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "history": [{"created": _EPOCH, "created_by": "ferry_dev.localimages"} for _ in layers],
    }
    raw = json.dumps(image_config, sort_keys=True).encode()
    config_name = hashlib.sha256(raw).hexdigest() + ".json"
    names = [f"{layer.diff_id.removeprefix('sha256:')}/layer.tar" for layer in layers]
    manifest = [{"Config": config_name, "RepoTags": [tag], "Layers": names}]
    partial = out.with_suffix(".partial")
    with tarfile.open(partial, "w") as t:
        _add_bytes(t, config_name, raw)
        for layer, name in zip(layers, names, strict=True):
            info = t.gettarinfo(str(layer.tar), arcname=name)
            info.mtime, info.uid, info.gid, info.uname, info.gname, info.mode = 0, 0, 0, "", "", 0o644
            with open(layer.tar, "rb") as f:
                t.addfile(info, f)
        _add_bytes(t, "manifest.json", json.dumps(manifest).encode())
    partial.rename(out)
    return out


def image_config(component: str) -> dict:
    """The image config of images/Dockerfile's target `component` (dev mode: PYTHONPATH also reads the mounted
    site-packages)."""
    cmd = {
        "operator": ["python", "-m", "kopf", "run", "--standalone", "--all-namespaces", "-m", "ferry_operator.main"],
        "agent": ["python", "-m", "ferry_agent"],
    }[component]
    return {
        "User": f"{UID}:{GID}",
        "Entrypoint": ["/usr/bin/tini", "--"],
        "Cmd": cmd,
        "Env": [
            "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            f"PYTHONPATH={PYTHONPATH}",
            "PYTHONDONTWRITEBYTECODE=1",
            "PYTHONUNBUFFERED=1",
        ],
        "WorkingDir": "/",
    }


def dev_image(component: str, tag: str) -> Path:
    """`ferry-<component>:<tag>` as a docker-archive, rebuilt only when its layers change."""
    layers = [base_layer(), sources_layer(component)]
    identity = json.dumps([tag, [x.diff_id for x in layers], image_config(component)])
    key = hashlib.sha256(identity.encode()).hexdigest()[:16]
    out = IMAGES_DIR / f"ferry-{component}-{key}.docker.tar"
    if not out.is_file():
        docker_archive(out, f"ferry-{component}:{tag}", layers, image_config(component))
    # Each source change makes a new archive (~130 MB): keep only the current one and its sources layer.
    keep = {out, layers[1].tar, layers[1].tar.with_suffix(".sha256")}
    for old in [*IMAGES_DIR.glob(f"ferry-{component}-*.docker.tar"), *IMAGES_DIR.glob(f"src-{component}-*")]:
        if old not in keep:
            old.unlink(missing_ok=True)
    return out


def pause_image() -> Path:
    """A static `pause` (PID 1 of every pod sandbox) tagged as containerd's sandbox image."""
    out = IMAGES_DIR / "pause-3.10.docker.tar"
    if out.is_file():
        return out
    IMAGES_DIR.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=IMAGES_DIR) as tmp:
        src, binary = Path(tmp) / "pause.c", Path(tmp) / "pause"
        src.write_text(PAUSE_C)
        _run(["gcc", "-Os", "-static", "-s", "-o", str(binary), str(src)], "gcc pause.c")
        layer_tar = IMAGES_DIR / "pause-layer.tar"
        with tarfile.open(layer_tar, "w") as t:
            _add_bytes(t, "pause", binary.read_bytes(), mode=0o755)
    config = {"Entrypoint": ["/pause"], "User": "65535:65535", "Env": [], "WorkingDir": "/"}
    return docker_archive(out, PAUSE_TAG, [_layer(layer_tar)], config)


def dev_images(tag: str) -> dict[str, Path]:
    """Every image the chart's pods need on a local node: {image reference: docker-archive}."""
    return {
        f"ferry-operator:{tag}": dev_image("operator", tag),
        f"ferry-agent:{tag}": dev_image("agent", tag),
        PAUSE_TAG: pause_image(),
    }


def venv_site_packages() -> Path:
    """The site-packages of the venv this Python runs in (the one dev images mount)."""
    import sysconfig

    return Path(sysconfig.get_paths()["purelib"])


def dev_chart_values(site_packages: Path | None = None) -> dict:
    """Chart values for dev images: mount the prebuilt venv's site-packages read-only in both workloads, and never
    pull (the images exist only on the local nodes)."""
    volume = {
        "name": "dev-site-packages",
        "hostPath": {"path": str(site_packages or venv_site_packages()), "type": "Directory"},
    }
    mount = {"name": "dev-site-packages", "mountPath": SITE_PACKAGES, "readOnly": True}
    workload = {"extraVolumes": [volume], "extraVolumeMounts": [mount]}
    return {"image": {"pullPolicy": "Never"}, "operator": workload, "agent": dict(workload)}


def dev_engine_values(site_packages: Path | None = None) -> dict:
    """Values of examples/vllm-engine that run `python -m ferry_dev.example_engine` (a transformers engine in
    place of vLLM, which needs a GPU) from the agent's dev image: the venv's site-packages as in the chart, and
    this checkout's ferry_dev mounted read-only onto the image's sources (the product images do not ship it)."""
    dev = dev_chart_values(site_packages)["agent"]
    harness = {"name": "dev-ferry-dev", "hostPath": {"path": str(REPO_ROOT / "ferry_dev"), "type": "Directory"}}
    mount = {"name": "dev-ferry-dev", "mountPath": f"{SRC_ROOT}/ferry_dev", "readOnly": True}
    return {
        "imagePullPolicy": "Never",
        "command": ["python", "-m", "ferry_dev.example_engine"],
        "extraVolumes": [*dev["extraVolumes"], harness],
        "extraVolumeMounts": [*dev["extraVolumeMounts"], mount],
    }


def main() -> None:
    tag = sys.argv[1] if len(sys.argv) > 1 else "dev"
    for ref, path in dev_images(tag).items():
        print(f"{ref}\t{path}\t{path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
