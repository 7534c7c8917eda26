"""Failure paths of the full system: a wedged source peer is reported as PeerStalled and the target completes from
another peer with correct bytes; the operator killed in the middle of a version rollout converges after restart."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import signal
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from safetensors.torch import save_file

from ferry.api.models import ModelLoadSpec
from ferry_agent.kube.registry import source_candidates
from ferry_agent.strategies.selector import make_selector
from ferry_operator.modelloads import choose_nodes, replica_name
from tests.support.agents import (
    agent_metrics,
    content_sha256,
    node,
    read_back,
    seed_arg,
    seeded_agents,
    start_agent,
    weights,
)
from tests.support.objects import condition, ml_body, ml_status, wait_for, wv_body

pytestmark = pytest.mark.e2e


def modelload(namespace: str, replicas: int, version: str, **transfer) -> dict:
    transfer = {"timeoutSeconds": 20, "stallSeconds": 2, "selector": "rendezvousHash", **transfer}
    return ml_body(namespace, version, replicas, transfer=transfer)


def apply(cluster, namespace, body):
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))


def peer_only(cluster, namespace, *versions):
    """The seeds hold PeerOnly versions: nothing in S3, served from memory once one node has them."""
    for version in versions:
        apply(cluster, namespace, wv_body(namespace, version, fmt="PeerOnly"))


def replicas(cluster, namespace) -> dict[str, dict]:
    items = json.loads(cluster.kubectl("get", "wr", "-n", namespace, "-o", "json").stdout)["items"]
    return {r["metadata"]["name"]: r for r in items}


def leases(cluster, namespace) -> dict[str, dict]:
    items = json.loads(cluster.kubectl("get", "lease", "-n", namespace, "-o", "json").stdout)["items"]
    return {lease["metadata"]["name"]: lease for lease in items}


def series(text: str, name: str, **labels: str) -> list[float]:
    """The values of the samples named `name` whose labels include `labels`, from Prometheus text."""
    return [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name and labels.items() <= s.labels.items()
    ]


def scrape(url: str) -> str:
    return urllib.request.urlopen(url, timeout=5).read().decode()


def events(cluster, namespace) -> str:
    return cluster.kubectl("get", "events", "-n", namespace, "--field-selector", "involvedObject.kind=ModelLoad").stdout


def test_wedged_source_is_reported_and_the_target_completes_elsewhere(cluster, namespace, operator, tmp_path):
    seed = tmp_path / "v1.safetensors"
    save_file(weights(1), str(seed))
    expected = content_sha256(weights(1))
    names = [f"{namespace}-n{i}" for i in range(3)]
    for n in names:
        node(cluster, n, {"ferry.dev/pool": namespace})
    # Long leases: a stopped agent still looks alive, exactly the case a stall must expose.
    agents = {n: start_agent(cluster, tmp_path, n, seed_arg(namespace, "v1", seed), lease_seconds=60) for n in names}
    stopped = None

    def describe() -> str:
        return json.dumps(ml_status(cluster, namespace), indent=1) + "".join(a.log_tail(10) for a in agents.values())

    try:
        peer_only(cluster, namespace, "v1")
        apply(cluster, namespace, modelload(namespace, 2, "v1"))
        wait_for(lambda: ml_status(cluster, namespace).get("ready") == "2/2", 60, "2/2", describe)
        serving = replicas(cluster, namespace)
        nodes = [{"metadata": {"name": n, "labels": {"ferry.dev/pool": namespace}}, "spec": {}} for n in names]
        spec = ModelLoadSpec.model_validate(modelload(namespace, 3, "v1")["spec"])
        current = [r["spec"]["nodeName"] for r in serving.values()]
        newcomer_node = choose_nodes(spec, nodes, current, [], salt="serve")[2]
        newcomer = replica_name("serve", newcomer_node)
        now = dt.datetime.now(dt.UTC)
        cands = source_candidates(
            serving.values(), leases(cluster, namespace), version="v1", rank=0, self_replica=newcomer, now=now
        )
        first = make_selector("rendezvousHash").order(cands, model="m", target_id=newcomer, target_rank=0)[0]
        stopped = agents[serving[first.replica]["spec"]["nodeName"]]
        os.kill(stopped.proc.pid, signal.SIGSTOP)  # wedged: connections open, nothing answers

        cluster.kubectl("patch", "ml", "serve", "-n", namespace, "--type=merge", "-p", '{"spec":{"replicas":3}}')
        stalled = wait_for(
            lambda: (
                (c := condition({"status": ml_status(cluster, namespace)}, "PeerStalled")).get("status") == "True" and c
            ),
            30,
            "PeerStalled",
            describe,
        )
        assert newcomer in stalled["message"] and f"peer/{first.replica}" in stalled["message"]
        # What an alert sees meanwhile: the operator's PeerStalled gauge, and the newcomer's load in flight.
        ours = {"namespace": namespace, "modelload": "serve"}
        stalled_gauge = {**ours, "condition": "PeerStalled", "status": "True"}
        wait_for(
            lambda: series(scrape(operator.metrics_url), "ferry_modelload_condition", **stalled_gauge) == [1.0],
            10,
            "PeerStalled gauge",
            describe,
        )
        inflight = {"namespace": namespace, "replica": newcomer}
        text = agent_metrics(agents[newcomer_node])
        assert len(series(text, "ferry_agent_inflight_bytes", **inflight)) == 1, text
        assert series(text, "ferry_agent_inflight_last_progress_timestamp_seconds", **inflight)[0] > 0
        done = wait_for(
            lambda: (r := replicas(cluster, namespace).get(newcomer)) and r["status"].get("phase") == "Serving" and r,
            60,
            f"{newcomer} Serving",
            describe,
        )
        status = done["status"]
        assert status["source"].startswith("peer/") and status["source"] != f"peer/{first.replica}"
        failed = [a for a in status["attempts"] if a["source"] == f"peer/{first.replica}"]
        assert failed and failed[0]["outcome"] == "Failed"
        assert read_back(status["ranks"][0], newcomer) == expected, "the completed replica serves the exact bytes"
        assert re.fullmatch(r"100% \S+/s", status["progress"]), status["progress"]
        assert not series(agent_metrics(agents[newcomer_node]), "ferry_agent_inflight_bytes", **inflight)
        wait_for(
            lambda: condition({"status": ml_status(cluster, namespace)}, "PeerStalled").get("status") == "False",
            20,
            "stall cleared",
            describe,
        )
        assert "NoProgress" in events(cluster, namespace)
        wait_for(
            lambda: series(scrape(operator.metrics_url), "ferry_modelload_replicas", **ours, phase="Serving") == [3.0],
            10,
            "3 Serving in the replicas gauge",
            describe,
        )
        stalled_gauge["status"] = "False"
        assert series(scrape(operator.metrics_url), "ferry_modelload_condition", **stalled_gauge) == [1.0]
    finally:
        if stopped is not None and stopped.alive:
            os.kill(stopped.proc.pid, signal.SIGCONT)
        for a in agents.values():
            a.stop()


def test_operator_restart_mid_rollout_converges(cluster, namespace, operator, tmp_path):
    agents = seeded_agents(cluster, tmp_path, namespace)

    def describe() -> str:
        return json.dumps(ml_status(cluster, namespace), indent=1) + operator.process.log_tail(20)

    try:
        peer_only(cluster, namespace, "v1", "v2")
        apply(cluster, namespace, modelload(namespace, 3, "v1"))
        wait_for(lambda: ml_status(cluster, namespace).get("ready") == "3/3", 60, "3/3 on v1", describe)
        # Freeze the agent of the replica the rollout moves first, so the rollout is provably mid-way.
        first = sorted(replicas(cluster, namespace))[0]
        frozen = agents[replicas(cluster, namespace)[first]["spec"]["nodeName"]]
        os.kill(frozen.proc.pid, signal.SIGSTOP)
        cluster.kubectl(
            "patch", "ml", "serve", "-n", namespace, "--type=merge", "-p", '{"spec":{"desiredVersion":"v2"}}'
        )
        wait_for(
            lambda: replicas(cluster, namespace)[first]["spec"]["version"] == "v2", 30, "rollout started", describe
        )
        operator.kill()
        versions = sorted(r["spec"]["version"] for r in replicas(cluster, namespace).values())
        assert versions == ["v1", "v1", "v2"], "one replica at a time"
        os.kill(frozen.proc.pid, signal.SIGCONT)
        operator.start()
        wait_for(
            lambda: (
                ml_status(cluster, namespace).get("loadedVersion") == "v2"
                and ml_status(cluster, namespace).get("ready") == "3/3"
            ),
            90,
            "3/3 on v2 after restart",
            describe,
        )
        final = replicas(cluster, namespace)
        assert {r["status"]["version"] for r in final.values()} == {"v2"}
        assert {r["metadata"]["labels"]["ferry.dev/version"] for r in final.values()} == {"v2"}
        assert "RollingOut" in events(cluster, namespace)
    finally:
        for a in agents.values():
            a.stop()
