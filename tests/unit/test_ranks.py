"""Rank agreement over real gloo process groups: 2-3 forked processes on 127.0.0.1 sharing a FileStore."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ferry_agent.ranks.agreement import (
    S3Steps,
    SingleRank,
    TorchRankGroup,
    agree_desired_version,
    agree_peer_outcome,
    agree_phase,
    agree_source_order,
    s3_phases,
)
from ferry_agent.strategies.chain import StrategyRecoveryError
from ferry_dev.localcluster import free_port
from tests.support.ranks import spawn

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]


def _steps(calls: list[tuple[str, float]], fail: dict[str, str] | None = None) -> S3Steps:
    def step(name: str, value: Any = None) -> Callable[[], Any]:
        def run() -> Any:
            calls.append((name, time.monotonic()))
            if fail and name in fail:
                raise OSError(fail[name])
            return value

        return run

    load = step("load")

    def load_from(prepared: Any) -> None:
        assert prepared == "the leader's landing"  # every rank is told what the leader prepared
        load()

    return S3Steps(step("chain", ("v1", "v3")), step("prepare", "the leader's landing"), load_from, step("activate"))


def _agree_everything(group: TorchRankGroup) -> Any:
    configured = {0: "v3", 1: None, 2: "v3"}[group.rank]  # rank 1 configures nothing and follows rank 0
    desired = agree_desired_version(group, configured)
    order = agree_source_order(group, ["Peer", "ObjectStorage"], pinned=desired, configured=configured)
    available = agree_phase(group, "s3_available", pinned=desired, configured=configured, result=True)
    outcome = agree_peer_outcome(group, "miss", phase="Peer_outcome", pinned=desired, configured=configured)
    calls: list[tuple[str, float]] = []
    chain = s3_phases(group, _steps(calls), pinned=desired, configured=configured)
    return desired, order, available, outcome, chain, calls


@pytest.mark.parametrize("rendezvous", ["file-store", "tcp"])
def test_agreement_succeeds(tmp_path: Path, rendezvous: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    results = spawn(tmp_path if rendezvous == "file-store" else None, 3, _agree_everything)
    assert all(r[0] == "ok" for r in results), results
    for _, (desired, order, available, outcome, chain, _) in results:
        assert (desired, order, available, outcome, chain) == (
            "v3",
            ("Peer", "ObjectStorage"),
            True,
            "miss",
            ("v1", "v3"),
        )
    calls = [dict(r[1][5]) for r in results]
    assert list(calls[0]) == ["chain", "prepare", "load", "activate"]  # rank 0 leads: prepares first, activates
    assert all(list(c) == ["chain", "load"] for c in calls[1:])  # the chain is resolved while the leader prepares
    assert calls[0]["prepare"] < min(c["load"] for c in calls)  # every rank loads what the leader prepared
    assert max(c["chain"] for c in calls) < min(c["load"] for c in calls)  # and only once every chain agreed
    assert calls[0]["activate"] > max(c["load"] for c in calls)  # activated only once every rank loaded


def test_no_desired_version_runs_only_version_agnostic_path(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ferry_agent.ranks.agreement"):
        assert agree_desired_version(SingleRank(), "") is None
    assert "only the version-agnostic load path runs" in caplog.text
    assert agree_desired_version(SingleRank(), "v1") == "v1"


def _conflicting_versions(group: TorchRankGroup) -> Any:
    return agree_desired_version(group, {0: "v1", 1: "v2", 2: None}[group.rank])


def test_different_desired_versions_are_fatal_on_every_rank(tmp_path: Path) -> None:
    results = spawn(tmp_path, 3, _conflicting_versions)
    for result in results:
        assert result[0] == "fatal", results
        assert "rank 0 pins 'v1' but rank 1 is configured with 'v2'" in result[1]
        assert "rank 2" not in result[1]  # nothing configured is not a conflict


def _peer_outcomes(group: TorchRankGroup) -> Any:
    messages = []
    for outcomes in (("loaded", "miss", "loaded"), ("miss", "miss", "fatal")):
        try:
            agree_peer_outcome(group, outcomes[group.rank], phase="Peer_outcome", pinned="v1", configured="v1")
        except StrategyRecoveryError as exc:
            messages.append(str(exc))
    return messages, agree_peer_outcome(group, "loaded", phase="Peer_outcome", pinned="v1", configured="v1")


def test_mixed_peer_outcomes_are_fatal_on_every_rank(tmp_path: Path) -> None:
    results = spawn(tmp_path, 3, _peer_outcomes)
    for status, (messages, agreed) in results:
        assert status == "ok" and agreed == "loaded"
        assert messages == [
            "mixed peer outcomes: rank 0: 'loaded'; rank 1: 'miss'; rank 2: 'loaded'",
            "peer load was fatal on rank(s) [2]: rank 0: 'miss'; rank 1: 'miss'; rank 2: 'fatal'",
        ]


def _phase_disagreements(group: TorchRankGroup) -> Any:
    messages = []
    attempts: list[Callable[[], Any]] = [
        lambda: agree_phase(group, "s3_available", pinned="v1", configured="v1", result=group.rank == 0),
        lambda: agree_phase(group, f"phase{group.rank}", pinned="v1", configured=None, result=True),
        lambda: agree_source_order(
            group, ["Peer", "ObjectStorage"][:: 1 if group.rank else -1], pinned="v1", configured=None
        ),
    ]
    for attempt in attempts:
        try:
            attempt()
        except StrategyRecoveryError as exc:
            messages.append(str(exc))
    return messages


def test_phase_and_order_disagreement_are_fatal_on_every_rank(tmp_path: Path) -> None:
    results = spawn(tmp_path, 2, _phase_disagreements)
    for status, messages in results:
        assert status == "ok" and len(messages) == 3, results
        assert messages[0] == (
            "result disagreement during s3_available: "
            "rank 0: ('s3_available', 'v1', 'v1', True); rank 1: ('s3_available', 'v1', 'v1', False)"
        )
        assert messages[1].startswith("phase disagreement during phase") and "'phase0'" in messages[1]
        assert "'phase1'" in messages[1]
        assert (
            messages[2]
            == "source order disagreement: rank 0: ('ObjectStorage', 'Peer'); rank 1: ('Peer', 'ObjectStorage')"
        )


def _out_of_step(group: TorchRankGroup) -> Any:
    """Rank 1 skipped the Peer source: both ranks report "miss", but for different strategies, and rank 1 is
    configured with another version than the one pinned; each collective must refuse instead of agreeing."""
    messages = []
    attempts: list[Callable[[], Any]] = [
        lambda: agree_peer_outcome(
            group, "miss", phase=("Peer_outcome", "LocalFile_outcome")[group.rank], pinned="v1", configured="v1"
        ),
        lambda: agree_peer_outcome(
            group, "miss", phase="Peer_outcome", pinned="v1", configured=("v1", "v2")[group.rank]
        ),
        lambda: agree_source_order(group, ["Peer"], pinned=("v1", "v2")[group.rank], configured=None),
        # A rank still in the source-order step meets one already reporting an outcome.
        lambda: (
            agree_source_order(group, ["Peer"], pinned="v1", configured="v1")
            if group.rank == 0
            else agree_peer_outcome(group, "miss", phase="Peer_outcome", pinned="v1", configured="v1")
        ),
    ]
    for attempt in attempts:
        try:
            attempt()
            messages.append("agreed")
        except StrategyRecoveryError as exc:
            messages.append(str(exc))
    return messages


def test_out_of_step_ranks_never_agree_by_accident(tmp_path: Path) -> None:
    results = spawn(tmp_path, 2, _out_of_step)
    for status, messages in results:
        assert status == "ok", results
        assert messages[0].startswith("phase disagreement during "), messages
        assert "LocalFile_outcome" in messages[0] and "Peer_outcome" in messages[0]
        assert messages[1].startswith("desired-version disagreement during Peer_outcome"), messages
        assert messages[2].startswith("desired-version disagreement during source_order"), messages
        assert messages[3].startswith("phase disagreement during "), messages


def _desired_meets_other_collective(group: TorchRankGroup) -> Any:
    # Rank 1 is already in a later step; its payload must not be read as a desired version.
    if group.rank == 0:
        return agree_desired_version(group, "v1")
    return group.all_gather_object("v1")


def test_desired_version_collective_is_tagged(tmp_path: Path) -> None:
    results = spawn(tmp_path, 2, _desired_meets_other_collective)
    assert results[0][0] == "fatal", results
    assert "phase disagreement during desired_version" in results[0][1]


def _desired_from_out_of_step_leader(group: TorchRankGroup) -> Any:
    # Rank 0 is already in a later step: its payload must not be taken for the desired version either.
    if group.rank == 0:
        return group.all_gather_object(("desired", "v1"))
    return agree_desired_version(group, None)


def test_an_untagged_leader_payload_is_no_desired_version(tmp_path: Path) -> None:
    results = spawn(tmp_path, 2, _desired_from_out_of_step_leader)
    assert results[1][0] == "fatal", results
    assert "phase disagreement during desired_version" in results[1][1]


def _s3_follower_fails(group: TorchRankGroup) -> Any:
    calls: list[tuple[str, float]] = []
    fail = {"load": "disk full on rank 2"} if group.rank == 2 else None
    try:
        s3_phases(group, _steps(calls, fail), pinned="v3", configured="v3")
    except StrategyRecoveryError as exc:
        return str(exc), type(exc.__cause__).__name__, [name for name, _ in calls]
    return None


def test_one_rank_failing_to_load_fails_all_ranks(tmp_path: Path) -> None:
    results = spawn(tmp_path, 3, _s3_follower_fails)
    for rank, (status, outcome) in enumerate(results):
        assert status == "ok" and outcome is not None, results
        message, cause, calls = outcome
        assert message == "S3 cold start of 'v3' failed in s3_engine_loaded: rank 2: OSError: disk full on rank 2"
        assert cause == ("OSError" if rank == 2 else "NoneType")  # the local failure is the cause where it happened
        assert calls == (["chain", "prepare", "load"] if rank == 0 else ["chain", "load"])  # nobody activated


def _s3_chains_differ(group: TorchRankGroup) -> Any:
    calls: list[tuple[str, float]] = []
    steps = _steps(calls)
    if group.rank == 1:
        steps = S3Steps(lambda: ("v2", "v3"), steps.prepare, steps.load, steps.activate)
    try:
        s3_phases(group, steps, pinned="v3", configured="v3")
    except StrategyRecoveryError as exc:
        return str(exc), [name for name, _ in calls]
    return None


def test_a_chain_disagreement_stops_every_rank_before_it_loads(tmp_path: Path) -> None:
    results = spawn(tmp_path, 2, _s3_chains_differ)
    for rank, (status, outcome) in enumerate(results):
        assert status == "ok" and outcome is not None, results
        message, calls = outcome
        assert message.startswith("replay chain disagreement for 'v3': rank 0: ('v1', 'v3'); rank 1: ('v2', 'v3')")
        assert calls == (["chain", "prepare"] if rank == 0 else [])
