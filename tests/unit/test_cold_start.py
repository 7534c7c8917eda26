"""The desired-version cold start (`run_cold_start`) over real gloo process groups, and the rank tensor split."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from ferry_agent.ranks.agreement import SingleRank, TorchRankGroup
from ferry_agent.ranks.cold_start import run_cold_start
from ferry_agent.ranks.sharding import rank_of_tensors, rank_specs
from ferry_agent.store.resident import TensorSpec
from ferry_agent.strategies.chain import LoadContext, StrategyFailed, StrategyRecoveryError
from tests.support.ranks import spawn

pytestmark = [pytest.mark.unit, pytest.mark.timeout(90)]


# ---------------------------------------------------------------- sharding


def _specs(sizes: list[int]) -> list[TensorSpec]:
    return [TensorSpec(f"t{i:02d}", "torch.uint8", (n,), n) for i, n in enumerate(sizes)]


@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_every_tensor_goes_to_exactly_one_rank_and_ranks_stay_balanced(world: int) -> None:
    specs = _specs([1000, 10, 500, 500, 250, 250, 250, 250, 7, 0, 1, 999])
    shares = [rank_specs(specs, r, world) for r in range(world)]
    names = [s.name for share in shares for s in share]
    assert sorted(names) == sorted(s.name for s in specs)  # a partition: nothing lost, nothing twice
    loads = [sum(s.nbytes for s in share) for share in shares]
    assert max(loads) - min(loads) <= max(s.nbytes for s in specs)  # greedy: within one tensor of each other
    for share in shares:  # each share keeps the manifest's order
        assert [s.name for s in share] == sorted(s.name for s in share)


def test_split_depends_only_on_the_manifest() -> None:
    specs = _specs([300, 200, 100, 100, 50])
    assert rank_of_tensors(specs, 2) == rank_of_tensors(list(reversed(specs)), 2)
    assert rank_of_tensors(specs, 2) == {"t00": 0, "t01": 1, "t02": 1, "t03": 0, "t04": 1}


def test_bad_rank_or_world_is_refused() -> None:
    with pytest.raises(ValueError, match="outside a world of 2"):
        rank_specs(_specs([1]), 2, 2)
    with pytest.raises(ValueError, match="at least 1"):
        rank_of_tensors(_specs([1]), 0)


# ---------------------------------------------------------------- cold start over gloo


class Fake:
    """A strategy whose availability and outcome per rank the test chooses; records what happened."""

    def __init__(self, name: str, outcome: str, *, available: bool = True, mutated: bool = False) -> None:
        self.name, self.outcome, self.available, self.mutated = name, outcome, available, mutated
        self.loads = 0
        self.rollbacks = 0

    def is_available(self, ctx: LoadContext) -> bool:
        return self.available

    def load(self, ctx: LoadContext) -> str:
        self.loads += 1
        if self.outcome == "miss":
            raise StrategyFailed(f"{self.name} has nothing for rank {ctx.rank}", mutated=self.mutated)
        if self.outcome == "boom":
            raise KeyError("unexpected")
        return f"{self.name}:{ctx.version}:rank{ctx.rank}"

    def rollback(self, ctx: LoadContext) -> None:
        self.rollbacks += 1


def _ctx(group: TorchRankGroup) -> LoadContext:
    return LoadContext(model="m", version="", rank=group.rank, target_id="r", world_size=group.world_size)


def _all_miss_then_seed(group: TorchRankGroup) -> Any:
    peer, seed = Fake("Peer", "miss", mutated=True), Fake("LocalFile", "loaded")
    reinits: list[int] = []
    ctx = _ctx(group)
    result = run_cold_start(
        group,
        ctx,
        configured="v2",
        source_order=["Peer", "ObjectStorage"],
        strategies={"Peer": peer},
        exact=[seed],
        reinit=lambda c: reinits.append(c.rank),
    )
    return result, [(a.source, str(a.outcome), a.reason) for a in ctx.attempts], reinits, peer.rollbacks


def test_all_ranks_miss_a_peer_so_all_fall_through_together(tmp_path: Path) -> None:
    results = spawn(tmp_path, 2, _all_miss_then_seed)
    for rank, (status, (result, attempts, reinits, rollbacks)) in enumerate(results):
        assert status == "ok", results
        assert result == f"LocalFile:v2:rank{rank}"
        assert attempts == [("Peer", "Failed", "FailedMutated"), ("LocalFile", "Loaded", "Loaded")]
        assert reinits == [rank] and rollbacks == 1  # `mutated` survives the agreement: rollback + reinit


def _mixed_peer(group: TorchRankGroup) -> Any:
    released: list[str] = []
    peer = Fake("Peer", "loaded" if group.rank == 0 else "boom")
    try:
        run_cold_start(
            group,
            _ctx(group),
            configured="v2",
            source_order=["Peer"],
            strategies={"Peer": peer},
            exact=[Fake("LocalFile", "loaded")],
            release=released.append,
        )
    except StrategyRecoveryError as exc:
        return str(exc), released, peer.rollbacks
    return None


def test_one_rank_loading_while_another_misses_is_fatal_and_the_loaded_rank_releases(tmp_path: Path) -> None:
    results = spawn(tmp_path, 2, _mixed_peer)
    for rank, (status, outcome) in enumerate(results):
        assert status == "ok" and outcome is not None, results
        message, released, rollbacks = outcome
        assert "Peer for 'v2': mixed peer outcomes: rank 0: 'loaded'; rank 1: 'miss'" in message
        assert ("KeyError" in message) == (rank == 1)  # each rank adds its own failure, if it had one
        # The chain stops (no LocalFile); what rank 0 loaded is released, not leaked.
        assert released == (["Peer:v2:rank0"] if rank == 0 else []) and rollbacks == 1


def _conflicting(group: TorchRankGroup) -> Any:
    peer = Fake("Peer", "loaded")
    run_cold_start(
        group,
        _ctx(group),
        configured=["llama-v1", "llama-v2"][group.rank],
        source_order=["Peer"],
        strategies={"Peer": peer},
    )
    return peer.loads


def test_ranks_configured_with_different_versions_fail_naming_both(tmp_path: Path) -> None:
    for status, message, _cause in spawn(tmp_path, 2, _conflicting):
        assert status == "fatal"
        assert "rank 0 pins 'llama-v1' but rank 1 is configured with 'llama-v2'" in message


def _no_desired_version(group: TorchRankGroup) -> Any:
    peer, agnostic = Fake("Peer", "loaded"), Fake("LocalFile", "loaded")
    ctx = _ctx(group)
    result = run_cold_start(
        group, ctx, configured=None, source_order=["Peer"], strategies={"Peer": peer}, version_agnostic=[agnostic]
    )
    return result, peer.loads, ctx.version


def test_no_desired_version_runs_only_the_version_agnostic_path(tmp_path: Path) -> None:
    for rank, (status, (result, peer_loads, version)) in enumerate(spawn(tmp_path, 2, _no_desired_version)):
        assert status == "ok"
        assert result == f"LocalFile::rank{rank}" and peer_loads == 0 and version == ""


def test_no_desired_version_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    ctx = LoadContext(model="m", version="", rank=0, target_id="r")
    with caplog.at_level(logging.WARNING):
        run_cold_start(
            SingleRank(),
            ctx,
            configured=None,
            source_order=["Peer"],
            strategies={},
            version_agnostic=[Fake("LocalFile", "loaded")],
        )
    assert "no desired version, so only the version-agnostic strategies run (LocalFile)" in caplog.text


def _uneven_sources(group: TorchRankGroup) -> Any:
    strategies: dict[str, Any] = {"Peer": Fake("Peer", "miss")}
    if group.rank == 0:
        strategies["ObjectStorage"] = Fake("ObjectStorage", "loaded")  # rank 1 has no checkpoint store
    return run_cold_start(
        group, _ctx(group), configured="v1", source_order=["Peer", "ObjectStorage"], strategies=strategies
    )


def test_a_rank_lacking_a_source_disagrees_on_the_order(tmp_path: Path) -> None:
    for status, message, _cause in spawn(tmp_path, 2, _uneven_sources):
        assert status == "fatal"
        assert message == "source order disagreement: rank 0: ('Peer', 'ObjectStorage'); rank 1: ('Peer',)"


def _availability_differs(group: TorchRankGroup) -> Any:
    peer = Fake("Peer", "loaded", available=group.rank == 1)
    return run_cold_start(group, _ctx(group), configured="v1", source_order=["Peer"], strategies={"Peer": peer})


def test_availability_must_agree(tmp_path: Path) -> None:
    for status, message, _cause in spawn(tmp_path, 2, _availability_differs):
        assert status == "fatal" and message.startswith("result disagreement during Peer_available"), message


def test_unknown_source_is_refused() -> None:
    with pytest.raises(ValueError, match=r"unknown source\(s\) \['Trainer'\]"):
        run_cold_start(
            SingleRank(),
            LoadContext(model="m", version="", rank=0, target_id="r"),
            configured="v1",
            source_order=["Trainer"],
            strategies={},
        )


class FailingRollback(Fake):
    def rollback(self, ctx: LoadContext) -> None:
        super().rollback(ctx)
        if ctx.rank == 1:
            raise OSError("cannot free the target on rank 1")


def _rollback_fails_on_one_rank(group: TorchRankGroup) -> Any:
    seed = Fake("LocalFile", "loaded")
    run_cold_start(
        group,
        _ctx(group),
        configured="v1",
        source_order=["Peer"],
        strategies={"Peer": FailingRollback("Peer", "miss")},
        exact=[seed],
    )
    return seed.loads


def test_a_rollback_failing_on_one_rank_stops_every_rank(tmp_path: Path) -> None:
    """After an agreed miss every rank would go on to the next source; one rank that cannot clean up must not
    leave the others waiting for it in the next collective."""
    for status, message, _cause in spawn(tmp_path, 2, _rollback_fails_on_one_rank):
        assert status == "fatal"
        assert "rollback of Peer failed" in message and "Peer_rollback" in message
        assert "cannot free the target on rank 1" in message


def _rank_one_leaves(group: TorchRankGroup) -> Any:
    group.all_gather_object("joined")  # the group is whole (gloo connects its mesh while the ranks start)
    if group.rank == 1:
        return "left"  # its process ends: the group loses a member
    return run_cold_start(
        group, _ctx(group), configured="v1", source_order=["Peer"], strategies={"Peer": Fake("Peer", "loaded")}
    )


def test_a_rank_that_leaves_the_group_is_fatal_for_the_rest(tmp_path: Path) -> None:
    (rank0, rank1) = spawn(tmp_path, 2, _rank_one_leaves, timeout=60)
    assert rank1 == ("ok", "left")
    assert rank0[0] == "fatal" and rank0[1].startswith("rank group "), rank0
