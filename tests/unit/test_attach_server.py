"""The attach server and `ferry.client` over a real Unix socket: leases, scoping, and hostile clients."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import struct
import tempfile
import time
import uuid
from pathlib import Path

import pytest
import torch

from ferry.client import AttachError, attach, request, watch
from ferry.client import protocol as p
from ferry_agent.attach.memstore import seal_tensors
from ferry_agent.attach.server import AttachServer, Offer, Pod

pytestmark = pytest.mark.unit


def weights(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"layer.weight": torch.randn((16, 8), generator=gen), "layer.bias": torch.randn(16, generator=gen)}


@pytest.fixture
def server():
    root = Path(tempfile.mkdtemp(prefix="ferry-t-", dir="/tmp"))  # sun_path is short: no pytest tmp_path
    srv = AttachServer(root, max_connections_per_pod=4, max_leases_per_connection=2)
    srv.start()
    yield srv
    srv.stop()
    shutil.rmtree(root, ignore_errors=True)


def add_pod(server: AttachServer, namespace: str = "ns") -> Path:
    pod = Pod(str(uuid.uuid4()), namespace, f"engine-{namespace}")
    server.add_pod(pod)
    path = server.pods_dir / pod.uid
    assert (path / p.SOCKET_NAME).exists()
    return path


def offer(
    server: AttachServer, version: str = "v1", seed: int = 1, namespace: str = "ns", tensors: dict | None = None
) -> dict:
    tensors = tensors or weights(seed)
    sealed = seal_tensors(tensors, f"{namespace}/m/{version}")
    server.offer((namespace, "ml-node"), Offer(namespace, "ml", "m", version, f"uid-{version}", sealed))
    return tensors


def attached(server: AttachServer) -> int:
    return sum(v["attached"] for v in server.snapshot())


def raw(path: Path) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(str(path / p.SOCKET_NAME))
    sock.settimeout(5)
    return sock


def eventually(predicate, timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_attach_maps_the_sealed_bytes_and_the_lease_is_the_connection(server):
    pod = add_pod(server)
    tensors = offer(server)
    with attach("ml", socket_dir=pod, timeout=5, verify=True) as w:
        assert (w.version, w.version_uid, w.model, w.rank) == ("v1", "uid-v1", "m", 0)
        views = w.tensors()
        for name, t in tensors.items():
            assert torch.equal(views[name], t)
        assert attached(server) == 1
        module = torch.nn.ModuleDict({"layer": torch.nn.Linear(8, 16)})
        before = module["layer"].weight.data_ptr()
        assert w.load_into(module).loaded == ["layer.bias", "layer.weight"]
        assert module["layer"].weight.data_ptr() == before  # copied in place
        assert torch.equal(module["layer"].weight, tensors["layer.weight"])
    assert attached(server) == 0
    # By the model's name too; a connection closed without a release drops its lease.
    w = attach("m", socket_dir=pod, timeout=5)
    assert attached(server) == 1
    w._sock.close()
    eventually(lambda: attached(server) == 0)


def test_a_withdrawn_version_stays_mapped_while_leased(server):
    pod = add_pod(server)
    tensors = offer(server, "v1", seed=1)
    old = attach("ml", socket_dir=pod, timeout=5)
    sealed = server._offers[("ns", "ml-node")].sealed
    offer(server, "v2", seed=2)  # the node moved on: v1 is withdrawn, not freed
    assert not sealed.closed
    assert [v["offered"] for v in server.snapshot()] == [True, False]
    with attach("ml", socket_dir=pod, timeout=5) as new:
        assert new.version == "v2" and old.version == "v1"
        assert torch.equal(old.tensors()["layer.weight"], tensors["layer.weight"])
        with pytest.raises(AttachError, match="NotServed"):
            attach("ml", socket_dir=pod, timeout=0, version="v1")
    old.close()
    assert sealed.closed  # released: the agent let the memory go


def test_load_into_strict(server):
    pod = add_pod(server)
    tensors = offer(server)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(8, 16)
            self.register_buffer("scale", torch.ones(1), persistent=False)

    net = Net()
    with attach("ml", socket_dir=pod, timeout=5) as w:
        w.load_into(net)  # the non-persistent buffer is not required
        assert torch.equal(net.layer.weight, tensors["layer.weight"])
        assert torch.equal(net.layer.bias, tensors["layer.bias"])
        with pytest.raises(AttachError, match="missing"):
            w.load_into(torch.nn.Sequential(torch.nn.Linear(8, 16)))
        result = w.load_into(torch.nn.Sequential(torch.nn.Linear(8, 16)), strict=False)
        assert result.missing == ["0.bias", "0.weight"] and result.unexpected == ["layer.bias", "layer.weight"]
        with pytest.raises(AttachError, match="ShapeMismatch"):
            w.load_into(torch.nn.ModuleDict({"layer": torch.nn.Linear(4, 16)}))


def test_scoping_and_bad_requests_get_error_replies(server):
    pod = add_pod(server)
    other = add_pod(server, "other")
    offer(server)
    with pytest.raises(AttachError, match="NotServed"):
        attach("ml", socket_dir=other, timeout=0)  # another namespace's pod does not see it
    with pytest.raises(AttachError, match="Forbidden"):
        attach("ml", namespace="ns", socket_dir=other, timeout=0)
    with pytest.raises(AttachError, match="BadRequest"):
        attach("ml", socket_dir=pod, timeout=0, rank=1)
    with pytest.raises(AttachError, match="NotServed"):
        attach("nope", socket_dir=pod, timeout=0)
    assert request({"op": "hello"}, socket_dir=pod)["pod"]["namespace"] == "ns"
    assert [v["version"] for v in request({"op": "list"}, socket_dir=other)["versions"]] == []
    sock = raw(pod)
    for bad in (
        {"op": "explode"},
        {"op": "attach", "name": 5},
        {"op": "attach", "name": "ml", "rank": "x"},
        {"op": "release", "lease": "nope"},
    ):
        p.send_frame(sock, bad)
        reply, _ = p.recv_frame(sock, max_bytes=p.MAX_REPLY_BYTES)
        assert reply["ok"] is False, bad
    # The same connection still works: a well-framed bad request costs nothing.
    p.send_frame(sock, {"op": "attach", "name": "ml"})
    reply, fds = p.recv_frame(sock, max_bytes=p.MAX_REPLY_BYTES, max_fds=p.MAX_FDS)
    assert reply["ok"] and len(fds) == len(reply["chunks"])
    p.close_all(fds)
    p.send_frame(sock, {"op": "attach", "name": "ml"})
    p.close_all(p.recv_frame(sock, max_bytes=p.MAX_REPLY_BYTES, max_fds=p.MAX_FDS)[1])
    p.send_frame(sock, {"op": "attach", "name": "ml"})
    reply, _ = p.recv_frame(sock, max_bytes=p.MAX_REPLY_BYTES, max_fds=p.MAX_FDS)
    assert reply["error"]["code"] == p.TOO_MANY_LEASES
    sock.close()


@pytest.mark.parametrize(
    "garbage",
    [
        b"\xff\xff\xff\xff",  # a 4 GiB length prefix
        struct.pack(">I", 10) + b"not json!!",
        struct.pack(">I", 2) + b"[]",
        struct.pack(">I", 100) + b"{",  # then EOF mid-frame
        b"\x00",  # EOF inside the length prefix
    ],
)
def test_malformed_clients_are_disconnected_and_the_server_keeps_serving(server, garbage):
    pod = add_pod(server)
    tensors = offer(server)
    sock = raw(pod)
    sock.sendall(garbage)
    sock.shutdown(socket.SHUT_WR)
    data = b"".join(iter(lambda: sock.recv(4096), b""))  # an error frame at most, then EOF
    if data:
        assert json.loads(data[4:])["ok"] is False
    sock.close()
    with attach("ml", socket_dir=pod, timeout=5) as w:
        assert torch.equal(w.tensors()["layer.bias"], tensors["layer.bias"])
    assert attached(server) == 0


@pytest.mark.parametrize("depth", [p.MAX_DEPTH, 30_000], ids=["past-the-limit", "past-the-parser"])
def test_a_deeply_nested_frame_gets_an_error_reply_and_no_traceback(server, depth, caplog):
    pod = add_pod(server)
    tensors = offer(server)
    sock = raw(pod)
    nested = b'{"op":"attach","name":' + b"[" * depth + b"]" * depth + b"}"  # depth + 1 levels with the object
    assert len(nested) <= p.MAX_REQUEST_BYTES
    sock.sendall(struct.pack(">I", len(nested)) + nested)
    reply, _ = p.recv_frame(sock, max_bytes=p.MAX_REPLY_BYTES)
    assert reply == p.error(p.BAD_REQUEST, f"frame nests deeper than {p.MAX_DEPTH} levels")
    assert sock.recv(1) == b""  # disconnected
    sock.close()
    assert not [r for r in caplog.records if r.exc_info]
    with attach("ml", socket_dir=pod, timeout=5) as w:  # the socket still serves
        assert torch.equal(w.tensors()["layer.bias"], tensors["layer.bias"])


def test_frames_nested_up_to_the_limit_are_read():
    left, right = socket.socketpair()
    message = {"op": "list", "x": [[{"k": []}]] * 2}  # MAX_DEPTH levels once wrapped, the most accepted
    for _ in range(p.MAX_DEPTH - 5):  # five levels in the innermost message
        message = {"n": message}
    p.send_frame(left, message)
    assert p.recv_frame(right, max_bytes=p.MAX_REQUEST_BYTES)[0] == message
    left.close()
    right.close()


def test_descriptors_sent_to_the_agent_are_refused(server):
    pod = add_pod(server)
    offer(server)
    sock = raw(pod)
    r, w = os.pipe()
    p.send_frame(sock, {"op": "list"}, [r, w])
    reply, _ = p.recv_frame(sock, max_bytes=p.MAX_REPLY_BYTES)
    assert reply["ok"] is False and "descriptors" in reply["error"]["message"]
    with contextlib.suppress(ConnectionResetError):  # the same as EOF, with the rest of the frame unread
        assert sock.recv(1) == b""  # disconnected
    os.close(r)
    os.close(w)
    with attach("ml", socket_dir=pod, timeout=5):
        pass


def test_connections_per_pod_are_bounded(server):
    pod = add_pod(server)
    offer(server)
    held = [attach("ml", socket_dir=pod, timeout=5) for _ in range(4)]
    sock = raw(pod)
    reply, _ = p.recv_frame(sock, max_bytes=p.MAX_REPLY_BYTES)
    assert reply["error"]["code"] == p.TOO_MANY_LEASES
    sock.close()
    for w in held:
        w.close()
    with attach("ml", socket_dir=pod, timeout=5):
        assert attached(server) == 1


def test_a_removed_pod_loses_its_socket(server):
    pod = add_pod(server)
    server.sync_pods([])
    assert not pod.exists()
    with pytest.raises(AttachError, match="NoSocket"):
        attach("ml", socket_dir=pod, timeout=0)


def test_watch_and_refit_only_changed(tmp_path):
    """Through AttachService.serve, which compares each version with the replica's previous one."""
    from ferry_agent.attach.service import AttachService
    from ferry_agent.store.resident import ResidentWeights

    root = Path(tempfile.mkdtemp(prefix="ferry-t-", dir="/tmp"))
    service = AttachService(None, "node", root)  # no API: pods are added by hand
    service.server.start()
    try:
        pod = add_pod(service.server)
        key, spec = ("ns", "ml-node"), {"modelLoad": "ml", "modelName": "m"}
        v1 = weights(1)
        v2 = {**v1, "layer.bias": v1["layer.bias"] + 1}
        versions = watch("ml", socket_dir=pod, timeout=10)
        service.serve(key, {**spec, "version": "v1"}, ResidentWeights(v1), "uid-1")
        assert next(versions) == "v1"
        module = torch.nn.ModuleDict({"layer": torch.nn.Linear(8, 16)})
        ptrs = [t.data_ptr() for t in module.parameters()]
        with attach("ml", socket_dir=pod, timeout=5) as w1:
            assert w1.base_uid is None
            assert w1.load_into(module, only_changed=True).loaded == ["layer.bias", "layer.weight"]  # no base
            service.withdraw(key)
            service.serve(key, {**spec, "version": "v2"}, ResidentWeights(v2), "uid-2")
            assert next(versions) == "v2"
            # Make before break: v2 leased while v1 still is.
            with attach("ml", socket_dir=pod, timeout=5, version="v2") as w2:
                assert w2.base_uid == "uid-1"
                result = w2.load_into(module, only_changed=True)
                assert result.loaded == ["layer.bias"] and result.skipped == ["layer.weight"]
                assert attached(service.server) == 2
        assert torch.equal(module["layer"].bias, v2["layer.bias"]) and torch.equal(
            module["layer"].weight, v1["layer.weight"]
        )
        assert [t.data_ptr() for t in module.parameters()] == ptrs
        # A module that does not hold the base is loaded whole.
        fresh = torch.nn.ModuleDict({"layer": torch.nn.Linear(8, 16)})
        with attach("ml", socket_dir=pod, timeout=5) as w2:
            assert w2.load_into(fresh, only_changed=True).loaded == ["layer.bias", "layer.weight"]
        assert torch.equal(fresh["layer"].weight, v1["layer.weight"])
        versions.close()
    finally:
        service.server.stop()
        shutil.rmtree(root, ignore_errors=True)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to play the kubelet and to drop to the agent's uid")
def test_socket_binds_in_a_pod_directory_the_kubelet_made_first():
    """The kubelet creates a consumer's subPath (pods/<uid>) itself when it gets there before the agent: as root,
    with the socket root's mode (kubelet's SafeMakeDir). The agent (uid 65532, as in the chart) still binds the
    pod's socket there."""
    agent_id = 65532
    root = Path(tempfile.mkdtemp(prefix="ferry-k-", dir="/tmp"))
    os.chown(root, agent_id, agent_id)  # what the chart's chown-host-paths init container does
    uid = str(uuid.uuid4())
    to_agent_r, to_agent_w = os.pipe()
    to_kubelet_r, to_kubelet_w = os.pipe()
    child = os.fork()
    if child == 0:  # the agent
        code = 1
        try:
            os.setgroups([])
            os.setgid(agent_id)
            os.setuid(agent_id)
            srv = AttachServer(root)
            srv.start()
            os.write(to_kubelet_w, b"s")
            os.read(to_agent_r, 1)  # the kubelet made pods/<uid>
            srv.add_pod(Pod(uid=uid, namespace="team-a", name="engine"))
            code = 0 if (root / "pods" / uid / p.SOCKET_NAME).is_socket() else 3
            srv.stop()
        finally:
            os._exit(code)
    try:
        assert os.read(to_kubelet_r, 1) == b"s"
        made = root / "pods" / uid
        mode = os.stat(root).st_mode & 0o7777
        os.mkdir(made)  # as root, like the kubelet; the group comes from pods/ where it is setgid
        os.chmod(made, mode)
        assert os.stat(made).st_uid == 0
        os.write(to_agent_w, b"m")
        _, status = os.waitpid(child, 0)
        assert os.waitstatus_to_exitcode(status) == 0, "the agent could not bind the socket in the kubelet's dir"
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _die(srv: AttachServer) -> None:
    """What the kernel does to an agent process that exits: no more accepts, then every consumer connection closed.
    In that order, so a consumer that reconnects at once cannot reach the dying agent's still-open listener."""
    listeners = list(srv._listeners.values())
    srv.stop()
    for listener in listeners:
        for conn in list(listener.connections):
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)


def test_a_mapping_outlives_an_agent_restart_and_the_next_agent_lists_it_again():
    root = Path(tempfile.mkdtemp(prefix="ferry-t-", dir="/tmp"))
    pod = Pod(str(uuid.uuid4()), "ns", "engine-ns")
    first = AttachServer(root)
    first.start()
    second = AttachServer(root)
    try:
        first.add_pod(pod)
        tensors = offer(first)
        w = attach("ml", socket_dir=first.pods_dir / pod.uid, timeout=5)
        (entry,) = first.attachments()[("ns", "ml-node")]
        assert (entry["podUid"], entry["version"]) == (pod.uid, "v1")
        _die(first)

        second.start()
        second.add_pod(pod)
        assert second.attachments() == {}
        offer(second, "v2", seed=2)  # the next agent serves the ModelLoad's next version
        eventually(lambda: ("ns", "ml-node") in second.attachments())
        (again,) = second.attachments()[("ns", "ml-node")]
        assert {k: again[k] for k in ("pod", "podNamespace", "podUid", "version")} == {
            "pod": "engine-ns",
            "podNamespace": "ns",
            "podUid": pod.uid,
            "version": "v1",
        }
        assert attached(second) == 0  # no memory of the new agent is leased
        for name, t in tensors.items():  # still the first agent's bytes, mapped
            assert torch.equal(w.tensors()[name], t)
        w.close()
        eventually(lambda: second.attachments() == {})
    finally:
        second.stop()
        shutil.rmtree(root, ignore_errors=True)


def test_an_announcement_is_of_the_pods_own_namespace_and_bounded(server):
    pod = add_pod(server)
    offer(server)
    sock = raw(pod)
    for message, code in [
        ({"op": "announce", "modelLoad": "ml"}, p.BAD_REQUEST),
        ({"op": "announce", "modelLoad": "ml", "version": ["v1"]}, p.BAD_REQUEST),
        ({"op": "announce", "modelLoad": "ml", "version": "v1", "rank": -1}, p.BAD_REQUEST),
        ({"op": "announce", "modelLoad": "ml", "version": "v1", "namespace": "other"}, p.FORBIDDEN),
    ]:
        p.send_frame(sock, message)
        reply, _ = p.recv_frame(sock, max_bytes=p.MAX_REPLY_BYTES)
        assert reply["error"]["code"] == code, message
    for version in ("v0", "v1"):  # the server's 2 leases a connection
        p.send_frame(sock, {"op": "announce", "modelLoad": "ml", "version": version})
        assert p.recv_frame(sock, max_bytes=p.MAX_REPLY_BYTES)[0]["ok"]
    p.send_frame(sock, {"op": "announce", "modelLoad": "ml", "version": "v9"})
    assert p.recv_frame(sock, max_bytes=p.MAX_REPLY_BYTES)[0]["error"]["code"] == p.TOO_MANY_LEASES
    assert [e["version"] for e in server.attachments()[("ns", "ml-node")]] == ["v0", "v1"]
    sock.close()
    eventually(lambda: server.attachments() == {})


def test_the_default_cap_fits_a_tensor_parallel_engine_with_refit_and_sidecar():
    """TP 8 (a connection per worker), their 8 refit connections and the sidecar's: 17 at once, on the defaults."""
    root = Path(tempfile.mkdtemp(prefix="ferry-t-", dir="/tmp"))
    srv = AttachServer(root)
    srv.start()
    try:
        pod = add_pod(srv)
        offer(srv)
        held = [attach("ml", socket_dir=pod, timeout=5) for _ in range(17)]
        assert attached(srv) == 17
        for w in held:
            w.close()
    finally:
        srv.stop()
        shutil.rmtree(root, ignore_errors=True)
