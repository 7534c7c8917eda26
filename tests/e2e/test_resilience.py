"""Agents against a control plane that misbehaves: the kube-apiserver killed for 20 s (in steady state, in the
middle of a load, and while the rank processes of a two-rank replica start), an agent frozen for 40 s (SIGSTOP),
and a replica's Lease deleted by hand.

In each case the agent processes live on (same pids), keep serving what they hold (read back over NIXL with
the apiserver down), reload nothing they already served (their load counters and `completedTime` do not move),
and the ModelLoad converges to Ready; a replica whose agent is back is Live and a source again."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ferry import checkpoint_format as cf
from tests.support.agents import agent_metrics, content_sha256, node, pull, read_back, seed_arg, start_agent
from tests.support.objects import (
    apply,
    condition,
    get,
    ml_body,
    ml_status,
    publish_full,
    put_files,
    tensors,
    wait_for,
    wait_reason,
    wv_body,
)

pytestmark = pytest.mark.e2e

OUTAGE_S = 20
FREEZE_S = 40
LEASE_S = 6


def modelload(namespace: str, replicas: int, version: str = "v1", **spec) -> dict:
    return ml_body(namespace, version, replicas, transfer={"timeoutSeconds": 30, "stallSeconds": 60}, **spec)


def replicas(cluster, namespace) -> dict[str, dict]:
    items = json.loads(cluster.kubectl("get", "wr", "-n", namespace, "-o", "json").stdout)["items"]
    return {r["spec"]["nodeName"]: r for r in items}


def load_counters(agent) -> list[str]:
    """The agent's load and loaded-bytes counters: unchanged means nothing was loaded again."""
    return sorted(
        line
        for line in agent_metrics(agent).splitlines()
        if line.startswith(("ferry_agent_loads_total{", "ferry_agent_loaded_bytes_total{"))
    )


def weights(seed: int, n: int, shape: tuple[int, int]) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {f"layers.{i}.weight": torch.randn(shape, generator=gen) for i in range(n)}


def phase_of(cluster, namespace, node_name) -> str | None:
    return ((replicas(cluster, namespace).get(node_name) or {}).get("status") or {}).get("phase")


@contextlib.contextmanager
def frozen(s3):
    """SeaweedFS stopped (SIGSTOP: its sockets stay open, nothing answers) for the block."""
    os.kill(s3.process.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(s3.process.proc.pid, signal.SIGCONT)


def ready(cluster, namespace, wanted: int) -> bool:
    status = ml_status(cluster, namespace)
    return status.get("phase") == "Ready" and status.get("ready") == f"{wanted}/{wanted}"


def test_agents_outlive_an_apiserver_outage(cluster, s3, namespace, operator, tmp_path):
    tensors = weights(21, 8, (512, 512))  # 8 MiB, in 1 MiB shards: a load that takes a moment
    put_files(
        s3, namespace, "v1", cf.build_full_checkpoint({k: v.numpy() for k, v in tensors.items()}, shard_bytes=1 << 20)
    )
    expected = content_sha256(tensors)
    names = [f"{namespace}-n{i}" for i in range(3)]
    for n in names:
        node(cluster, n, {"ferry.dev/pool": namespace})
    agents = {n: start_agent(cluster, tmp_path, n, s3=s3) for n in names}
    pids = {n: a.proc.pid for n, a in agents.items()}

    def describe() -> str:
        return json.dumps(ml_status(cluster, namespace), indent=1) + "".join(a.log_tail(20) for a in agents.values())

    def outage(during=None) -> None:
        cluster.stop_apiserver()  # a no-op when it is down already
        start = time.monotonic()
        try:
            if during:
                during()
            time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - start)))
            assert all(a.alive for a in agents.values()), describe()
        finally:
            cluster.start_apiserver()

    try:
        # Object storage only, so that the load in the middle of the second outage has something to read.
        apply(cluster, namespace, wv_body(namespace, "v1"), modelload(namespace, 2, sourceOrder=["ObjectStorage"]))
        wait_for(lambda: ready(cluster, namespace, 2), 120, "2/2 ready", describe)
        before = replicas(cluster, namespace)
        serving = sorted(before)
        counters = {n: load_counters(agents[n]) for n in serving}

        # Steady state: the apiserver goes away for 20 s. The agents keep serving the readers the API last
        # accepted (their reviews and the replica view answer through an outage); no new reader gets in meanwhile.
        def read_all() -> None:
            for n in serving:
                entry = before[n]["status"]["ranks"][0]
                assert read_back(entry, before[n]["metadata"]["name"]) == expected

        read_all()
        outage(during=read_all)
        wait_for(lambda: ready(cluster, namespace, 2), 60, "2/2 ready after the outage", describe)
        after = replicas(cluster, namespace)
        for n in serving:
            assert agents[n].alive and agents[n].proc.pid == pids[n]
            assert after[n]["status"]["phase"] == "Serving"
            assert after[n]["status"]["completedTime"] == before[n]["status"]["completedTime"], "reloaded"
            assert load_counters(agents[n]) == counters[n], "reloaded"

        # In the middle of a load: scale up with S3 frozen, so the new replica is Loading and has read nothing when
        # the apiserver goes away; S3 comes back as the outage begins, and the load runs through it.
        (third,) = set(names) - set(serving)
        with frozen(s3):
            cluster.kubectl("patch", "ml", "serve", "-n", namespace, "--type=merge", "-p", '{"spec":{"replicas":3}}')
            wait_for(lambda: phase_of(cluster, namespace, third) == "Loading", 60, f"{third} Loading", describe)
            cluster.stop_apiserver()
        outage()
        wait_for(lambda: ready(cluster, namespace, 3), 90, "3/3 ready after the outage", describe)
        final = replicas(cluster, namespace)
        for n in names:
            assert agents[n].alive and agents[n].proc.pid == pids[n], f"agent {n} restarted or died"
        for n in serving:
            assert final[n]["status"]["completedTime"] == before[n]["status"]["completedTime"], "reloaded"
            assert load_counters(agents[n]) == counters[n], "reloaded"
        loads = [line for line in load_counters(agents[third]) if line.startswith("ferry_agent_loads_total{")]
        assert loads == ['ferry_agent_loads_total{outcome="Loaded",source_kind="s3"} 1.0'], loads
        assert read_back(final[third]["status"]["ranks"][0], final[third]["metadata"]["name"]) == expected
        assert operator.process.alive, operator.process.log_tail()
    finally:
        if not cluster.process("kube-apiserver").alive:
            cluster.start_apiserver()
        for a in agents.values():
            a.stop()


def test_rank_processes_outlive_an_apiserver_outage(cluster, s3, namespace, operator, tmp_path):
    """A two-rank replica whose rank processes start (and read the API) while the apiserver is down."""
    expected = tensors(31, n=6, shape=(64, 48))
    publish_full(s3, namespace, "v1", expected)
    name = f"{namespace}-n0"
    node(cluster, name, {"ferry.dev/pool": namespace})
    agent = start_agent(cluster, tmp_path, name, s3=s3)
    pid = agent.proc.pid

    def describe() -> str:
        return json.dumps(ml_status(cluster, namespace), indent=1) + agent.log_tail(40)

    try:
        apply(cluster, namespace, wv_body(namespace, "v1"))
        wait_reason(cluster, namespace, "v1", "Ready", "True", "Verified")
        # S3 frozen until the apiserver is gone: the ranks are still to read their spec and every byte.
        with frozen(s3):
            apply(cluster, namespace, modelload(namespace, 1, ranksPerReplica=2))
            wait_for(lambda: phase_of(cluster, namespace, name) == "Loading", 60, "Loading", describe)
            cluster.stop_apiserver()
        try:
            time.sleep(OUTAGE_S)
            assert agent.alive, describe()
        finally:
            cluster.start_apiserver()
        wait_for(lambda: ready(cluster, namespace, 1), 120, "1/1 ready after the outage", describe)
        assert agent.alive and agent.proc.pid == pid
        loads = [line for line in load_counters(agent) if line.startswith("ferry_agent_loads_total{")]
        assert loads == ['ferry_agent_loads_total{outcome="Loaded",source_kind="s3"} 1.0'], loads
        wr = replicas(cluster, namespace)[name]
        union: dict[str, torch.Tensor] = {}
        for entry in wr["status"]["ranks"]:
            union.update(pull(entry, wr["metadata"]["name"]))
        assert sorted(union) == sorted(expected)
        for key, array in expected.items():
            assert np.array_equal(union[key].numpy(), array), key
    finally:
        if not cluster.process("kube-apiserver").alive:
            cluster.start_apiserver()
        agent.stop()


def peer_only_setup(cluster, namespace, tmp_path, count: int):
    """A PeerOnly version seeded on node 0 and loaded from peers on the others; lease LEASE_S."""
    tensors = weights(23, 4, (256, 256))
    seed = tmp_path / "v1.safetensors"
    save_file(tensors, str(seed))
    names = [f"{namespace}-n{i}" for i in range(count)]
    for n in names:
        node(cluster, n, {"ferry.dev/pool": namespace})
    agents = {
        n: start_agent(cluster, tmp_path, n, *([seed_arg(namespace, "v1", seed)] * (i == 0)), lease_seconds=LEASE_S)
        for i, n in enumerate(names)
    }
    apply(cluster, namespace, wv_body(namespace, "v1", fmt="PeerOnly"), modelload(namespace, count))
    return names, agents, content_sha256(tensors)


def test_frozen_agent_is_live_and_a_source_again(cluster, namespace, operator, tmp_path):
    names, agents, expected = peer_only_setup(cluster, namespace, tmp_path, 2)
    seeded, frozen = names

    def describe() -> str:
        return json.dumps(ml_status(cluster, namespace), indent=1) + "".join(a.log_tail(20) for a in agents.values())

    try:
        wait_for(lambda: ready(cluster, namespace, 2), 90, "2/2 ready", describe)
        before = replicas(cluster, namespace)[frozen]
        counters = load_counters(agents[frozen])

        os.kill(agents[frozen].proc.pid, signal.SIGSTOP)
        try:
            wait_for(
                lambda: (
                    condition({"status": ml_status(cluster, namespace)}, "Degraded").get("reason") == "ReplicaStale"
                ),
                FREEZE_S,
                "ReplicaStale while frozen",
                describe,
            )
            wr = replicas(cluster, namespace)[frozen]
            assert condition(wr, "Live")["status"] == "False" and wr["status"]["phase"] == "Serving"
            time.sleep(max(0.0, FREEZE_S - LEASE_S))
        finally:
            os.kill(agents[frozen].proc.pid, signal.SIGCONT)

        # Back within two lease periods: Live, Ready, and nothing reloaded.
        wait_for(lambda: ready(cluster, namespace, 2), 2 * LEASE_S, "2/2 ready after SIGCONT", describe)
        after = replicas(cluster, namespace)[frozen]
        assert after["status"]["phase"] == "Serving" and condition(after, "Live")["status"] == "True"
        assert after["status"]["completedTime"] == before["status"]["completedTime"], "reloaded"
        assert load_counters(agents[frozen]) == counters, "reloaded"

        # And a source again: with the seeded node's agent dead, a new node loads from the unfrozen one.
        agents[seeded].kill()
        extra = f"{namespace}-n2"
        node(cluster, extra, {"ferry.dev/pool": namespace})
        agents[extra] = start_agent(cluster, tmp_path, extra, lease_seconds=LEASE_S)
        cluster.kubectl("patch", "ml", "serve", "-n", namespace, "--type=merge", "-p", '{"spec":{"replicas":3}}')

        def extra_serving():
            wr = replicas(cluster, namespace).get(extra)
            return wr if wr and (wr.get("status") or {}).get("phase") == "Serving" else None

        loaded = wait_for(extra_serving, 90, f"{extra} serving", describe)
        assert loaded["status"]["source"] == f"peer/{after['metadata']['name']}"
        assert read_back(loaded["status"]["ranks"][0], loaded["metadata"]["name"]) == expected
    finally:
        for a in agents.values():
            a.stop()


def test_deleted_lease_is_recreated(cluster, namespace, operator, tmp_path):
    names, agents, _ = peer_only_setup(cluster, namespace, tmp_path, 2)

    def describe() -> str:
        return json.dumps(ml_status(cluster, namespace), indent=1) + "".join(a.log_tail(20) for a in agents.values())

    try:
        wait_for(lambda: ready(cluster, namespace, 2), 90, "2/2 ready", describe)
        victim = names[1]
        before = replicas(cluster, namespace)[victim]
        holder = before["status"]["ranks"][0]["agentName"]
        counters = load_counters(agents[victim])
        lease = f"ferry-wr-{before['metadata']['name']}"
        old_uid = get(cluster, namespace, "lease", lease)["metadata"]["uid"]
        cluster.kubectl("delete", "lease", lease, "-n", namespace)

        def recreated():
            obj = get(cluster, namespace, "lease", lease)
            return obj if obj and obj["metadata"]["uid"] != old_uid else None

        assert wait_for(recreated, 2 * LEASE_S, "the Lease recreated", describe)["spec"]["holderIdentity"] == holder
        wait_for(lambda: ready(cluster, namespace, 2), 2 * LEASE_S, "2/2 ready", describe)
        after = replicas(cluster, namespace)[victim]
        assert after["status"]["phase"] == "Serving" and condition(after, "Live")["status"] == "True"
        assert after["status"]["completedTime"] == before["status"]["completedTime"], "reloaded"
        assert load_counters(agents[victim]) == counters, "reloaded"
    finally:
        for a in agents.values():
            a.stop()
