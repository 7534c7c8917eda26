"""The local leader's landing (`ranks.landing`) under a two-rank S3 cold start, over forked gloo ranks and an
in-memory S3 (the real S3 path: tests/cluster/test_rank_cold_start.py): one stream from S3 for the replica, the
follower serves its share of the leader's sealed memory as it is (a GPU one copies it), the store is written only
once every rank loaded."""

from __future__ import annotations

import fcntl
import functools
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from ferry import checkpoint_format as ckpt
from ferry.client.protocol import REQUIRED_SEALS
from ferry_agent.attach.memstore import HostStore
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
    # What the stream checks each tensor against travels with the landing: the followers serve with it.
    checksums = {"a": ckpt.adler32_hex(bytes([7] * 300)), "b": ckpt.adler32_hex(bytes([9] * 5))}
    landing = Landing(specs, "test", checksums)
    landing.views["a"][:] = 7
    landing.views["b"][:] = 9
    descriptor = landing.descriptor()
    with pytest.raises(ValueError, match="not sealed"):
        MappedLanding(descriptor, 1)
    landing.seal()
    (fd1,), (fd2,) = descriptor["ranks"][1]["fds"], descriptor["ranks"][2]["fds"]
    assert fd1 != fd2  # each follower's share in chunks of its own
    fd = os.open(f"/proc/self/fd/{fd1}", os.O_RDWR)
    try:
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & REQUIRED_SEALS == REQUIRED_SEALS
        with pytest.raises(PermissionError):  # nobody can write the checked bytes any more, the leader included
            mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_WRITE)
    finally:
        os.close(fd)
    mapped = MappedLanding(descriptor, 1)
    assert [s.name for s in mapped.specs] == ["a"]
    mine = ResidentWeights.allocate(mapped.specs, "cpu")
    with ThreadPoolExecutor(2) as pool:  # a GPU rank's path: a copy into its own memory
        mapped.copy_share(mine, pool)
    assert mine.tensors["a"].tolist() == [7] * 300
    assert mine.checksums == {"a": checksums["a"]} == {"a": ckpt.adler32_hex(mine.tensors["a"].numpy())}

    # A CPU rank's path: the landing's pages themselves, read-only, through descriptors of its own.
    host = HostStore()
    shared = mapped.share(None, functools.partial(host.map_sealed, "replica"))
    landing.close()  # the leader lets go; the follower's share keeps the memory
    assert shared.tensors["a"].tolist() == [7] * 300 and shared.checksums == {"a": checksums["a"]}
    assert host.resident_bytes("replica") == 0  # counted once sealed as a version of the replica
    sealed = host.seal(shared, "share")
    assert host.resident_bytes("replica") == 300 and sealed.chunk_sizes == descriptor["ranks"][1]["sizes"]
    assert os.readlink(f"/proc/self/fd/{sealed.fds[0]}").startswith("/memfd:ferry:test#1:0")
    maps = Path("/proc/self/maps").read_text().splitlines()
    mine_mapped = [line for line in maps if "ferry:test#1:0" in line]
    assert mine_mapped and all(line.split()[1] == "r--s" for line in mine_mapped)  # read-only, shared: no copy


def test_a_follower_refuses_a_landing_that_was_not_sealed_or_changed_size() -> None:
    specs = {1: [TensorSpec("a", "torch.float32", (64,), 256)]}
    landing = Landing(specs, "test")
    (fd,) = landing.descriptor()["ranks"][1]["fds"]
    os.ftruncate(fd, 512)  # grown before any seal
    landing.seal()
    with pytest.raises(ValueError, match="has 512 bytes"):
        MappedLanding(landing.descriptor(), 1)
    with pytest.raises(ValueError, match="holds nothing for rank 2"):
        MappedLanding(landing.descriptor(), 2)
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
        held = {mapping_of(t.data_ptr()) for t in result.resident.tensors.values() if t.numel()}
        return shas(result.resident.tensors), s3.gets, result.bytes_downloaded, result.landed, state.version, held

    return run


def mapping_of(address: int) -> str:
    """The permissions and file of this process's mapping that holds `address` (/proc/self/maps)."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        begin, end = (int(x, 16) for x in fields[0].split("-"))
        if begin <= address < end:
            return f"{fields[1]} {fields[5] if len(fields) > 5 else ''}"
    raise AssertionError(f"{address:#x} is not mapped")


def test_two_ranks_stream_once_and_the_follower_maps_the_leaders_pages(tmp_path: Path) -> None:
    w1 = weights(5)
    results = spawn(tmp_path, 2, _cold_start(full(w1), tmp_path / "node-store"), timeout=50)
    assert all(r[0] == "ok" for r in results), results
    (shas0, gets0, down0, landed0, v0, _), (shas1, gets1, down1, landed1, _, held1) = (r[1] for r in results)
    # The follower holds no copy: its tensors are the leader's sealed landing pages, mapped read-only.
    assert held1 == {f"r--s /memfd:ferry:landing:{KEY}/v1#1:0 (deleted)"}, held1
    assert {**shas0, **shas1} == shas(w1) and not set(shas0) & set(shas1)
    assert gets0 > 0 and down0 > 0 and (gets1, down1) == (0, 0)  # one read of S3, by the leader
    assert landed0 is None and landed1 is None  # the served result does not keep the landing alive
    assert v0 == "v1"  # the leader stored and activated it once both ranks had loaded
