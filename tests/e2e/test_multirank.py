"""Multi-rank replicas end to end: operator + two node agents, each running one process per rank in a gloo group.

A ModelLoad of two replicas with two ranks each: the first replica's ranks cold-start from S3 (the local leader
streams the checkpoint once, landing the other rank's share in sealed shared memory that rank serves as it is;
the node's store is written behind), the second replica's ranks copy rank by rank from the first. Every rank
process's worker service refuses a reader without a valid token (none, garbage, a real token's claims under a
forged signature) on every RPC, and admits an assigned one. Then a delta rolls out, a
rank process dies and its replica reloads, and two rank processes configured with different desired versions both
fail, naming both.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import subprocess
import sys

import grpc
import numpy as np
import pytest
import torch
import torch.distributed as dist

from ferry_agent.config import AgentConfig
from ferry_agent.ranks.worker import RANK_CONFIG_ENV, Job
from tests.support.agents import (
    bare_calls,
    lent_ranks,
    node,
    pull,
    reader_tokens,
    replica,
    serving_node,
    start_agent,
)
from tests.support.objects import apply, ml_body, publish_delta, publish_full, tensors, wait_for, wait_reason, wv_body

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

RANKS = 2


def modelload(namespace: str, version: str) -> dict:
    return ml_body(namespace, version, 2, name="tp", ranksPerReplica=RANKS, transfer={"timeoutSeconds": 60})


def serving(cluster, namespace: str, version: str) -> list[dict] | None:
    items = json.loads(cluster.kubectl("get", "wr", "-n", namespace, "-o", "json").stdout)["items"]
    done = [r for r in items if (r.get("status") or {}).get("phase") == "Serving" and r["status"]["version"] == version]
    return sorted(done, key=lambda r: r["metadata"]["name"]) if len(done) == len(items) == 2 else None


def as_numpy(t: torch.Tensor) -> np.ndarray:
    return t.contiguous().view(torch.uint8).numpy()


def check_holds(wr: dict, expected: dict[str, np.ndarray]) -> None:
    """Every rank serves a disjoint share; together exactly `expected`, byte for byte."""
    ranks = sorted(wr["status"]["ranks"], key=lambda e: e["rank"])
    assert [e["rank"] for e in ranks] == list(range(RANKS)) and len({e["agentName"] for e in ranks}) == RANKS
    union: dict[str, torch.Tensor] = {}
    for entry in ranks:
        share = pull(entry, wr["metadata"]["name"])
        assert share and not set(share) & set(union), f"rank {entry['rank']} overlaps"
        assert len(share) == entry["tensorCount"]
        union.update(share)
    assert sorted(union) == sorted(expected)
    for name, array in expected.items():
        assert np.array_equal(as_numpy(union[name]), np.ascontiguousarray(array).view(np.uint8)), name


def test_two_rank_replicas_from_s3_then_peers_then_a_delta(cluster, s3, namespace, operator, tmp_path):
    v1 = tensors(21, n=6, shape=(64, 48))
    v2 = {k: (a + 1 if k in ("layer1.weight", "layer4.weight") else a) for k, a in v1.items()}
    publish_full(s3, namespace, "v1", v1)
    publish_delta(s3, namespace, "v2", "v1", v1, v2)
    apply(cluster, namespace, wv_body(namespace, "v1"), wv_body(namespace, "v2", base="v1"))
    wait_reason(cluster, namespace, "v2", "Ready", "True", "Verified", timeout=60)
    names = [f"{namespace}-n{i}" for i in range(2)]
    for n in names:
        node(cluster, n, {"ferry.dev/pool": namespace})
    agents = {n: start_agent(cluster, tmp_path, n, s3=s3) for n in names}

    def describe() -> str:
        out = cluster.kubectl("get", "wr", "-n", namespace, "-o", "json").stdout
        return out + "".join(a.log_tail(30) for a in agents.values())

    try:
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(modelload(namespace, "v1")))
        first, second = wait_for(lambda: serving(cluster, namespace, "v1"), 180, "both replicas serve v1", describe)
        by_source = {r["status"]["source"]: r for r in (first, second)}
        assert set(by_source) == {"s3", f"peer/{first['metadata']['name']}"}, list(by_source)
        for wr in (first, second):
            assert wr["status"]["bytesDone"] == sum(a.nbytes for a in v1.values())
            assert f"on {RANKS} ranks" in wr["status"]["message"]
            for entry in wr["status"]["ranks"]:
                endpoint, name = entry["grpcEndpoint"], entry["agentName"]
                source = serving_node(name)
                real = reader_tokens(cluster, source)(source)  # the serving node's own reader
                forged = real.rsplit(".", 1)[0] + ".c2ln"  # a real token's claims, not its signature
                for what, bearer in {"no token": None, "garbage": "not-a-jwt", "forged": forged}.items():
                    codes = bare_calls(endpoint, name, bearer)
                    assert set(codes.values()) == {grpc.StatusCode.UNAUTHENTICATED}, (what, entry, codes)
                admitted = bare_calls(endpoint, name, real)  # the node's reader: its replica is assigned v1
                assert admitted == {"manifest": None, "prepare": None, "release": grpc.StatusCode.NOT_FOUND}, entry
            check_holds(wr, v1)
        agent_log = "".join(a.log_path.read_text(errors="replace") for a in agents.values())
        assert ": 2 rank processes (pids " in agent_log and "desired version v1 agreed" in agent_log
        # The S3 replica's follower serves its leader's landed memory: no S3 read, no store read, no copy.
        assert "rank 1/2 mapped v1" in agent_log and "from the local leader's landing" in agent_log

        # Roll out the delta: each replica's ranks agree on v2 and load it again.
        cluster.kubectl("patch", "ml", "tp", "-n", namespace, "--type=merge", "-p", '{"spec":{"desiredVersion":"v2"}}')
        pair = wait_for(lambda: serving(cluster, namespace, "v2"), 180, "both replicas serve v2", describe)
        for wr in pair:
            check_holds(wr, v2)

        # A rank process dies: its replica no longer holds the whole version, fails, and reloads.
        victim = pair[0]["metadata"]["name"]
        os.kill(lent_ranks(agents[pair[0]["spec"]["nodeName"]], namespace, victim)[1], 9)

        def reloaded_after_kill() -> dict | None:
            pair_now = serving(cluster, namespace, "v2") or []
            found = [r for r in pair_now if r["metadata"]["name"] == victim]
            return (
                found[0]
                if found and found[0]["status"]["completedTime"] != pair[0]["status"]["completedTime"]
                else None
            )

        reloaded = wait_for(reloaded_after_kill, 120, "the replica reloaded after its rank died", describe)
        assert "exited with code -9 while serving" in agents[pair[0]["spec"]["nodeName"]].log_path.read_text()
        check_holds(reloaded, v2)
    finally:
        cluster.kubectl("delete", "ml", "tp", "-n", namespace, "--wait=false", check=False)
        for a in agents.values():
            a.stop()
        pattern = f"ferry_agent.ranks.worker .*--node {namespace}-n"
        leftover = subprocess.run(["pgrep", "-f", pattern], capture_output=True)
        assert leftover.returncode == 1, "rank processes outlived their agent"


def test_rank_processes_configured_with_different_versions_both_fail(cluster, namespace, tmp_path):
    node(cluster, f"{namespace}-n")
    replica(cluster, namespace, "wr-mixed", f"{namespace}-n", "v1", ranks=2)
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False, timeout=dt.timedelta(seconds=30))
    env = {**os.environ, **cluster.env(), "UCX_NET_DEVICES": "lo", "GLOO_SOCKET_IFNAME": "lo"}
    config = AgentConfig.from_args(["--node", f"{namespace}-n", *cluster.agent_identity_args(f"{namespace}-n")])
    env[RANK_CONFIG_ENV] = config.to_env()  # what the agent hands its rank processes
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ferry_agent.ranks.worker",
                "--agent-name",
                f"mixed-{rank}",
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        for rank in range(2)
    ]
    for rank, (proc, version) in enumerate(zip(procs, ["v1", "v7"], strict=True)):
        job = Job(namespace, "wr-mixed", rank, 2, f"127.0.0.1:{store.port}", version, timeout_s=30)
        assert proc.stdin is not None
        proc.stdin.write(f"load {job.to_json()}\n")
        proc.stdin.flush()
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 1, err  # a failed load ends the process: its gloo group may be broken
        events = [json.loads(line) for line in out.splitlines()]
        assert [e["event"] for e in events] == ["ready", "failed"], events
        assert events[1]["fatal"] is True
        assert "rank 0 pins 'v1' but rank 1 is configured with 'v7'" in events[1]["message"]
        assert "desired-version disagreement" in err


def test_replicas_of_more_ranks_than_the_node_runs_fail_before_any_rank_process_starts(
    cluster, s3, namespace, operator, tmp_path
):
    """A CPU replica of 1024 ranks on an agent capped at 8 rank processes, and a CUDA one of more ranks than the
    node has GPUs: both Failed, reason RanksExceedNode naming the limit, and not one rank process started."""
    publish_full(s3, namespace, "v1", tensors(5, n=2))
    apply(cluster, namespace, wv_body(namespace, "v1"))
    wait_reason(cluster, namespace, "v1", "Ready", "True", "Verified", timeout=60)
    name = f"{namespace}-n"
    node(cluster, name, {"ferry.dev/pool": namespace})
    agent = start_agent(cluster, tmp_path, name, s3=s3, args=["--max-rank-processes", "8"])
    gpus = torch.cuda.device_count()  # what the agent sees too: 0 on a CPU node
    many = max(2, gpus + 1)  # one rank loads in the agent's own process
    expected = {
        "cpu": "v1: ranksPerReplica 1024 > this node's cap 8 (--max-rank-processes); no rank process was started",
        "gpu": f"v1: ranksPerReplica {many} > this node's {gpus} GPUs (cuda: a rank a GPU); no rank process",
    }
    workers = f"ferry_agent.ranks.worker .*--node {name}"

    def failed() -> dict | None:
        items = json.loads(cluster.kubectl("get", "wr", "-n", namespace, "-o", "json").stdout)["items"]
        status = {r["spec"]["modelLoad"]: r.get("status") or {} for r in items}
        done = {ml: s for ml, s in status.items() if s.get("phase") == "Failed"}
        return done if len(done) == 2 else None

    try:
        apply(
            cluster,
            namespace,
            ml_body(namespace, "v1", 1, name="cpu", ranksPerReplica=1024),
            ml_body(namespace, "v1", 1, name="gpu", ranksPerReplica=many, device="cuda"),
        )
        statuses = wait_for(failed, 60, "both replicas fail", lambda: agent.log_tail(40))
        for ml, status in statuses.items():
            assert status["reason"] == "RanksExceedNode", status
            assert expected[ml] in status["message"], status
        # Retried with backoff (1 s here), each retry refused the same way: still no rank process, idle ones neither.
        wait_for(lambda: agent.log_path.read_text().count("ranksPerReplica 1024 >") >= 3, 30, "retries", agent.log_tail)
        assert subprocess.run(["pgrep", "-f", workers], capture_output=True).returncode == 1, "a rank process ran"
        assert "started rank process" not in agent.log_path.read_text()
    finally:
        cluster.kubectl("delete", "ml", "cpu", "gpu", "-n", namespace, "--wait=false", check=False)
        agent.stop()
