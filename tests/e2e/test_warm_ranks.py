"""Rank processes that stay up between loads, through a real agent (docs/ranks.md): the agent starts them ahead
(`--warm-ranks`), lends them to a two-rank replica's load, starts spares for the next version while one serves,
takes the released ones back after a rollout and lends them again; an idle one that dies is replaced. The S3 cold
start's follower serves its leader's sealed landing itself (its memory is that memfd, mapped read-only, not a copy
of its own), and every rank of every load serves exactly the published bytes."""

from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from tests.e2e.test_multirank import check_holds
from tests.support.agents import lent_ranks, memfds, node, rank_processes, start_agent
from tests.support.objects import apply, ml_body, publish_delta, publish_full, tensors, wait_for, wait_reason, wv_body

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def exactly(n: int, pids: set[int]) -> set[int] | None:
    return pids if len(pids) == n else None


def test_rank_processes_are_started_ahead_lent_given_back_and_replaced(cluster, s3, namespace, operator, tmp_path):
    v1 = tensors(41, n=6, shape=(64, 48))
    v2 = {k: (a + 1 if k in ("layer0.weight", "layer3.weight") else a) for k, a in v1.items()}
    publish_full(s3, namespace, "v1", v1)
    publish_delta(s3, namespace, "v2", "v1", v1, v2)
    apply(cluster, namespace, wv_body(namespace, "v1"), wv_body(namespace, "v2", base="v1"))
    wait_reason(cluster, namespace, "v2", "Ready", "True", "Verified", timeout=60)
    name = f"{namespace}-n0"
    node(cluster, name, {"ferry.dev/pool": namespace})
    agent = start_agent(cluster, tmp_path, name, s3=s3, args=["--warm-ranks", "2"])

    def ready() -> set[int]:
        """Rank processes that said `ready` and still run."""
        said = {int(p) for p in re.findall(r"rank process (\d+) \(\S+\) ready", agent.log_path.read_text())}
        return said & rank_processes(agent)

    def wr() -> dict:
        items = json.loads(cluster.kubectl("get", "wr", "-n", namespace, "-o", "json").stdout)["items"]
        return items[0] if len(items) == 1 else {}

    def serving(version: str, after: str = "") -> dict | None:
        status = wr().get("status") or {}
        done = (
            status.get("phase") == "Serving" and status.get("version") == version and not status.get("loadingVersion")
        )
        return wr() if done and status.get("completedTime", "") > after else None

    def describe() -> str:
        return json.dumps(wr().get("status"), indent=1) + agent.log_tail(40)

    def patch(version: str) -> None:
        body = json.dumps({"spec": {"desiredVersion": version}})
        cluster.kubectl("patch", "ml", "tp", "-n", namespace, "--type=merge", "-p", body)

    try:
        warm = wait_for(lambda: exactly(2, ready()), 90, "two warm rank processes", describe)
        apply(cluster, namespace, ml_body(namespace, "v1", 1, name="tp", ranksPerReplica=2))
        first = wait_for(lambda: serving("v1"), 120, "the replica serves v1", describe)
        replica = first["metadata"]["name"]
        pids = lent_ranks(agent, namespace, replica)
        assert set(pids) == warm, "the load ran on the processes started with the agent, not on new ones"
        assert first["status"]["source"] == "s3"
        check_holds(first, v1)
        total = sum(a.nbytes for a in v1.values())
        assert first["status"]["residentBytes"] == total, describe()

        # The follower holds no copy: its share is its leader's sealed landing, mapped read-only, and what the
        # agent adopted from it (for attach and residentBytes) is that very memfd.
        landing = f"ferry:landing:{namespace}/m/v1#1:0"
        assert memfds(pids[1]) == {landing: "r--s"}, memfds(pids[1])
        held = [os.readlink(f"/proc/{agent.proc.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{agent.proc.pid}/fd")]
        assert f"/memfd:{landing} (deleted)" in held, held

        # While v1 serves, two spares are started for the next version, which loads on them.
        spares = wait_for(lambda: exactly(2, ready() - warm), 90, "two spares", describe)
        patch("v2")
        second = wait_for(lambda: serving("v2"), 120, "the replica serves v2", describe)
        assert set(lent_ranks(agent, namespace, replica)) == spares
        check_holds(second, v2)

        # v1's processes were given back: still running, their shares released, and lent again for the next load.
        def released() -> bool:
            return set(pids) <= rank_processes(agent) and not any(memfds(p) for p in pids)

        wait_for(released, 30, "v1's rank processes released their shares", describe)
        patch("v1")
        third = wait_for(lambda: serving("v1", after=second["status"]["completedTime"]), 120, "v1 again", describe)
        assert lent_ranks(agent, namespace, replica) == pids, "the same processes load v1 again"
        check_holds(third, v1)
        assert len(rank_processes(agent)) == 4  # two serving, two idle: nothing else was started

        # An idle rank process that dies is replaced.
        def idle(pid: int) -> bool:  # given back to the pool (its share released a moment before)
            return re.search(rf"rank process {pid} \(\S+\) is idle", agent.log_path.read_text()) is not None

        wait_for(lambda: not any(memfds(p) for p in spares), 30, "v2's rank processes released", describe)
        wait_for(lambda: all(idle(p) for p in spares), 30, "v2's rank processes back in the pool", describe)
        victim = min(spares)
        os.kill(victim, 9)
        wait_for(
            lambda: (r := ready()) and victim not in r and len(r) == 4, 90, "the dead idle process replaced", describe
        )
        assert "idle rank process" in agent.log_path.read_text() and serving("v1") is not None
    finally:
        cluster.kubectl("delete", "ml", "tp", "-n", namespace, "--wait=false", check=False)
        agent.stop()
        leftover = subprocess.run(["pgrep", "-f", f"ferry_agent.ranks.worker .*--node {name}"], capture_output=True)
        assert leftover.returncode == 1, "rank processes outlived their agent"
