"""Multi-rank attach over a real socket: each rank's sealed share is adopted by the agent through /proc/<pid>/fd
(here this process plays the rank), `attach(rank=r)` maps share r and `attach()` all of them."""

from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from pathlib import Path

import pytest
import torch

from ferry.client import AttachError, attach
from ferry_agent.attach.memstore import HostStore, adopt_rank
from ferry_agent.attach.server import Pod
from ferry_agent.attach.service import AttachService
from ferry_agent.ranks.sharding import rank_specs
from ferry_agent.store.resident import spec_of

pytestmark = pytest.mark.unit

KEY = ("ns", "tp-node")


def weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    return {f"layer{i}.weight": torch.randn((8 + i, 16), generator=gen) for i in range(6)}


def rank_memory(tensors: dict[str, torch.Tensor], rank: int) -> tuple[HostStore, dict]:
    """What a rank process reports: its own store's sealed share."""
    store = HostStore()
    mine = rank_specs([spec_of(n, t) for n, t in sorted(tensors.items())], rank, 2)
    resident = store.allocate(KEY, mine, f"ns/m/v1#{rank}")
    for spec in mine:
        resident.tensors[spec.name].copy_(tensors[spec.name])
    sealed = store.seal(resident, f"ns/m/v1#{rank}", "v1", "uid-1")
    memory = {
        "fds": sealed.fds,
        "chunks": sealed.chunk_sizes,
        "tensors": [{**e.to_json(), "sha256": e.sha256} for e in sealed.entries],
    }
    return store, memory


@pytest.fixture
def service():
    root = Path(tempfile.mkdtemp(prefix="ferry-t-", dir="/tmp"))
    svc = AttachService(None, "n1", root, store=HostStore())
    svc.server.start()
    yield svc
    svc.server.stop()
    shutil.rmtree(root, ignore_errors=True)


def test_a_consumer_attaches_one_rank_or_all_and_leases_outlive_the_rank_processes(service):
    tensors = weights()
    agent_store = service._store
    ranks = [rank_memory(tensors, r) for r in range(2)]
    shares = [adopt_rank(agent_store, KEY, f"ns/m/v1#{r}", "v1", "uid-1", os.getpid(), ranks[r][1]) for r in range(2)]
    del ranks  # the "rank processes" let go of their chunks: the agent's descriptors hold them
    service.serve_ranks(KEY, {"modelLoad": "tp", "modelName": "m", "version": "v1"}, shares, "uid-1")
    for share in shares:
        share.unref()  # as the replica's hold goes when it stops: the offer holds them now
    pod = Pod(str(uuid.uuid4()), "ns", "engine")
    service.server.add_pod(pod)
    pod_dir = service.server.pods_dir / pod.uid
    owner = {s.name: r for r in range(2) for s in rank_specs([spec_of(n, t) for n, t in tensors.items()], r, 2)}

    with attach("tp", socket_dir=pod_dir, timeout=5, rank=1, verify=True) as one:
        assert one.rank == 1 and sorted(one.tensors()) == sorted(n for n, r in owner.items() if r == 1)
        for name, view in one.tensors().items():
            assert torch.equal(view, tensors[name])
        with attach("tp", socket_dir=pod_dir, timeout=5, verify=True) as whole:
            assert sorted(whole.tensors()) == sorted(tensors)
            for name, view in whole.tensors().items():
                assert torch.equal(view, tensors[name])
        assert agent_store.resident_bytes(KEY) == sum(t.numel() * 4 for t in tensors.values())
        service.withdraw(KEY)  # the replica moves on: only the share still leased stays
        assert agent_store.resident_bytes(KEY) == sum(tensors[n].numel() * 4 for n, r in owner.items() if r == 1)
        for name, view in one.tensors().items():
            assert torch.equal(view, tensors[name])
    assert agent_store.resident_bytes(KEY) == 0  # the last lease gone: freed


def test_a_rank_beyond_the_replica_is_refused(service):
    tensors = weights()
    stores, shares = [], []
    for r in range(2):
        store, memory = rank_memory(tensors, r)
        stores.append(store)
        shares.append(adopt_rank(service._store, KEY, f"ns/m/v1#{r}", "v1", "uid-1", os.getpid(), memory))
    service.serve_ranks(KEY, {"modelLoad": "tp", "modelName": "m", "version": "v1"}, shares, "uid-1")
    pod = Pod(str(uuid.uuid4()), "ns", "engine")
    service.server.add_pod(pod)
    with pytest.raises(AttachError, match="2 rank"):
        attach("tp", socket_dir=service.server.pods_dir / pod.uid, timeout=1, rank=2)


def test_a_share_that_is_not_sealed_or_smaller_than_reported_is_refused():
    store = HostStore()
    fd = os.memfd_create("ferry:unsealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, 4096)
        memory = {
            "fds": [fd],
            "chunks": [4096],
            "tensors": [
                {
                    "name": "w",
                    "dtype": "float32",
                    "shape": [4],
                    "chunk": 0,
                    "offset": 0,
                    "nbytes": 16,
                    "adler32": 1,
                    "sha256": "0" * 64,
                }
            ],
        }
        with pytest.raises(ValueError, match="not sealed"):
            adopt_rank(store, KEY, "x", "v1", None, os.getpid(), memory)
        _, sealed = rank_memory(weights(), 0)
        small = {**sealed, "chunks": [c * 2 for c in sealed["chunks"]]}
        with pytest.raises(ValueError, match="expected"):
            adopt_rank(store, KEY, "x", "v1", None, os.getpid(), small)
        outside = {**sealed, "tensors": [{**sealed["tensors"][0], "offset": sealed["chunks"][0]}]}
        with pytest.raises(ValueError, match="outside"):
            adopt_rank(store, KEY, "x", "v1", None, os.getpid(), outside)
        assert store.resident_bytes() == 0  # nothing of a refused share is kept
    finally:
        os.close(fd)
