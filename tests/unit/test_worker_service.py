"""Tensor read leases and the Worker gRPC service, on a real in-process gRPC server."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from ferry_agent.transport.nixl import ManifestMismatchError
from ferry_agent.transport.proto import worker_pb2_grpc
from ferry_agent.transport.worker_service import (
    SourceDraining,
    SourceIdentity,
    SourceManifest,
    TensorReadLeases,
    WorkerServer,
    WorkerService,
    get_tensor_manifest,
    lease_ttl_seconds,
    prepare_tensor_read,
    release_tensor_read,
)
from tests.support.workers import IDENTITY, FakeClock, code_of, manifest_proto, weights

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("timeout", "ttl"), [(300, 630), (900, 1830), (10, 270), (120, 270), (120.2, 271), (0, 270)])
def test_lease_ttl_formula(timeout: float, ttl: int) -> None:
    assert lease_ttl_seconds(timeout) == ttl


def test_default_ttl_follows_the_transfer_timeout() -> None:
    assert TensorReadLeases().ttl_s == 630
    assert TensorReadLeases(transfer_timeout_s=900).ttl_s == 1830
    assert TensorReadLeases(5, transfer_timeout_s=900).ttl_s == 5


def test_acquire_release_and_lazy_expiry() -> None:
    clock = FakeClock()
    leases = TensorReadLeases(60, clock=clock)
    a, b = leases.acquire(), leases.acquire()
    assert a != b and leases.active_count() == 2
    assert leases.release(a) is True
    assert leases.release(a) is False  # twice: unknown
    assert leases.release("nope") is False
    clock.now += 59.9
    assert leases.active_count() == 1
    clock.now += 0.1
    assert leases.active_count() == 0  # expired on observation, no timer thread
    assert leases.release(b) is False


def test_drain_without_leases_closes_until_resumed() -> None:
    leases = TensorReadLeases(60)
    leases.drain(0)
    assert not leases.accepting
    with pytest.raises(SourceDraining):
        leases.acquire()
    leases.resume()
    assert leases.accepting
    leases.acquire()


def test_drain_timeout_reopens_and_raises() -> None:
    leases = TensorReadLeases(60)
    lease = leases.acquire()
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="1 tensor read lease"):
        leases.drain(0.1)
    assert 0.1 <= time.monotonic() - started < 2
    assert leases.accepting  # re-enabled: the caller must not mutate
    assert leases.release(lease)


def test_drain_waits_for_release() -> None:
    leases = TensorReadLeases(60)
    lease = leases.acquire()
    timer = threading.Timer(0.1, leases.release, args=(lease,))
    timer.start()
    leases.drain(5)
    timer.join()
    assert leases.active_count() == 0 and not leases.accepting


def test_drain_completes_when_leases_expire() -> None:
    clock = FakeClock()
    leases = TensorReadLeases(30, clock=clock)
    leases.acquire()

    def expire() -> None:
        clock.now += 31

    timer = threading.Timer(0.1, expire)
    timer.start()
    leases.drain(5)
    timer.join()
    assert leases.active_count() == 0


def test_ttl_must_be_positive() -> None:
    with pytest.raises(ValueError):
        TensorReadLeases(0)


# ------------------------------------------------------------------------------------------ gRPC


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def server(clock: FakeClock) -> Iterator[WorkerServer]:
    srv = WorkerServer(manifest_proto(), leases=TensorReadLeases(60, clock=clock))
    srv.start()
    yield srv
    srv.stop(0)


def test_binds_loopback_on_a_picked_port(server: WorkerServer) -> None:
    assert server.port > 0
    assert server.endpoint == f"127.0.0.1:{server.port}"


def test_manifest_round_trip(server: WorkerServer) -> None:
    m = get_tensor_manifest(server.endpoint, IDENTITY, timeout_s=5)
    w = weights()
    assert m.identity == IDENTITY and m.rank == 2 and m.nixl_metadata == b"nixl-blob"
    assert m.digest == w.digest and m.total_bytes == w.total_bytes
    assert [t.name for t in m.tensors] == ["b", "w"]
    assert m.tensors[1].dtype == "torch.float32" and m.tensors[1].shape == (16,) and m.tensors[1].mem_type == "DRAM"


def test_identity_is_validated_on_every_rpc(server: WorkerServer) -> None:
    ep = server.endpoint
    empty, other, wrong_instance = SourceIdentity(""), SourceIdentity("other"), SourceIdentity("src-agent", "inst-2")
    for ident, code in (
        (empty, grpc.StatusCode.INVALID_ARGUMENT),
        (other, grpc.StatusCode.FAILED_PRECONDITION),
        (wrong_instance, grpc.StatusCode.FAILED_PRECONDITION),
    ):
        assert code_of(lambda i=ident: get_tensor_manifest(ep, i)) == code
        assert code_of(lambda i=ident: prepare_tensor_read(ep, i)) == code
        assert code_of(lambda i=ident: release_tensor_read(ep, i, "x")) == code
    assert server.leases.active_count() == 0
    # The instance id is optional; the agent name alone is accepted.
    assert get_tensor_manifest(ep, SourceIdentity("src-agent")).identity == IDENTITY


def test_lease_lifecycle_over_grpc(server: WorkerServer, clock: FakeClock) -> None:
    lease = prepare_tensor_read(server.endpoint, IDENTITY, reader="replica-t")
    assert lease.ttl_s == 60 and lease.manifest.digest == weights().digest
    assert server.leases.active_count() == 1
    lease.close()
    lease.close()  # idempotent: no second RPC, so no NOT_FOUND
    assert server.leases.active_count() == 0
    assert code_of(lambda: release_tensor_read(server.endpoint, IDENTITY, lease.lease_id)) == grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: release_tensor_read(server.endpoint, IDENTITY, "unknown")) == grpc.StatusCode.NOT_FOUND

    expired = prepare_tensor_read(server.endpoint, IDENTITY)
    clock.now += 61
    assert code_of(expired.close) == grpc.StatusCode.NOT_FOUND


def test_draining_refuses_new_reads_but_accepts_releases(server: WorkerServer) -> None:
    lease = prepare_tensor_read(server.endpoint, IDENTITY)
    drained = threading.Thread(target=server.drain, args=(5,))
    drained.start()
    deadline = time.monotonic() + 5
    while server.leases.accepting and time.monotonic() < deadline:
        time.sleep(0.01)
    assert code_of(lambda: get_tensor_manifest(server.endpoint, IDENTITY)) == grpc.StatusCode.UNAVAILABLE
    assert code_of(lambda: prepare_tensor_read(server.endpoint, IDENTITY)) == grpc.StatusCode.UNAVAILABLE
    lease.close()  # a release must get through, or a drain could never finish
    drained.join(5)
    assert not drained.is_alive() and server.leases.active_count() == 0


def test_drain_timeout_over_the_server_reopens(server: WorkerServer) -> None:
    lease = prepare_tensor_read(server.endpoint, IDENTITY)
    with pytest.raises(TimeoutError):
        server.drain(0.05)
    prepare_tensor_read(server.endpoint, IDENTITY).close()
    lease.close()


def test_client_times_out_per_call() -> None:
    # A listener that never answers: the call must end at its deadline, not hang.
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    try:
        started = time.monotonic()
        code = code_of(lambda: get_tensor_manifest(f"127.0.0.1:{sock.getsockname()[1]}", IDENTITY, timeout_s=0.3))
        assert code in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
        assert time.monotonic() - started < 3
    finally:
        sock.close()


def test_manifest_must_match_its_digest() -> None:
    msg = manifest_proto()
    msg.tensors[0].nbytes += 2
    with pytest.raises(ManifestMismatchError):
        SourceManifest.from_proto(msg)


class LyingService(WorkerService):
    """Grants a lease but answers with another source's manifest."""

    def PrepareTensorRead(self, request, context):  # type: ignore[no-untyped-def]
        response = super().PrepareTensorRead(request, context)
        response.manifest.source.agent_name = "someone-else"
        return response


def test_rejected_lease_response_is_released_immediately() -> None:
    leases = TensorReadLeases(60)
    srv = grpc.server(futures.ThreadPoolExecutor(2))
    worker_pb2_grpc.add_WorkerServicer_to_server(LyingService(manifest_proto(), leases), srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    try:
        with pytest.raises(RuntimeError, match="answered as someone-else"):
            prepare_tensor_read(f"127.0.0.1:{port}", IDENTITY)
        assert leases.active_count() == 0
    finally:
        srv.stop(0)
