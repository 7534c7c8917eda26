"""The agent's supervisor of a multi-rank replica (`ferry_agent.ranks.supervisor.RankProcesses`) over the events its
rank processes print, fed by hand (no process runs): what a load returns or raises, progress summed over the ranks,
and what it says about the ranks once they serve."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from ferry.errors import LoadFailed
from ferry_agent.config import AgentConfig
from ferry_agent.ranks import supervisor
from ferry_agent.ranks.supervisor import RankLaunch, RankPool, RankProcesses, WorkerSettings
from tests.support.kube_fakes import agent_config

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def ranks(world_size: int = 2, **kwargs: Any) -> RankProcesses:
    return RankProcesses(
        RankLaunch(namespace="ns", replica="wr", world_size=world_size, version="v1"),
        RankPool(WorkerSettings("n1-abc", agent_config())),
        **kwargs,
    )


def feed(r: RankProcesses, *events: tuple[int, dict[str, Any]]) -> None:
    for event in events:
        r._events.put(event)


def serving(rank: int) -> tuple[int, dict[str, Any]]:
    return rank, {"event": "serving", "source": "peer/a", "bytes": 10, "entry": {"rank": rank}, "attempts": []}


def test_every_rank_serving_is_returned_by_rank_with_the_progress_summed() -> None:
    reports: list[tuple[int, int, str]] = []
    r = ranks(progress=lambda *a: reports.append(a))
    feed(
        r,
        (1, {"event": "progress", "done": 5, "total": 10, "source": "peer/b"}),
        (0, {"event": "progress", "done": 2, "total": 10, "source": "peer/a"}),
        serving(1),
        serving(0),
    )
    assert [e["entry"]["rank"] for e in r.wait_loaded(timeout_s=5)] == [0, 1]
    assert reports == [(5, 10, "peer/b"), (7, 20, "peer/a")], "the lowest rank's source names the load"


def test_a_rank_that_exits_before_it_loaded_fails_the_load_at_once() -> None:
    r = ranks(world_size=3)
    feed(r, serving(0), (2, {"event": "exit", "code": -9}))
    with pytest.raises(LoadFailed, match="rank 2 exited with code -9 before it loaded"):
        r.wait_loaded(timeout_s=600)  # not waiting for rank 1, which the dead rank leaves blocked


def test_ranks_that_agree_on_a_failure_report_it_once_with_its_attempts() -> None:
    r = ranks()
    attempts = [{"source": "Peer", "outcome": "Failed", "reason": "SourceUnavailable"}]
    feed(
        r,
        (0, {"event": "failed", "message": "no source", "attempts": attempts}),
        (1, {"event": "failed", "message": "no source"}),
    )
    with pytest.raises(LoadFailed) as failed:
        r.wait_loaded(timeout_s=5)
    assert str(failed.value) == "no source" and failed.value.attempts == attempts


def test_ranks_that_fail_differently_are_each_named() -> None:
    r = ranks()
    feed(r, (0, {"event": "failed", "message": "a"}), (1, {"event": "failed", "message": "b"}))
    with pytest.raises(LoadFailed, match="rank 0: a; rank 1: b"):
        r.wait_loaded(timeout_s=5)


def test_a_rank_that_never_reports_fails_the_load_at_the_timeout() -> None:
    r = ranks()
    feed(r, serving(0))
    with pytest.raises(LoadFailed, match=r"did not finish loading within 0\.2s"):
        r.wait_loaded(timeout_s=0.2)


def test_the_other_ranks_get_a_grace_to_report_the_agreed_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(supervisor, "FAILED_RANKS_GRACE_S", 0.2)
    r = ranks(world_size=3)
    feed(r, (0, {"event": "failed", "message": "no source"}))
    with pytest.raises(LoadFailed, match=r"^no source$"):
        r.wait_loaded(timeout_s=600)


def test_serving_ranks_report_their_leases_and_a_rank_that_ends() -> None:
    woken = threading.Semaphore(0)
    r = ranks(wake=woken.release)
    feed(r, serving(0), serving(1))
    r.wait_loaded(timeout_s=5)
    assert r.active_leases() == 0 and r.failure() is None
    feed(r, (0, {"event": "leases", "count": 2}), (1, {"event": "leases", "count": 1}))
    assert woken.acquire(timeout=5) and woken.acquire(timeout=5)
    assert r.active_leases() == 3 and r.failure() is None
    feed(r, (1, {"event": "exit", "code": 1}))
    assert woken.acquire(timeout=5)
    assert r.failure() == "rank 1 of wr exited with code 1 while serving"


def test_rank_processes_parse_the_agents_s3_settings() -> None:
    """The leader of a multi-rank S3 load runs as many ranged GETs at once as the agent was told to, not a default."""
    from ferry_agent.ranks import worker

    settings = WorkerSettings("n1-abc", agent_config(s3_endpoint="http://127.0.0.1:1", s3_download_workers=1))
    args = worker._parser().parse_args(settings.argv("n1-abc-w1")[3:])
    config = AgentConfig.from_env(settings.env()[worker.RANK_CONFIG_ENV])
    assert (args.agent_name, config.s3_endpoint, config.s3_download_workers) == ("n1-abc-w1", "http://127.0.0.1:1", 1)
    assert config == settings.config  # the agent's settings, whole: the rank process parses none of its own
