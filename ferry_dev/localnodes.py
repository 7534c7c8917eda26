"""Real kubelet nodes for the local cluster: each node is a containerd (own root, state, socket, runc root and CNI
bridge) and a kubelet, in a mount namespace of its own, against a `LocalCluster(pods=True)`.

Everything stays on this machine and inside the loopback-only network namespace of hack/netns.sh (`start` refuses
to run anywhere else, so no host interface or route is ever touched):
- node N's IP is 10.99.0.N, a /32 on `lo` (the kubelet refuses loopback addresses);
- its pods live on a bridge `ferrybrN`, 10.244.N.0/24, routed by this namespace (pods of different nodes reach each
  other pod to pod; nothing is masqueraded, no iptables rule is written);
- there is no kube-proxy: `socat` serves the `kubernetes` Service address (10.0.0.1:443) and forwards it to the
  apiserver on 127.0.0.1; `forward()` does the same for other host services (S3) on HOST_IP.

One host, several nodes: the chart's hostPaths (/var/lib/ferry, /run/ferry) are bind-mounted per node inside the
node's mount namespace, from `Node.host_path(...)`, so the nodes share neither a checkpoint store nor attach sockets,
as separate machines would not. Each node's pods run under the cgroup /ferry-node-N.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from ferry_dev.localcluster import (
    API_SERVICE_IP,
    ClusterError,
    LocalCluster,
    ManagedProcess,
    binary,
    wait_until,
    write_kubeconfig,
)

CNI_BIN_DIR = Path(os.environ.get("FERRY_CNI_BIN_DIR", "/usr/lib/cni"))
HOST_IP = "10.99.0.254"  # where pods reach services of this machine (forward())
# The chart's hostPaths that each node gets its own copy of.
NODE_HOST_PATHS = ("/var/lib/ferry", "/run/ferry")
_CGROUP_ROOT = Path("/sys/fs/cgroup")


def _ip(*args: str) -> None:
    proc = subprocess.run(["ip", *args], capture_output=True, text=True)
    if proc.returncode != 0 and "File exists" not in proc.stderr:
        raise ClusterError(f"ip {' '.join(args)}: {proc.stderr.strip()}")


def in_loopback_namespace() -> bool:
    """Whether this network namespace has no interface but `lo` (and bridges/veths of our own nodes)."""
    names = [
        line.split(": ")[1].split("@")[0]
        for line in subprocess.run(
            ["ip", "-o", "link", "show"], capture_output=True, text=True, check=True
        ).stdout.splitlines()
    ]
    return all(n == "lo" or n.startswith(("ferrybr", "veth")) for n in names)


def _cgroup_controllers() -> list[Path]:
    """cgroup v1 hierarchies (the kubelet runs with cgroupDriver: cgroupfs, failCgroupV1: false)."""
    return [p for p in sorted(_CGROUP_ROOT.iterdir()) if p.is_dir() and (p / "cgroup.procs").exists()]


def _make_cgroup(name: str) -> None:
    for ctrl in _cgroup_controllers():
        d = ctrl / name
        d.mkdir(exist_ok=True)
        if ctrl.name == "cpuset":  # a v1 cpuset child starts empty: no task could join it
            for f in ("cpuset.cpus", "cpuset.mems"):
                if (d / f).read_text().strip() == "":
                    (d / f).write_text((ctrl / f).read_text())


def _cgroup_pids(name: str) -> set[int]:
    pids: set[int] = set()
    for ctrl in _cgroup_controllers():
        for procs in (ctrl / name).rglob("cgroup.procs") if (ctrl / name).is_dir() else ():
            with contextlib.suppress(OSError):
                pids.update(int(x) for x in procs.read_text().split())
    return pids


def _remove_cgroup(name: str) -> None:
    for ctrl in _cgroup_controllers():
        root = ctrl / name
        if root.is_dir():
            for d in sorted((p for p in root.rglob("*") if p.is_dir()), key=lambda p: len(p.parts), reverse=True):
                with contextlib.suppress(OSError):
                    d.rmdir()
            with contextlib.suppress(OSError):
                root.rmdir()


def _pids_with_arg(arg: str) -> list[int]:
    """Processes whose command line contains `arg` as one argument (the shims of one containerd)."""
    found = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            with contextlib.suppress(OSError):
                if arg in p.joinpath("cmdline").read_bytes().split(b"\0"):
                    found.append(int(p.name))
    return found


def _kill(pids: set[int] | list[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)


@dataclass
class Node:
    index: int
    workdir: Path
    labels: dict[str, str]
    containerd: ManagedProcess | None = None
    kubelet: ManagedProcess | None = None

    @property
    def name(self) -> str:
        return f"ferry-node-{self.index}"

    @property
    def ip(self) -> str:
        return f"10.99.0.{self.index}"

    @property
    def pod_cidr(self) -> str:
        return f"10.244.{self.index}.0/24"

    @property
    def socket(self) -> Path:
        return self.workdir / "containerd" / "containerd.sock"

    def host_path(self, path: str) -> Path:
        """Where this node's `path` (one of NODE_HOST_PATHS, or below one) lies on this machine."""
        top = next(p for p in NODE_HOST_PATHS if path == p or path.startswith(p + "/"))
        return self.workdir / "host" / top.strip("/").replace("/", "-") / os.path.relpath(path, top)

    def ctr(self, *args: str, timeout: float = 600) -> str:
        proc = subprocess.run(
            ["ctr", f"--address={self.socket}", "--namespace=k8s.io", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if proc.returncode != 0:
            raise ClusterError(f"ctr {' '.join(args)} on {self.name}: {proc.stderr.strip()}")
        return proc.stdout

    def import_images(self, archives: list[Path]) -> None:
        present = self.ctr("images", "list", "--quiet").split()
        for archive in archives:
            tags = [t for m in _archive_manifest(archive) for t in m["RepoTags"]]
            if all(_qualified(t) in present for t in tags):
                continue
            self.ctr("images", "import", str(archive))

    def _containerd_config(self) -> Path:
        d = self.workdir / "containerd"
        d.mkdir(parents=True, exist_ok=True)
        cni = self.workdir / "cni"
        cni.mkdir(parents=True, exist_ok=True)
        (cni / "10-ferry.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "0.4.0",
                    "name": f"ferry-{self.name}",
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": f"ferrybr{self.index}",
                            "isGateway": True,
                            "ipMasq": False,
                            "hairpinMode": True,
                            "ipam": {
                                "type": "host-local",
                                "ranges": [[{"subnet": self.pod_cidr}]],
                                "routes": [{"dst": "0.0.0.0/0"}],
                                "dataDir": str(self.workdir / "cni-ipam"),
                            },
                        }
                    ],
                }
            )
        )
        cri = '[plugins."io.containerd.grpc.v1.cri"]'
        config = f"""version = 2
root = "{d / "root"}"
state = "{d / "state"}"
[grpc]
  address = "{self.socket}"
[ttrpc]
  address = ""
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{d / "opt"}"
{cri}
  sandbox_image = "registry.k8s.io/pause:3.10"
  # No CAP_SYS_RESOURCE in this VM: without it sandboxes fail on oom_score_adj ("can't get final child's PID").
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        Root = "{d / "runc"}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN_DIR}"
    conf_dir = "{cni}"
"""
        path = d / "config.toml"
        path.write_text(config)
        return path

    def _kubelet_config(self, cluster: LocalCluster) -> Path:
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # This VM: cgroup v1, no systemd as PID 1, swap allowed, no CAP_SYS_RESOURCE for kernel tunables.
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "failSwapOn": False,
            "protectKernelDefaults": False,
            "cgroupRoot": f"/{self.name}",
            "address": self.ip,
            "port": 10250,
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": 0,
            "containerRuntimeEndpoint": f"unix://{self.socket}",
            "authentication": {
                "anonymous": {"enabled": True},
                "webhook": {"enabled": False},
                "x509": {"clientCAFile": str(cluster.pki.ca_cert)},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "podCIDR": self.pod_cidr,
            "maxPods": 30,
            "resolvConf": "/etc/resolv.conf",
            # Images exist only as imports (no registry): never garbage-collect them, and evict only when the disk
            # is really full (other helpers share it).
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "evictionHard": {"memory.available": "100Mi", "nodefs.available": "2%", "imagefs.available": "2%"},
            "serializeImagePulls": False,
            "podLogsDir": str(self.workdir / "pod-logs"),
            "nodeStatusUpdateFrequency": "4s",
            "syncFrequency": "10s",
        }
        path = self.workdir / "kubelet.json"
        path.write_text(json.dumps(config, indent=1))
        return path

    def start(self, cluster: LocalCluster) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        _ip("addr", "add", f"{self.ip}/32", "dev", "lo")
        _make_cgroup(self.name)
        binds = []
        for top in NODE_HOST_PATHS:
            Path(top).mkdir(parents=True, exist_ok=True)  # the mount point; nothing is written there
            self.host_path(top).mkdir(parents=True, exist_ok=True)
            binds.append(f"mount --bind {self.host_path(top)} {top}")
        # The node's own mount namespace: its bind mounts, the kubelet's volume mounts and the containers' rootfs
        # stay in it, and it vanishes with the node's last process.
        script = " && ".join([*binds, f"exec containerd --config {self._containerd_config()}"])
        self.containerd = ManagedProcess(
            f"containerd-{self.index}",
            ["unshare", "--mount", "--propagation", "private", "--", "sh", "-c", script],
            self.workdir / "containerd.log",
        ).start()
        wait_until(lambda: self.socket.exists() and bool(self.ctr("version")), 60, "containerd", self.containerd)

    def start_kubelet(self, cluster: LocalCluster) -> None:
        cert, key = self.workdir / "kubelet.crt", self.workdir / "kubelet.key"
        cluster.pki.issue_client_cert(f"system:node:{self.name}", ["system:nodes"], cert, key)
        kubeconfig = write_kubeconfig(
            self.workdir / "kubeconfig",
            cluster.server,
            cluster.pki.ca_cert,
            cert=cert,
            key=key,
            user=f"system:node:{self.name}",
        )
        labels = ",".join(f"{k}={v}" for k, v in self.labels.items())
        self.kubelet = ManagedProcess(
            f"kubelet-{self.index}",
            [
                "nsenter",
                f"--mount=/proc/{self.containerd.proc.pid}/ns/mnt",
                "--",
                binary("kubelet"),
                f"--config={self._kubelet_config(cluster)}",
                f"--kubeconfig={kubeconfig}",
                f"--root-dir={self.workdir / 'kubelet'}",
                f"--cert-dir={self.workdir / 'kubelet-pki'}",
                f"--hostname-override={self.name}",
                f"--node-ip={self.ip}",
                f"--node-labels={labels}",
                "--v=1",
            ],
            self.workdir / "kubelet.log",
        ).start()

    def stop(self) -> None:
        if self.kubelet:
            self.kubelet.stop(grace=5)
        # Containers and shims outlive containerd (the shims are daemons): end them by their cgroup and socket.
        for _ in range(3):
            pids = _cgroup_pids(self.name)
            if not pids:
                break
            _kill(pids)
            time.sleep(0.5)
        _kill(_pids_with_arg(str(self.socket)))
        if self.containerd:
            self.containerd.stop(grace=5)
        _remove_cgroup(self.name)
        with contextlib.suppress(ClusterError):
            _ip("addr", "del", f"{self.ip}/32", "dev", "lo")
        with contextlib.suppress(ClusterError):
            _ip("link", "del", f"ferrybr{self.index}")


def _archive_manifest(archive: Path) -> list[dict]:
    import tarfile

    with tarfile.open(archive) as t:
        return json.load(t.extractfile("manifest.json"))


def _qualified(tag: str) -> str:
    """An image reference as containerd lists it (docker.io/library/ for bare names)."""
    name = tag.split(":")[0]
    if "/" not in name:
        return f"docker.io/library/{tag}"
    if "." not in name.split("/")[0]:
        return f"docker.io/{tag}"
    return tag


@dataclass
class NodePool:
    """1-3 kubelet nodes of a `LocalCluster(pods=True)`, the apiserver forwarder, and the images they run."""

    cluster: LocalCluster
    workdir: Path
    count: int = 2
    labels: dict[str, str] = field(default_factory=lambda: {"ferry.dev/gpu": "true"})
    nodes: list[Node] = field(default_factory=list)
    forwarders: list[ManagedProcess] = field(default_factory=list)

    def start(self, images: list[Path], timeout: float = 180) -> NodePool:
        if not 1 <= self.count <= 3:
            raise ClusterError("1 to 3 nodes")
        if not self.cluster.pods:
            raise ClusterError("kubelet nodes need LocalCluster(pods=True)")
        if not in_loopback_namespace():
            raise ClusterError("kubelet nodes add addresses and bridges: run inside hack/netns.sh")
        for tool in ("containerd", "ctr", "runc", "socat", "nsenter", "unshare"):
            if shutil.which(tool) is None:
                raise ClusterError(
                    f"{tool} not found (apt-get install containerd runc containernetworking-plugins "
                    "socat; .ci/run does)"
                )
        if not (CNI_BIN_DIR / "bridge").is_file():
            raise ClusterError(f"no CNI plugins in {CNI_BIN_DIR} (apt-get install containernetworking-plugins)")
        # Pod to pod between nodes crosses two bridges: route between them (this namespace's own sysctl).
        Path("/proc/sys/net/ipv4/ip_forward").write_text("1")
        _ip("addr", "add", f"{API_SERVICE_IP}/32", "dev", "lo")
        _ip("addr", "add", f"{HOST_IP}/32", "dev", "lo")
        api_port = self.cluster.api_port
        self.forwarders.append(self._socat(f"{API_SERVICE_IP}:443", f"127.0.0.1:{api_port}", "apiserver"))
        self.nodes = [Node(i, self.workdir / f"node-{i}", dict(self.labels)) for i in range(1, self.count + 1)]
        for node in self.nodes:
            node.start(self.cluster)
            node.import_images(images)
            node.start_kubelet(self.cluster)
        for node in self.nodes:
            wait_until(lambda n=node: self._ready(n.name), timeout, f"node {node.name} Ready", node.kubelet)
        return self

    def _socat(self, listen: str, target: str, what: str) -> ManagedProcess:
        host, port = listen.rsplit(":", 1)
        proc = ManagedProcess(
            f"forward-{what}",
            ["socat", f"TCP-LISTEN:{port},bind={host},reuseaddr,fork", f"TCP:{target}"],
            self.workdir / f"forward-{what}.log",
        ).start()
        time.sleep(0.3)
        if not proc.alive:
            raise ClusterError(f"socat {listen} -> {target}: {proc.log_tail()}")
        return proc

    def forward(self, port: int, what: str) -> str:
        """Make 127.0.0.1:`port` reachable from pods as HOST_IP:`port`; returns that address."""
        self.forwarders.append(self._socat(f"{HOST_IP}:{port}", f"127.0.0.1:{port}", what))
        return f"{HOST_IP}:{port}"

    def _ready(self, name: str) -> bool:
        out = self.cluster.kubectl(
            "get", "node", name, "-o", "jsonpath={.status.conditions[?(@.type=='Ready')].status}", check=False
        )
        return out.stdout.strip() == "True"

    def node(self, name: str) -> Node:
        return next(n for n in self.nodes if n.name == name)

    def stop(self) -> None:
        for node in reversed(self.nodes):
            node.stop()
        for proc in self.forwarders:
            proc.stop(grace=2)
        for ip in (API_SERVICE_IP, HOST_IP):
            with contextlib.suppress(ClusterError):
                _ip("addr", "del", f"{ip}/32", "dev", "lo")
