"""The agent's pool of rank processes (`ranks.supervisor.RankPool`) over stand-in processes that speak the rank
protocol (ready; load → serving; stop → stopped; end of stdin → exit): idle ones are lent first and the rest
started, released ones come back, ones of a failed load never do, a dead idle one is replaced, and what a process
said before anybody borrowed it reaches the load it is lent to. The real rank process: tests/e2e/test_warm_ranks.py."""

from __future__ import annotations

import os
import sys
import textwrap
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from ferry.errors import LoadFailed
from ferry_agent.ranks.supervisor import (
    RankLaunch,
    RankPool,
    RankProcesses,
    RanksExceedNode,
    RankWorker,
    WorkerSettings,
)
from tests.support.kube_fakes import agent_config

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60)]

STAND_IN = textwrap.dedent(
    """
    import json, os, sys
    def say(event, **fields):
        print(json.dumps({"event": event, **fields}), flush=True)
    if os.environ.get("STAND_IN_BROKEN"):
        say("failed", message="cannot start")
        sys.exit(1)
    say("ready")
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "load":
            job = json.loads(arg)
            if job["version"] == "bad":
                say("failed", message="no source", attempts=[])
                sys.exit(1)
            say("serving", rank=job["rank"], source="s3", bytes=1, entry={"rank": job["rank"]}, attempts=[])
        elif command == "stop":
            say("stopped")
    """
)


@dataclass(frozen=True)
class StandIn(WorkerSettings):
    def argv(self, name: str) -> list[str]:
        return [sys.executable, "-c", STAND_IN]


def wait(predicate, timeout: float = 20) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def children() -> set[int]:
    """The live child processes of this one (/proc): what the pool really runs, whatever it counts."""
    found: set[int] = set()
    for task in os.listdir("/proc/self/task"):
        found.update(int(pid) for pid in Path(f"/proc/self/task/{task}/children").read_text().split())
    return {pid for pid in found if Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"}


def load(pool: RankPool, version: str = "v1", n: int = 2) -> RankProcesses:
    ranks = RankProcesses(RankLaunch("ns", "wr", n, version, timeout_s=30), pool)
    ranks.start()
    return ranks


def test_idle_processes_are_lent_first_given_back_after_and_lent_again() -> None:
    pool = RankPool(StandIn("n-1", agent_config()), warm=2)
    try:
        pool.maintain(0)
        warm = [w.pid for w in pool.idle()]
        wait(lambda: all(w.ready.is_set() for w in pool.idle()))
        first = load(pool)
        assert [e["entry"]["rank"] for e in first.wait_loaded(10)] == [0, 1]
        assert [first.pid(r) for r in range(2)] == warm and pool.idle() == []
        pool.maintain(2)  # spares for the next version while this one serves
        spares = [w.pid for w in pool.idle()]
        assert len(spares) == 2 and not set(spares) & set(warm)
        second = load(pool)
        second.wait_loaded(10)
        assert [second.pid(r) for r in range(2)] == spares
        first.stop(drain_s=0)  # released: back to the pool, still running
        assert [w.pid for w in pool.idle()] == warm
        third = load(pool)
        third.wait_loaded(10)
        assert [third.pid(r) for r in range(2)] == warm, "the same processes serve the next load"
        second.stop(drain_s=1)
        third.stop(drain_s=1)
        assert [w.pid for w in pool.idle()] == spares + warm
        ended = pool.idle()[2:]
        pool.maintain(0)  # beyond the two kept idle: let go
        assert [w.pid for w in pool.idle()] == spares and not any(w.alive() for w in ended)
    finally:
        pool.shutdown()


def test_the_processes_of_a_failed_load_are_killed_not_lent_again() -> None:
    pool = RankPool(StandIn("n-1", agent_config()), warm=2)
    try:
        pool.maintain(0)
        lent = [w.pid for w in pool.idle()]
        failed = load(pool, "bad")
        with pytest.raises(LoadFailed, match="no source"):
            failed.wait_loaded(10)
        assert pool.idle() == []
        again = load(pool)
        again.wait_loaded(10)
        assert not {again.pid(r) for r in range(2)} & set(lent)
        again.stop(drain_s=0)
    finally:
        pool.shutdown()


def test_a_dead_idle_process_is_replaced_and_the_agent_woken() -> None:
    woken = threading.Event()
    pool = RankPool(StandIn("n-1", agent_config()), warm=1, wake=woken.set)
    try:
        pool.maintain(0)
        (first,) = pool.idle()
        wait(first.ready.is_set)
        first.proc.kill()
        assert woken.wait(10)
        pool.maintain(0)
        (second,) = pool.idle()
        assert second.pid != first.pid and second.alive()
    finally:
        pool.shutdown()


def test_a_process_killed_on_purpose_is_not_taken_for_an_idle_one_that_died() -> None:
    """The processes of a failed load are killed after they are unlent: their exit must not count as an idle
    process dying (which wakes the agent and, for one not ready yet, backs the pool's next start off)."""
    died: list[RankWorker] = []
    worker = RankWorker(StandIn("n-1", agent_config()), "n-1-w1", on_idle_exit=died.append)
    wait(worker.ready.is_set)
    worker.kill()
    for reader in [t for t in threading.enumerate() if t.name == "ferry-n-1-w1"]:
        reader.join(10)  # it has delivered the exit
    assert worker.stopped.is_set() and died == []


def test_a_process_that_failed_before_it_was_lent_says_why_to_the_load(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STAND_IN_BROKEN", "1")
    worker = RankWorker(StandIn("n-1", agent_config()), "n-1-w1", on_idle_exit=lambda _worker: None)
    wait(worker.stopped.is_set)  # exited, with nobody listening
    got: list[dict] = []
    worker.lend(got.append)
    assert got == [{"event": "failed", "message": "cannot start"}, {"event": "exit", "code": 1}]


def test_a_process_keeps_its_rank_from_one_load_to_the_next() -> None:
    """On a GPU node rank r uses `cuda:r`: a process lent as another rank would hold a CUDA context on each GPU."""
    pool = RankPool(StandIn("n-1", agent_config()))
    try:
        (a, b), warm = pool.take(2)
        assert warm == 0 and (a.rank, b.rank) == (0, 1)
        pool.give_back([b, a])  # b has been idle the longest
        (first, second), warm = pool.take(2)
        assert warm == 2 and (first, second) == (a, b)
        pool.give_back([b])
        (only,), warm = pool.take(1)  # nothing idle was rank 0: the longest idle takes it
        assert warm == 1 and only is b and b.rank == 0
        pool.give_back([a, b])
    finally:
        pool.shutdown()


def test_idle_processes_that_cannot_start_are_started_again_only_after_a_backoff(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STAND_IN_BROKEN", "1")
    woken = threading.Semaphore(0)
    pool = RankPool(StandIn("n-1", agent_config()), warm=1, wake=woken.release)
    try:
        pool.maintain(0)
        assert len(pool.idle()) == 1
        assert woken.acquire(timeout=10)  # it died before it was ready
        pool.maintain(0)
        assert pool.idle() == [], "not started again at once"
        monkeypatch.delenv("STAND_IN_BROKEN")
        pool._next_start = 0.0  # the backoff is over
        pool.maintain(0)
        (second,) = pool.idle()
        wait(second.ready.is_set)
    finally:
        pool.shutdown()


def test_a_replica_of_more_ranks_than_the_cap_is_refused_before_any_process_starts() -> None:
    pool = RankPool(StandIn("n-1", agent_config()), cap=3)
    before = children()
    try:
        with pytest.raises(RanksExceedNode, match=r"ranksPerReplica 1024 > this node's cap 3 \(--max-rank-processes\)"):
            load(pool, n=1024)
        assert pool.refusal(1024) and pool.refusal(3) is None
        pool.maintain(1024)  # no idle processes beyond the cap either
        assert len(pool.idle()) == 3 and len(children() - before) == 3
    finally:
        pool.shutdown()


def test_the_pool_never_runs_more_processes_than_its_cap_lent_and_idle_together() -> None:
    pool = RankPool(StandIn("n-1", agent_config()), warm=2, cap=3)
    before = children()
    try:
        pool.maintain(2)
        first = load(pool)
        first.wait_loaded(10)
        pool.maintain(2)  # spares for the next version: only one fits beside the two lent
        assert len(pool.idle()) == 1 and len(children() - before) == 3
        with pytest.raises(RanksExceedNode, match="beside the 2 rank processes lent now"):
            load(pool)  # two more do not fit beside the two lent: refused, nothing started
        assert len(children() - before) == 3
        single = load(pool, n=1)  # one does: the idle one
        single.wait_loaded(10)
        assert len(children() - before) == 3 and pool.idle() == []
        first.stop(drain_s=0)  # released: two fit again
        again = load(pool)
        again.wait_loaded(10)
        assert len(children() - before) == 3
        again.stop(drain_s=0)
        single.stop(drain_s=0)
    finally:
        pool.shutdown()


def test_warm_processes_beyond_the_cap_are_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="between 0 and the cap"):
        RankPool(StandIn("n-1", agent_config()), warm=4, cap=3)
