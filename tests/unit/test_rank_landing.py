"""The local leader's landing (`ranks.landing`) under a two-rank S3 cold start, over forked gloo ranks and an
in-memory S3 (the real S3 path: tests/cluster/test_rank_cold_start.py): one stream from S3 for the replica, the
follower copies its share from the leader's sealed memory, the store is written only once every rank loaded."""

from __future__ import annotations

import fcntl
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from ferry.client.protocol import REQUIRED_SEALS
from ferry_agent.ranks.agreement import TorchRankGroup
from ferry_agent.ranks.cold_start import run_cold_start
from ferry_agent.ranks.landing import Landing, MappedLanding
from ferry_agent.store.checkpoints import CheckpointStore
from ferry_agent.store.resident import ResidentWeights, TensorSpec
from ferry_agent.strategies.chain import LoadContext
from tests.support.ranks import spawn
from tests.support.s3 import KEY, MODEL, full, shas, weights
from tests.unit.test_s3_stream import publish, strategy

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def test_a_landing_is_sealed_before_a_follower_maps_it() -> None:
    specs = {1: [TensorSpec("a", "torch.uint8", (300,), 300)], 2: [TensorSpec("b", "torch.uint8", (5,), 5)]}
    landing = Landing(specs, "test")
    landing.views["a"][:] = 7
    landing.views["b"][:] = 9
    descriptor = landing.descriptor()
    with pytest.raises(ValueError, match="not sealed"):
        MappedLanding(descriptor, 1)
    landing.seal()
    fd = os.open(f"/proc/self/fd/{descriptor['fd']}", os.O_RDWR)
    try:
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & REQUIRED_SEALS == REQUIRED_SEALS
        with pytest.raises(PermissionError):  # nobody can write the checked bytes any more, the leader included
            mmap.mmap(fd, descriptor["size"], flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
    finally:
        os.close(fd)
    mapped = MappedLanding(descriptor, 1)
    assert [s.name for s in mapped.specs] == ["a"]
    mine = ResidentWeights.allocate(mapped.specs, "cpu")
    with ThreadPoolExecutor(2) as pool:
        mapped.copy_share(mine, pool)
    assert mine.tensors["a"].tolist() == [7] * 300
    landing.close()


def _cold_start(files: dict[str, bytes], root: Path):
    def run(group: TorchRankGroup) -> Any:
        s3, versions = publish(files)
        store = CheckpointStore(root, quota_bytes=1 << 30)
        loader = strategy(store, s3, versions)
        ctx = LoadContext(model=MODEL, version="", rank=group.rank, target_id="replica-0", world_size=2)
        result = run_cold_start(
            group, ctx, configured="v1", source_order=["ObjectStorage"], strategies={"ObjectStorage": loader}
        )
        state = store.state(KEY)  # on the leader: after its write-behind
        return shas(result.resident.tensors), s3.gets, result.bytes_downloaded, result.landed, state.version

    return run


def test_two_ranks_stream_once_and_the_follower_copies_from_the_leader(tmp_path: Path) -> None:
    w1 = weights(5)
    results = spawn(tmp_path, 2, _cold_start(full(w1), tmp_path / "node-store"), timeout=50)
    assert all(r[0] == "ok" for r in results), results
    (shas0, gets0, down0, landed0, v0), (shas1, gets1, down1, landed1, _) = (r[1] for r in results)
    assert {**shas0, **shas1} == shas(w1) and not set(shas0) & set(shas1)
    assert gets0 > 0 and down0 > 0 and (gets1, down1) == (0, 0)  # one read of S3, by the leader
    assert landed0 is None and landed1 is None  # the served result does not keep the landing alive
    assert v0 == "v1"  # the leader stored and activated it once both ranks had loaded
