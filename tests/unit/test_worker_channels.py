"""What keeps a peer load's fixed costs small: the worker RPCs of a process share one gRPC channel per source endpoint
(`worker_service.ChannelPool`), and a source's NIXL progress pump hurries once it grants a lease (a reader connects
next: `TensorReadLeases(on_grant=...)`, `NixlPeer.expedite`). Against a real worker service on loopback."""

from __future__ import annotations

import time
from contextlib import nullcontext

import grpc
import pytest

from ferry_agent.transport.holdings import Holdings
from ferry_agent.transport.nixl import NixlPeer
from ferry_agent.transport.worker_service import (
    ChannelPool,
    SourceIdentity,
    TensorReadLeases,
    WorkerServer,
    get_holdings,
    prepare_tensor_read,
)
from tests.support.workers import IDENTITY, FakeClock, manifest_proto

pytestmark = pytest.mark.unit


def serve(port: int = 0, identity: SourceIdentity = IDENTITY, max_readers: int | None = None) -> WorkerServer:
    manifest = manifest_proto(identity)
    names = [t.name for t in manifest.tensors]
    server = WorkerServer(
        manifest,
        leases=TensorReadLeases(60, max_readers=max_readers),
        holdings=Holdings.full(names, dict.fromkeys(names, "00000001")),
        port=port,
    )
    server.start()
    return server


def test_a_lease_its_refusals_and_its_release_ride_one_channel() -> None:
    pool = ChannelPool()
    server = serve(max_readers=1)
    try:
        lease = prepare_tensor_read(server.endpoint, IDENTITY, connect=pool.stub)
        channel = pool._channels[server.endpoint].channel
        with pytest.raises(grpc.RpcError) as refused:  # the source answered: the connection is fine
            prepare_tensor_read(server.endpoint, IDENTITY, connect=pool.stub)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        get_holdings(server.endpoint, IDENTITY, 2, connect=pool.stub)
        lease.close()
        assert list(pool._channels) == [server.endpoint] and pool._channels[server.endpoint].channel is channel
    finally:
        server.stop()
        pool.close()


def test_an_unanswered_call_drops_the_channel_and_a_restarted_source_is_reached_afresh() -> None:
    pool = ChannelPool()
    server = serve()
    port = server.port
    prepare_tensor_read(server.endpoint, IDENTITY, connect=pool.stub).close()
    server.stop()
    with pytest.raises(grpc.RpcError) as gone:
        get_holdings(server.endpoint, IDENTITY, 2, timeout_s=2, connect=pool.stub)
    assert gone.value.code() == grpc.StatusCode.UNAVAILABLE
    assert server.endpoint not in pool._channels
    restarted = SourceIdentity(IDENTITY.agent_name, "inst-2")
    server = serve(port, restarted)
    try:
        # The old instance is refused by name (FAILED_PRECONDITION, not UNAVAILABLE: the source was reached); the new
        # one is served.
        with pytest.raises(grpc.RpcError) as replaced:
            prepare_tensor_read(server.endpoint, IDENTITY, connect=pool.stub)
        assert replaced.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        prepare_tensor_read(server.endpoint, restarted, connect=pool.stub).close()
    finally:
        server.stop()
        pool.close()


def test_a_channel_is_closed_only_once_no_call_uses_it_and_idle_ones_go() -> None:
    clock = FakeClock()
    pool = ChannelPool(idle_s=10, clock=clock)
    server, other = serve(), serve()
    try:
        with pool.stub(server.endpoint) as outer:
            with pytest.raises(RuntimeError), pool.stub(server.endpoint):
                raise RuntimeError("a failed call on the shared channel")
            assert server.endpoint not in pool._channels  # out of the pool ...
            get_holdings(server.endpoint, IDENTITY, 2, connect=lambda _: nullcontext(outer))  # ... but still usable
        get_holdings(server.endpoint, IDENTITY, 2, connect=pool.stub)
        clock.now += 11
        get_holdings(other.endpoint, IDENTITY, 2, connect=pool.stub)
        assert list(pool._channels) == [other.endpoint]  # the idle one was closed
    finally:
        server.stop()
        other.stop()
        pool.close()


def test_a_granted_lease_hurries_the_pump_a_refused_one_does_not() -> None:
    granted: list[int] = []
    leases = TensorReadLeases(60, max_readers=1, on_grant=lambda: granted.append(1))
    leases.acquire()
    with pytest.raises(RuntimeError):
        leases.acquire()  # SourceBusy
    assert granted == [1]


class CountingAgent:
    def __init__(self) -> None:
        self.progressed = 0

    def get_new_notifs(self) -> dict:
        self.progressed += 1
        return {}


def test_expedite_makes_an_idle_pump_progress_at_once() -> None:
    agent = CountingAgent()
    peer = NixlPeer("t", agent=agent)
    peer.start_progress(interval_s=3600)  # idle: it would never tick within the test
    try:
        peer.expedite(30)
        deadline = time.monotonic() + 10
        while agent.progressed < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert agent.progressed >= 3
    finally:
        peer.stop_progress()
