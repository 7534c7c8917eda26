"""The rollout budget of a ModelLoad (`spec.rollout`) and make-before-break in status aggregation, without a
cluster: which replicas move to a new version, and how a replica that still serves the old one counts."""

from __future__ import annotations

import datetime as dt

import pytest
from pydantic import ValidationError

from ferry.api.models import ModelLoad, ModelLoadSpec, ObjectMeta, RolloutSpec
from ferry_agent.kube.registry import first_loader
from ferry_operator.modelloads import (
    aggregate_status,
    max_unavailable,
    plan_replicas,
    replica_name,
    rollout_moves,
    stalled_replicas,
)

pytestmark = pytest.mark.unit

NOW = dt.datetime(2026, 1, 1, 12, 0, 0, tzinfo=dt.UTC)
NOW_TEXT = "2026-01-01T12:00:00Z"


def spec(replicas: int, strategy: str | None = None, max_unavailable: int | str | None = None) -> ModelLoadSpec:
    rollout: dict = {}
    if strategy:
        rollout["strategy"] = strategy
    if max_unavailable is not None:
        rollout["maxUnavailable"] = max_unavailable
    return ModelLoadSpec(modelName="m", desiredVersion="v2", replicas=replicas, rollout=rollout)


def wr(
    node: str, spec_version: str = "v1", phase: str | None = "Serving", version: str | None = None, **status
) -> dict:
    return {
        "metadata": {"name": replica_name("serve", node)},
        "spec": {"nodeName": node, "version": spec_version},
        "status": {"phase": phase, "version": version or spec_version, **status},
    }


def names(*nodes: str) -> list[str]:
    return [replica_name("serve", n) for n in nodes]


@pytest.mark.parametrize(
    ("replicas", "strategy", "value", "expected"),
    [
        (8, "Parallel", None, None),
        (8, None, None, 2),  # default Rolling 25%
        (3, None, None, 1),  # 25% of 3 rounds down to 0: at least 1
        (8, "Rolling", "50%", 4),
        (8, "Rolling", "99%", 7),
        (8, "Rolling", "100%", 8),
        (1, "Rolling", "1%", 1),
        (8, "Rolling", 3, 3),
        (2, "Rolling", 5, 5),  # more than there are: every replica may move
    ],
)
def test_max_unavailable(replicas, strategy, value, expected):
    assert max_unavailable(spec(replicas, strategy, value)) == expected


def test_parallel_moves_every_replica_at_once():
    kept = [wr(n) for n in "abcdefgh"]
    assert sorted(rollout_moves(spec(8, "Parallel"), kept, [])) == sorted(names(*"abcdefgh"))


def test_rolling_moves_within_the_budget_and_counts_moving_replicas():
    kept = [wr(n) for n in "abc"]
    first = rollout_moves(spec(3, "Rolling", 1), kept, [])
    assert first == names("a")
    # Retargeted and still serving v1 while it loads v2 (make-before-break): available, but moving, so it counts.
    kept[0] = wr("a", "v2", version="v1", loadingVersion="v2")
    assert rollout_moves(spec(3, "Rolling", 1), kept, []) == []
    assert rollout_moves(spec(3, "Rolling", 2), kept, []) == names("b")
    # Serving v2: the next one moves.
    kept[0] = wr("a", "v2")
    assert rollout_moves(spec(3, "Rolling", 1), kept, []) == names("b")


def test_a_replica_serving_nothing_moves_at_once_and_uses_the_budget():
    """Moving a replica that serves nothing (failed, or stale: its Lease expired) costs no capacity; it counts
    against the budget like any unavailable one, so the serving ones wait."""
    kept = [wr("a", phase="Failed"), wr("b"), wr("c")]
    assert rollout_moves(spec(3, "Rolling", 1), kept, []) == names("a")
    kept = [wr("a"), wr("b"), wr("c")]
    stale = names("c")
    assert rollout_moves(spec(3, "Rolling", 1), kept, [], stale) == names("c")
    assert rollout_moves(spec(3, "Rolling", 2), kept, [], stale) == names("c", "a")
    # A replica of the new version that is unavailable (loading after a restart) holds the serving ones back.
    kept = [wr("a", "v2", phase="Loading"), wr("b"), wr("c")]
    assert rollout_moves(spec(3, "Rolling", 1), kept, []) == []


def test_rolling_prefers_nodes_that_hold_the_new_version():
    kept = [wr(n) for n in "abc"]
    assert rollout_moves(spec(3, "Rolling", 1), kept, ["c"]) == names("c")


def test_plan_passes_stale_replicas_to_the_budget():
    nodes = [{"metadata": {"name": n, "labels": {}}, "spec": {}} for n in "abc"]
    ml = ModelLoad(metadata=ObjectMeta(name="serve", namespace="ns", uid="u"), spec=spec(3, "Rolling", 1))
    kept = [wr(n) for n in "abc"]
    assert plan_replicas(ml, kept, nodes, [], stale=names("b")).retarget == names("b")
    assert plan_replicas(ml, kept, nodes, [], placeable=False).retarget == []


def test_rollout_spec_validation():
    assert ModelLoadSpec(modelName="m", desiredVersion="v1").rollout.strategy == "Rolling"
    assert RolloutSpec(strategy="Rolling", maxUnavailable="25%").maxUnavailable == "25%"
    for bad in (0, -1, "0%", "101%", "3", "x%"):
        with pytest.raises(ValidationError):
            RolloutSpec(strategy="Rolling", maxUnavailable=bad)


def test_a_moving_replica_still_serving_the_old_version_is_not_ready_not_failed():
    ml = ModelLoad(metadata=ObjectMeta(name="serve", generation=1), spec=spec(2))
    replicas = [wr("a", "v2"), wr("b", "v2", version="v1", loadingVersion="v2", startedTime="2026-01-01T11:59:59Z")]
    status = aggregate_status(ml, replicas, {}, nodes_available=2, now=NOW, now_text=NOW_TEXT)
    conds = {c.type: c for c in status.conditions}
    assert status.readyReplicas == 0  # no Lease in this view: stale, whatever they serve
    assert conds["Progressing"].status == "True" and "1 loading" in conds["Progressing"].message
    failed = [wr("a", "v2"), wr("b", "v2", version="v1", loadingVersion="v2", reason="LoadFailed", message="boom")]
    status = aggregate_status(ml, failed, {}, nodes_available=2, now=NOW, now_text=NOW_TEXT)
    conds = {c.type: c for c in status.conditions}
    assert conds["Degraded"].reason == "ReplicaFailed" and names("b")[0] in conds["Degraded"].message


def test_a_load_next_to_the_served_version_can_stall():
    moving = wr("b", "v2", version="v1", loadingVersion="v2", startedTime="2026-01-01T11:58:00Z", source="s3")
    assert [s.replica for s in stalled_replicas([moving], 60, NOW)] == names("b")
    failed = wr("b", "v2", version="v1", loadingVersion="v2", startedTime="2026-01-01T11:58:00Z", reason="LoadFailed")
    assert stalled_replicas([failed], 60, NOW) == []
    assert stalled_replicas([wr("a", "v2", startedTime="2026-01-01T11:58:00Z")], 60, NOW) == []


def test_first_loader_counts_replicas_moving_from_an_older_version():
    """Eight replicas retargeted at once all still serve v1: they must agree that one reads S3 and the others copy
    from it, not all read S3."""
    moving = [
        {"metadata": {"name": n}, "spec": {"version": "v2"}, "status": {"phase": "Serving", "version": "v1"}}
        for n in ("r-a", "r-b", "r-c")
    ]
    assert first_loader(moving, version="v2", self_replica="r-c") == "r-a"
    done = [{"metadata": {"name": "r-a"}, "spec": {"version": "v2"}, "status": {"phase": "Serving", "version": "v2"}}]
    assert first_loader(done + moving[1:], version="v2", self_replica="r-c") == "r-b"
