"""Real NIXL (UCX over loopback) on the host store's memory: a writable memfd target is READ into, sealed read-only
in place, and then serves READs itself, with the same bytes at every hop."""

from __future__ import annotations

import itertools

import pytest
import torch

from ferry_agent.attach.memstore import HostStore
from ferry_agent.store.resident import TensorSpec
from ferry_agent.transport.nixl import NixlPeer, describe

pytestmark = pytest.mark.e2e


def test_sealed_memfd_memory_is_a_nixl_target_and_then_a_read_only_source():
    store = HostStore()
    specs = [TensorSpec(f"w{i}", "torch.float32", (256, 64 + i), 256 * (64 + i) * 4) for i in range(6)]
    specs.append(TensorSpec("ids", "torch.int64", (33,), 33 * 8))
    first = store.allocate(("ns", "a"), specs, "ns/m/v1")
    gen = torch.Generator().manual_seed(7)
    for t in first.tensors.values():
        t.copy_(torch.randint(-(2**30), 2**30, t.shape, generator=gen).to(t.dtype))
    store.seal(first, "ns/m/v1", "v1")
    peers = [NixlPeer(f"sealed-{i}") for i in range(3)]
    try:
        source = first
        for hop, (serving, reading) in enumerate(itertools.pairwise(peers)):
            serving.register(source)  # read-only, sealed pages
            serving.start_progress()
            target = store.allocate(("ns", f"hop{hop}"), specs, f"ns/m/v1#{hop}")
            reading.register(target)
            name = reading.add_remote(serving.metadata())
            try:
                moved = reading.read(name, describe(source), target, timeout_s=60)
            finally:
                reading.remove_remote(name)
            assert moved == sum(s.nbytes for s in specs)
            reading.deregister(target)
            store.seal(target, f"ns/m/v1#{hop}", "v1")  # in place: what was READ is what is served next
            for spec in specs:
                assert torch.equal(target.tensors[spec.name], first.tensors[spec.name]), (hop, spec.name)
            source = target
    finally:
        for peer in peers:
            peer.shutdown()
