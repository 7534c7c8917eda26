"""A real one-machine control plane for tests and the demo: etcd, kube-apiserver, kube-controller-manager and
a SeaweedFS S3 server, all on 127.0.0.1, with per-run certificates and kubeconfig, torn down on exit.

The binaries are built by `hack/build-bins.sh` into `$FERRY_CACHE/bin` (default `~/.cache/ferry/bin`).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import json
import os
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from ferry import ambient

CACHE_DIR = Path(os.environ.get("FERRY_CACHE", Path.home() / ".cache" / "ferry"))
BIN_DIR = Path(os.environ.get("FERRY_BIN_DIR", CACHE_DIR / "bin"))
REPO_ROOT = Path(__file__).resolve().parent.parent
CRD_DIR = REPO_ROOT / "crds"

SERVICE_CIDR = "10.0.0.0/24"
# The `kubernetes` Service (the first ClusterIP) as pods see it; ferry_dev.localnodes forwards it to the apiserver.
API_SERVICE_IP = "10.0.0.1"
IN_CLUSTER_SANS = (
    API_SERVICE_IP,
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)

S3_ACCESS_KEY = "ferry-access"
DEV_AMBIENT_CREDENTIALS = json.dumps([{"namespaces": [ambient.ANY], "prefixes": [f"s3://{ambient.ANY}"]}])
S3_SECRET_KEY = "ferry-secret-key"


class ClusterError(RuntimeError):
    pass


def binary(name: str) -> str:
    """A control-plane binary from the cache, or from PATH / the active venv for the PyPI-shipped ones."""
    cached = BIN_DIR / name
    if cached.is_file() and os.access(cached, os.X_OK):
        return str(cached)
    beside_python = Path(sys.executable).parent / name
    if beside_python.is_file():
        return str(beside_python)
    found = shutil.which(name)
    if found:
        return found
    raise ClusterError(f"{name} not found in {BIN_DIR} or PATH; run `make bins` (hack/build-bins.sh) first")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """n distinct free ports, held open together so none repeats."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


# PR_SET_PDEATHSIG, then exec the command: no orphaned servers if the test runner is killed hard. Set by a launcher
# rather than a `preexec_fn`, which makes Popen fork() instead of vfork(): a fork() runs gRPC's at-fork handlers,
# whose restarted poller aborts the child once Popen closes the fds it does not pass (grpc/grpc#43055).
_DIE_WITH_PARENT = """
import contextlib, ctypes, os, signal, sys
with contextlib.suppress(Exception):
    ctypes.CDLL("libc.so.6").prctl(1, signal.SIGKILL)
os.execvp(sys.argv[1], sys.argv[1:])
"""


@dataclass
class ManagedProcess:
    """A child process in its own process group, logging to a file, stopped as a group."""

    name: str
    argv: Sequence[str]
    log_path: Path
    env: dict[str, str] | None = None
    cwd: str | None = None
    proc: subprocess.Popen | None = None

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - owned by the child for its lifetime
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _DIE_WITH_PARENT, *self.argv],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=self.env,
            cwd=self.cwd,
            start_new_session=True,
        )
        log.close()
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, lines: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""

    def stop(self, grace: float = 10.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, proc: ManagedProcess | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and not proc.alive:
            raise ClusterError(f"{proc.name} exited while waiting for {what}:\n{proc.log_tail()}")
        with contextlib.suppress(Exception):
            if predicate():
                return
        time.sleep(0.2)
    tail = f"\n{proc.log_tail()}" if proc else ""
    raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what}{tail}")


# ---------------------------------------------------------------- PKI


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key: ec.EllipticCurvePrivateKey) -> None:
    path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
        )
    )
    path.chmod(0o600)


def _cert(
    subject: x509.Name,
    key: ec.EllipticCurvePrivateKey,
    issuer: x509.Name,
    issuer_key: ec.EllipticCurvePrivateKey,
    *,
    ca: bool = False,
    usage: x509.ObjectIdentifier | None = None,
    sans: list[x509.GeneralName] | None = None,
) -> x509.Certificate:
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=2))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )
    if usage is not None:
        builder = builder.add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _san(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


@dataclass
class Pki:
    dir: Path
    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    admin_cert: Path
    admin_key: Path
    sa_key: Path

    @classmethod
    def create(cls, directory: Path, extra_sans: Sequence[str] = ()) -> Pki:
        """A CA, the apiserver's serving certificate (localhost, 127.0.0.1 and `extra_sans`: DNS names or IPs) and
        the admin client certificate."""
        directory.mkdir(parents=True, exist_ok=True)
        ca_key = _key()
        ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "ferry-local-ca")])
        ca = _cert(ca_name, ca_key, ca_name, ca_key, ca=True)
        pki = cls(
            dir=directory,
            ca_cert=directory / "ca.crt",
            ca_key=directory / "ca.key",
            serving_cert=directory / "apiserver.crt",
            serving_key=directory / "apiserver.key",
            admin_cert=directory / "admin.crt",
            admin_key=directory / "admin.key",
            sa_key=directory / "sa.key",
        )
        pki.ca_cert.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
        _write_key(pki.ca_key, ca_key)
        serving_key = _key()
        serving = _cert(
            x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]),
            serving_key,
            ca_name,
            ca_key,
            usage=ExtendedKeyUsageOID.SERVER_AUTH,
            sans=[_san(n) for n in ("localhost", "127.0.0.1", *extra_sans)],
        )
        pki.serving_cert.write_bytes(serving.public_bytes(serialization.Encoding.PEM))
        _write_key(pki.serving_key, serving_key)
        pki.issue_client_cert("admin", ["system:masters"], pki.admin_cert, pki.admin_key)
        _write_key(pki.sa_key, _key())
        return pki

    def issue_client_cert(self, user: str, groups: list[str], cert_path: Path, key_path: Path) -> None:
        ca = x509.load_pem_x509_certificate(self.ca_cert.read_bytes())
        ca_key = serialization.load_pem_private_key(self.ca_key.read_bytes(), None)
        key = _key()
        name = x509.Name(
            [x509.NameAttribute(NameOID.COMMON_NAME, user)]
            + [x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in groups]
        )
        cert = _cert(name, key, ca.subject, ca_key, usage=ExtendedKeyUsageOID.CLIENT_AUTH)
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key_path, key)


def write_kubeconfig(
    path: Path,
    server: str,
    ca: Path,
    *,
    cert: Path | None = None,
    key: Path | None = None,
    token: str | None = None,
    user: str = "admin",
) -> Path:
    user_entry: dict[str, str] = {}
    if cert and key:
        user_entry = {"client-certificate": str(cert), "client-key": str(key)}
    if token:
        user_entry = {"token": token}
    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "ferry-local", "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": user_entry}],
        "contexts": [{"name": "ferry-local", "context": {"cluster": "ferry-local", "user": user}}],
        "current-context": "ferry-local",
    }
    path.write_text(json.dumps(cfg, indent=2))
    path.chmod(0o600)
    return path


# ---------------------------------------------------------------- S3 (SeaweedFS)


@dataclass
class S3Server:
    """SeaweedFS master + volume + filer + S3 gateway in one `weed server`, bound to 127.0.0.1."""

    workdir: Path
    access_key: str = S3_ACCESS_KEY
    secret_key: str = S3_SECRET_KEY
    port: int = 0
    process: ManagedProcess | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60) -> S3Server:
        self.workdir.mkdir(parents=True, exist_ok=True)
        data = self.workdir / "data"
        data.mkdir(exist_ok=True)
        config = self.workdir / "s3.json"
        config.write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "ferry",
                            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = free_ports(8)
        self.port = s3
        argv = [
            binary("weed"),
            "server",
            f"-dir={data}",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={master}",
            f"-master.port.grpc={master_grpc}",
            "-master.volumeSizeLimitMB=512",
            f"-volume.port={volume}",
            f"-volume.port.grpc={volume_grpc}",
            "-volume.max=50",
            f"-filer.port={filer}",
            f"-filer.port.grpc={filer_grpc}",
            "-s3",
            f"-s3.port={s3}",
            f"-s3.port.grpc={s3_grpc}",
            f"-s3.config={config}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-metricsPort=0",
        ]
        self.process = ManagedProcess("seaweedfs", argv, self.workdir / "weed.log").start()
        wait_until(self._ready, timeout, "SeaweedFS S3", self.process)
        return self

    def client(self):
        import boto3
        from botocore.config import Config

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            region_name="us-east-1",
            config=Config(s3={"addressing_style": "path"}, retries={"max_attempts": 3}),
        )

    def _ready(self) -> bool:
        # The gateway answers before volumes exist; a real round trip proves writes work.
        s3 = self.client()
        probe = "ferry-readiness-probe"
        with contextlib.suppress(Exception):
            s3.create_bucket(Bucket=probe)
        s3.put_object(Bucket=probe, Key="probe", Body=b"ok")
        return s3.get_object(Bucket=probe, Key="probe")["Body"].read() == b"ok"

    def create_bucket(self, name: str) -> None:
        s3 = self.client()
        with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou):
            s3.create_bucket(Bucket=name)

    def env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            # The dev cluster's admin lets every namespace use these (its only) credentials for every bucket at the
            # default endpoint, as a single-tenant cluster would; the chart's default allows nobody.
            ambient.ENV: DEV_AMBIENT_CREDENTIALS,
        }

    def stop(self) -> None:
        if self.process:
            self.process.stop(grace=3)


# ---------------------------------------------------------------- Kubernetes


@dataclass
class LocalCluster:
    """etcd + kube-apiserver (+ kube-controller-manager) on loopback, with a fresh PKI and kubeconfig.

    `pods=True` prepares it for real kubelet nodes (ferry_dev.localnodes): the serving certificate also covers the
    in-cluster `kubernetes` Service (its ClusterIP and DNS names), ServiceAccount admission mounts tokens into
    pods, the controller manager runs all its default controllers (Deployments, DaemonSets, the root CA publisher,
    ...) and a kube-scheduler runs."""

    workdir: Path
    controller_manager: bool = True
    pods: bool = False
    crd_dir: Path | None = CRD_DIR
    processes: list[ManagedProcess] = field(default_factory=list)
    pki: Pki | None = None
    api_port: int = 0
    kubeconfig: Path | None = None

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.api_port}"

    def start(self, timeout: float = 120) -> LocalCluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.pki = Pki.create(self.workdir / "pki", IN_CLUSTER_SANS if self.pods else ())
        etcd_client, etcd_peer, self.api_port = free_ports(3)
        etcd = ManagedProcess(
            "etcd",
            [
                binary("etcd"),
                f"--data-dir={self.workdir / 'etcd'}",
                "--name=ferry",
                f"--listen-client-urls=http://127.0.0.1:{etcd_client}",
                f"--advertise-client-urls=http://127.0.0.1:{etcd_client}",
                f"--listen-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}",
                f"--initial-cluster=ferry=http://127.0.0.1:{etcd_peer}",
                "--unsafe-no-fsync=true",
                "--log-level=warn",
                "--listen-metrics-urls=",
            ],
            self.workdir / "etcd.log",
        ).start()
        self.processes.append(etcd)
        wait_until(
            lambda: urllib.request.urlopen(f"http://127.0.0.1:{etcd_client}/health", timeout=2).status == 200,
            30,
            "etcd health",
            etcd,
        )
        pki = self.pki
        apiserver = ManagedProcess(
            "kube-apiserver",
            [
                binary("kube-apiserver"),
                f"--etcd-servers=http://127.0.0.1:{etcd_client}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.api_port}",
                f"--cert-dir={pki.dir}",
                f"--tls-cert-file={pki.serving_cert}",
                f"--tls-private-key-file={pki.serving_key}",
                f"--client-ca-file={pki.ca_cert}",
                f"--service-account-issuer=https://127.0.0.1:{self.api_port}/",
                f"--service-account-key-file={pki.sa_key}",
                f"--service-account-signing-key-file={pki.sa_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC",
                "--allow-privileged=true",
                "--enable-priority-and-fairness=false",
                "--max-requests-inflight=0",
                "--max-mutating-requests-inflight=0",
                "--profiling=false",
                "--v=1",
                # Without kubelets no pod mounts a token: the Pod objects tests create need no ServiceAccount
                # admission. With kubelets, reach them by their node IPs (10.99.0.N), never a hostname.
                *(
                    ["--kubelet-preferred-address-types=InternalIP"]
                    if self.pods
                    else ["--disable-admission-plugins=ServiceAccount"]
                ),
            ],
            self.workdir / "kube-apiserver.log",
        ).start()
        self.processes.append(apiserver)
        self.kubeconfig = write_kubeconfig(
            self.workdir / "kubeconfig", self.server, pki.ca_cert, cert=pki.admin_cert, key=pki.admin_key
        )
        wait_until(lambda: self.get_raw("/readyz") == "ok", timeout, "kube-apiserver /readyz", apiserver)
        if self.crd_dir is not None:
            # Before the controller manager starts, so its garbage collector discovers them at once (it
            # rediscovers resources only every 30 s).
            self.install_crds(self.crd_dir)
        if self.controller_manager:
            kcm = ManagedProcess(
                "kube-controller-manager",
                [
                    binary("kube-controller-manager"),
                    f"--kubeconfig={self.kubeconfig}",
                    "--leader-elect=false",
                    f"--service-account-private-key-file={pki.sa_key}",
                    f"--root-ca-file={pki.ca_cert}",
                    "--bind-address=127.0.0.1",
                    "--secure-port=0",
                    "--use-service-account-credentials=false",
                    "--controllers=*"
                    if self.pods
                    else "--controllers=garbage-collector-controller,namespace-controller,serviceaccount-controller,"
                    "serviceaccount-token-controller",
                    "--concurrent-gc-syncs=5",
                    "--v=1",
                ],
                self.workdir / "kube-controller-manager.log",
            ).start()
            self.processes.append(kcm)
            # No HTTPS port to probe (--secure-port=0): bad flags make it exit at once, so outliving 2 s is the check.
            time.sleep(2)
            if not kcm.alive:
                raise ClusterError(f"kube-controller-manager exited:\n{kcm.log_tail()}")
        if self.pods:
            port = free_port()
            scheduler = ManagedProcess(
                "kube-scheduler",
                [
                    binary("kube-scheduler"),
                    f"--kubeconfig={self.kubeconfig}",
                    f"--authentication-kubeconfig={self.kubeconfig}",
                    f"--authorization-kubeconfig={self.kubeconfig}",
                    "--leader-elect=false",
                    "--bind-address=127.0.0.1",
                    f"--secure-port={port}",
                    "--v=1",
                ],
                self.workdir / "kube-scheduler.log",
            ).start()
            self.processes.append(scheduler)
            insecure = ssl._create_unverified_context()  # its self-signed serving cert; /healthz is all we read
            wait_until(
                lambda: urllib.request.urlopen(f"https://127.0.0.1:{port}/healthz", context=insecure).status == 200,
                60,
                "kube-scheduler /healthz",
                scheduler,
            )
        return self

    def process(self, name: str) -> ManagedProcess:
        """One of the control plane's processes: `etcd`, `kube-apiserver` or `kube-controller-manager`."""
        return next(p for p in self.processes if p.name == name)

    def stop_apiserver(self) -> None:
        """Kill the kube-apiserver alone, as a crash would (SIGKILL); etcd and everything stored stay."""
        self.process("kube-apiserver").kill()

    def start_apiserver(self, timeout: float = 120) -> None:
        """Start the kube-apiserver again: same port, same etcd, same certificates, so every client's kubeconfig
        still works. A controller manager that gave up meanwhile is started again too."""
        apiserver = self.process("kube-apiserver")
        if apiserver.alive:
            raise ClusterError("kube-apiserver is running")
        apiserver.start()
        wait_until(lambda: self.get_raw("/readyz") == "ok", timeout, "kube-apiserver /readyz", apiserver)
        if self.controller_manager and not self.process("kube-controller-manager").alive:
            self.process("kube-controller-manager").start()

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.pki.ca_cert))
        ctx.load_cert_chain(str(self.pki.admin_cert), str(self.pki.admin_key))
        return ctx

    def get_raw(self, path: str) -> str:
        with urllib.request.urlopen(self.server + path, context=self.ssl_context(), timeout=5) as r:
            return r.read().decode()

    def env(self) -> dict[str, str]:
        return {"KUBECONFIG": str(self.kubeconfig)}

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [binary("kubectl"), f"--kubeconfig={self.kubeconfig}", *args],
            capture_output=True,
            text=True,
            input=input,
            timeout=120,
        )
        if check and proc.returncode != 0:
            raise ClusterError(f"kubectl {' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}")
        return proc

    def pod_token(
        self,
        node: str,
        audience: str,
        path: Path,
        *,
        namespace: str = "ferry-system",
        service_account: str = "ferry-agent",
        pod: str | None = None,
        duration_s: int = 3600,
    ) -> Path:
        """A real pod-bound service-account token, as the kubelet projects one into a Pod on `node`: a TokenRequest
        bound to the Pod of `agent_pod`. Written to `path` (0600)."""
        pod = self.agent_pod(node, namespace=namespace, service_account=service_account, pod=pod)["podName"]
        token = self.kubectl(
            "create",
            "token",
            service_account,
            "-n",
            namespace,
            f"--audience={audience}",
            "--bound-object-kind=Pod",
            f"--bound-object-name={pod}",
            f"--duration={duration_s}s",
        ).stdout.strip()
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(token)
        path.chmod(0o600)
        return path

    def agent_pod(
        self,
        node: str,
        *,
        namespace: str = "ferry-system",
        service_account: str = "ferry-agent",
        pod: str | None = None,
    ) -> dict[str, str]:
        """The Pod an agent on `node` runs as (`<service_account>-<node>` by default), created if missing with its
        Namespace, ServiceAccount and Node: a Pod object with `spec.nodeName` that no kubelet runs; it only has to
        exist for tokens bound to it to carry `authentication.kubernetes.io/node-name`. Returns the identity the
        chart gives the agent through the downward API: podNamespace, serviceAccount, podName, podUid."""
        pod = pod or f"{service_account}-{node}"
        objects = [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
            {
                "apiVersion": "v1",
                "kind": "ServiceAccount",
                "metadata": {"name": service_account, "namespace": namespace},
            },
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": pod, "namespace": namespace},
                "spec": {
                    "nodeName": node,
                    "serviceAccountName": service_account,
                    "automountServiceAccountToken": False,
                    "containers": [{"name": "agent", "image": "ferry-agent:test"}],
                },
            },
        ]
        if self.kubectl("get", "node", node, check=False).returncode != 0:
            objects.insert(0, {"apiVersion": "v1", "kind": "Node", "metadata": {"name": node}})
        self.kubectl("apply", "-f", "-", input="\n".join(json.dumps(o) for o in objects))
        uid = self.kubectl("get", "pod", pod, "-n", namespace, "-o", "jsonpath={.metadata.uid}").stdout.strip()
        return {"podNamespace": namespace, "serviceAccount": service_account, "podName": pod, "podUid": uid}

    def agent_identity_args(self, node: str, **kw: str) -> list[str]:
        """`python -m ferry_agent` flags for the Pod of `agent_pod(node)`: the agent mints its worker tokens, bound
        to that Pod, from this apiserver (with the admin kubeconfig of `env()`)."""
        me = self.agent_pod(node, **kw)
        return [
            "--pod-namespace",
            me["podNamespace"],
            "--service-account",
            me["serviceAccount"],
            "--pod-name",
            me["podName"],
            "--pod-uid",
            me["podUid"],
        ]

    def install_crds(self, crd_dir: Path = CRD_DIR, timeout: float = 60) -> None:
        files = sorted(crd_dir.glob("*.yaml"))
        for f in files:
            self.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(f))
        for f in files:
            name = f.stem.split("_", 1)[1] + "." + f.stem.split("_", 1)[0]
            self.kubectl("wait", "--for=condition=Established", f"crd/{name}", f"--timeout={int(timeout)}s")

    def stop(self) -> None:
        for p in reversed(self.processes):
            p.stop()


@contextlib.contextmanager
def local_stack(
    workdir: Path | None = None, *, s3: bool = True, controller_manager: bool = True, keep: bool = False
) -> Iterator[tuple[LocalCluster, S3Server | None]]:
    """Start the cluster (and S3), yield them, and tear everything down even on error."""
    own_dir = workdir is None
    root = Path(tempfile.mkdtemp(prefix="ferry-local-")) if own_dir else workdir
    cluster = LocalCluster(root / "k8s", controller_manager=controller_manager)
    store = S3Server(root / "s3") if s3 else None
    try:
        cluster.start()
        if store:
            store.start()
        yield cluster, store
    finally:
        if store:
            store.stop()
        cluster.stop()
        if own_dir and not keep:
            shutil.rmtree(root, ignore_errors=True)


def start_operator(
    cluster: LocalCluster,
    workdir: Path,
    *,
    env: dict[str, str] | None = None,
    name: str = "operator",
    args: Sequence[str] = (),
) -> ManagedProcess:
    """The real operator: `kopf run` in its own process, against the local cluster; `args` go to `kopf run`."""
    workdir.mkdir(parents=True, exist_ok=True)
    full_env = {
        **os.environ,
        **cluster.env(),
        "FERRY_METRICS_ADDRESS": "127.0.0.1",
        "FERRY_METRICS_PORT": "0",
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    argv = [sys.executable, "-m", "kopf", "run", "--standalone", "--all-namespaces", "-m", "ferry_operator.main", *args]
    return ManagedProcess(name, argv, workdir / f"{name}.log", env=full_env).start()
