"""The pipelined fan-out's pieces: chunking and choice (`strategies.fanout`), holdings (`transport.holdings`), the
reader limit of a source's leases, and the holdings a real worker service hands out."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from ferry_agent.strategies import fanout
from ferry_agent.strategies.fanout import HolderView, choose, chunks_held, lease_batch, plan_chunks
from ferry_agent.transport.holdings import Holdings, HoldingsView, decode_bitmap, encode_bitmap
from ferry_agent.transport.worker_service import (
    SourceBusy,
    SourceIdentity,
    TensorReadLeases,
    WorkerServer,
    get_holdings,
    prepare_tensor_read,
)
from tests.support.workers import IDENTITY, manifest_proto

pytestmark = pytest.mark.unit


def test_chunks_are_consecutive_tensors_of_at_least_the_chunk_size() -> None:
    chunks = plan_chunks([4, 4, 4, 10, 1, 1], 8)
    assert [c.tensors for c in chunks] == [(0, 1), (2, 3), (4, 5)]
    assert [c.nbytes for c in chunks] == [8, 14, 2]
    assert [c.index for c in chunks] == [0, 1, 2]
    assert plan_chunks([0, 0], 8)[0].tensors == (0, 1)  # empty tensors ride along
    with pytest.raises(ValueError):
        plan_chunks([1], 0)


def test_a_chunk_is_held_once_every_tensor_of_it_is() -> None:
    chunks = plan_chunks([4] * 6, 8)
    assert chunks_held(chunks, {0, 1, 2, 4, 5}) == frozenset({0, 2})


def test_choose_takes_the_lowest_needed_chunk_from_the_first_usable_holder_in_order() -> None:
    ranked = [
        HolderView("a", frozenset({2, 3})),
        HolderView("b", frozenset({1, 2, 3}), usable=False),  # at its reader limit
        HolderView("c", frozenset({1, 3})),
    ]
    # Chunk 0 nobody has; chunk 1 only b (full) and c: c, with every needed chunk it has, in one lease.
    assert choose([0, 1, 2, 3], ranked) == ("c", [1, 3])
    assert choose([2, 3], ranked) == ("a", [2, 3])
    assert choose([0], ranked) is None
    assert choose([0], [HolderView("new", None)]) == ("new", [0])  # not asked yet: its lease says


def test_a_lease_takes_the_short_last_chunk_along_rather_than_leave_it_a_lease_of_its_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(fanout, "LEASE_BYTES", 96)  # leases of two 48-byte chunks (1 GiB of 16 MiB, scaled down)
    chunks = plan_chunks([48, 48, 10], 48)  # two full chunks and the short rest (a version of 1 GiB and a scalar)
    assert lease_batch(chunks, 48) == chunks
    more = plan_chunks([48, 48, 48, 10], 48)
    assert lease_batch(more, 48) == more[:2]  # more than the short rest left: the cap holds
    full = plan_chunks([48, 48, 48], 48)
    assert lease_batch(full, 48) == full[:2]  # a full last chunk is worth a lease of its own


def test_holdings_bitmaps_and_views() -> None:
    assert decode_bitmap(encode_bitmap({0, 3, 9}, 12), 12) == frozenset({0, 3, 9})
    h = Holdings(["a", "b", "c"])
    h.mark({"b": "0000000b"})
    view = HoldingsView.from_proto(h.to_proto(readers=2, max_readers=4), 3)
    assert view.held == frozenset({1}) and view.checksums == ("", "0000000b", "") and not view.full
    assert (view.readers, view.max_readers) == (2, 4)
    with pytest.raises(ValueError):
        h.mark({"b": "ffffffff"})  # a held tensor never changes
    h.mark({"a": "0000000a", "c": "0000000c"})
    assert HoldingsView.from_proto(h.to_proto(), 3).full and h.complete


def test_a_held_tensor_without_a_checksum_cannot_be_read() -> None:
    h = Holdings(["a", "b"])
    msg = h.to_proto()
    msg.held = encode_bitmap({0, 1}, 2)  # a source that claims tensors it lists no checksum for
    assert HoldingsView.from_proto(msg, 2).held == frozenset()


def test_unchanged_tensors_count_only_once_held() -> None:
    h = Holdings(["a", "b", "c"])
    h.set_base("uid-v1", ["a", "c"])
    assert HoldingsView.from_proto(h.to_proto(), 3).unchanged == frozenset()
    h.mark({"a": "0000000a"})
    view = HoldingsView.from_proto(h.to_proto(), 3)
    assert (view.base_uid, view.unchanged) == ("uid-v1", frozenset({0}))


def test_wait_returns_once_more_is_held() -> None:
    h = Holdings(["a", "b"])
    threading.Timer(0.05, lambda: h.mark({"a": "1"})).start()
    started = time.monotonic()
    h.wait(0, 5.0)
    assert h.count == 1 and time.monotonic() - started < 4


def test_a_source_grants_at_most_max_readers_leases_at_once() -> None:
    leases = TensorReadLeases(60, max_readers=2)
    a, _ = leases.acquire(), leases.acquire()
    with pytest.raises(SourceBusy):
        leases.acquire()
    leases.release(a)
    leases.acquire()
    assert leases.peak == 2 and leases.active_count() == 2


def test_the_worker_service_refuses_a_reader_beyond_the_limit_and_lists_its_holdings() -> None:
    manifest = manifest_proto()
    names = [t.name for t in manifest.tensors]
    holdings = Holdings(names)
    server = WorkerServer(manifest, leases=TensorReadLeases(60, max_readers=1), holdings=holdings)
    server.start()
    try:
        identity = SourceIdentity(IDENTITY.agent_name, IDENTITY.instance_id)
        lease = prepare_tensor_read(server.endpoint, identity)
        assert lease.holdings.held == frozenset() and lease.holdings.max_readers == 1
        with pytest.raises(grpc.RpcError) as refused:
            prepare_tensor_read(server.endpoint, identity)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        lease.close()

        threading.Timer(0.1, lambda: holdings.mark({names[0]: "00000001"})).start()
        view = get_holdings(server.endpoint, identity, len(names), known=0, wait_s=2.0)  # a long poll
        assert view.held == frozenset({0}) and view.checksums[0] == "00000001"
        assert prepare_tensor_read(server.endpoint, identity).holdings.held == frozenset({0})
    finally:
        server.stop()


def test_a_lease_takes_at_most_a_gib_of_chunks() -> None:
    from ferry_agent.strategies.fanout import lease_chunks

    assert lease_chunks(16 << 20) == 64 and lease_chunks(32 << 30) == 1
    assert choose([0, 1, 2, 3], [HolderView("a", frozenset({0, 1, 2, 3}))], 2) == ("a", [0, 1])
