"""A highly available operator: candidates (real `kopf run` processes) elect one leader on a coordination Lease.

The standby does nothing while the leader lives (no reconcile, no Event, only its standby liveness endpoint); the
leader is killed with SIGKILL in the middle of a rollout and of a batch of WeightVersions, and the standby takes
over and finishes both without a duplicate replica or a lost status. A leader stopped gracefully hands the Lease
over at once, and a leader that finds the Lease taken exits."""

from __future__ import annotations

import datetime as dt
import json
import os
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest

from ferry_dev.localcluster import ManagedProcess, free_port
from tests.support.agents import seeded_agents
from tests.support.objects import apply, get, ml_body, ml_status, publish_full, tensors, wait_for, wv_body
from tests.support.operators import OperatorHandle, metrics_url

pytestmark = pytest.mark.e2e

LEASE = "ferry-operator"
BATCH = 20  # WeightVersions applied just before the leader dies


class Candidate:
    def __init__(self, process: ManagedProcess, healthz: str) -> None:
        self.process, self.healthz = process, healthz
        self.metrics = metrics_url(process)

    def metric_lines(self, prefix: str) -> list[str]:
        text = urllib.request.urlopen(self.metrics, timeout=5).read().decode()
        return [line for line in text.splitlines() if line.startswith(prefix)]

    def reconciled(self) -> bool:
        return bool(self.metric_lines("ferry_reconciles_total{"))


@pytest.fixture
def candidates(operator_handle: OperatorHandle, namespace: str) -> Iterator[Callable[[str], Candidate]]:
    """Start leader-election candidates; the session's operator is stopped meanwhile (the `operator` fixture of
    later tests starts it again)."""
    operator_handle.stop()
    started: list[ManagedProcess] = []

    def start(name: str) -> Candidate:
        healthz = f"http://127.0.0.1:{free_port()}/healthz"
        env = {
            "FERRY_LEADER_ELECTION": "true",
            "FERRY_LEADER_ELECTION_NAMESPACE": namespace,
            "FERRY_LEADER_ELECTION_LEASE": LEASE,
            "FERRY_LEADER_ELECTION_IDENTITY": name,
            "FERRY_STANDBY_HEALTHZ": healthz,
        }
        process = operator_handle.spawn(name, env, ["--liveness", healthz])
        started.append(process)
        return Candidate(process, healthz)

    yield start
    for process in started:
        process.stop()


def lease(cluster, namespace) -> dict:
    return (get(cluster, namespace, "lease", LEASE) or {}).get("spec") or {}


def holder(cluster, namespace) -> str:
    return lease(cluster, namespace).get("holderIdentity") or ""


def replicas(cluster, namespace) -> list[dict]:
    return json.loads(cluster.kubectl("get", "wr", "-n", namespace, "-o", "json").stdout)["items"]


def events(cluster, namespace) -> list[dict]:
    return json.loads(cluster.kubectl("get", "events", "-n", namespace, "-o", "json").stdout)["items"]


def phase(cluster, namespace, version: str) -> str | None:
    return ((get(cluster, namespace, "wv", version) or {}).get("status") or {}).get("phase")


def parse(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text.replace("Z", "+00:00"))


def test_standby_takes_over_mid_rollout(cluster, s3, namespace, candidates, tmp_path):
    agents = seeded_agents(cluster, tmp_path, namespace)
    names = list(agents)
    batch = [f"w{i:02d}" for i in range(BATCH)]
    for i, version in enumerate(batch):
        publish_full(s3, namespace, version, tensors(100 + i, n=2, shape=(8, 8)))

    a = candidates("ha-a")
    wait_for(lambda: holder(cluster, namespace).startswith("ha-a_"), 30, "a leads", a.process.log_tail)
    b = candidates("ha-b")
    wait_for(lambda: "standby; ha-a_" in b.process.log_tail(50), 30, "b is a standby", b.process.log_tail)

    def describe() -> str:
        return json.dumps(ml_status(cluster, namespace), indent=1) + a.process.log_tail(15) + b.process.log_tail(15)

    frozen = None
    try:
        ml = ml_body(namespace, "v1", 3, transfer={"timeoutSeconds": 20, "stallSeconds": 20})
        apply(cluster, namespace, wv_body(namespace, "v1", fmt="PeerOnly"), wv_body(namespace, "v2", fmt="PeerOnly"))
        apply(cluster, namespace, ml)
        wait_for(lambda: ml_status(cluster, namespace).get("ready") == "3/3", 90, "3/3 on v1", describe)

        # The standby did nothing: no reconcile, no Event; it answers its liveness probe as a standby.
        assert not b.reconciled(), b.metric_lines("ferry_reconciles_total")
        assert b.metric_lines("ferry_operator_leader ") == ["ferry_operator_leader 0.0"]
        assert a.metric_lines("ferry_operator_leader ") == ["ferry_operator_leader 1.0"]
        assert "standby; ha-a_" in urllib.request.urlopen(b.healthz, timeout=5).read().decode()
        a_id, b_id = holder(cluster, namespace), ""
        assert {e["reportingInstance"] for e in events(cluster, namespace)} == {a_id}

        # Mid-rollout: the agent of the replica moved first is frozen, so the rollout cannot finish yet.
        first = sorted(r["metadata"]["name"] for r in replicas(cluster, namespace))[0]
        frozen = agents[
            next(r for r in replicas(cluster, namespace) if r["metadata"]["name"] == first)["spec"]["nodeName"]
        ]
        os.kill(frozen.proc.pid, signal.SIGSTOP)
        cluster.kubectl(
            "patch", "ml", "serve", "-n", namespace, "--type=merge", "-p", '{"spec":{"desiredVersion":"v2"}}'
        )
        wait_for(
            lambda: get(cluster, namespace, "wr", first)["spec"]["version"] == "v2", 30, "rollout started", describe
        )
        apply(cluster, namespace, *(wv_body(namespace, v) for v in batch))
        a.process.kill()  # SIGKILL: no cleanup, the Lease stays as it was
        killed = time.monotonic()
        wait_for(lambda: holder(cluster, namespace).startswith("ha-b_"), 60, "b takes over", describe)
        took_lease = time.monotonic() - killed
        wait_for(b.reconciled, 30, "b reconciles", describe)
        first_reconcile = time.monotonic() - killed
        print(
            f"\ntakeover after kill -9: Lease held by b after {took_lease:.1f}s, first reconcile at "
            f"{first_reconcile:.1f}s"
        )
        b_id = holder(cluster, namespace)
        # The standby's liveness endpoint gave way to kopf's own on the same port.
        assert "standby" not in urllib.request.urlopen(b.healthz, timeout=5).read().decode()
        assert lease(cluster, namespace)["leaseTransitions"] == 1
        os.kill(frozen.proc.pid, signal.SIGCONT)
        frozen = None

        wait_for(
            lambda: (s := ml_status(cluster, namespace)).get("loadedVersion") == "v2" and s.get("ready") == "3/3",
            120,
            "3/3 on v2 after the takeover",
            describe,
        )
        wait_for(lambda: all(phase(cluster, namespace, v) == "Ready" for v in batch), 60, "the batch Ready", describe)
        # No duplicate replica, no lost status.
        final = replicas(cluster, namespace)
        assert sorted(r["spec"]["nodeName"] for r in final) == sorted(names)
        assert {(r["spec"]["version"], r["status"]["version"], r["status"]["phase"]) for r in final} == {
            ("v2", "v2", "Serving")
        }
        status = ml_status(cluster, namespace)
        assert (status["readyReplicas"], status["phase"]) == (3, "Ready")
        for v in ["v1", "v2", *batch]:
            wv = get(cluster, namespace, "wv", v)
            assert wv["status"]["phase"] == "Ready", (v, wv["status"])
        # Every Event is the leader's of its time: b posted none before it held the Lease.
        acquired = parse(lease(cluster, namespace)["acquireTime"])
        posted = events(cluster, namespace)
        assert {e["reportingInstance"] for e in posted} == {a_id, b_id}
        assert all(parse(e["eventTime"]) >= acquired for e in posted if e["reportingInstance"] == b_id)
        assert {e["source"]["component"] for e in posted} == {"ferry-operator"}

        # A graceful stop hands the Lease over at once; a leader that finds the Lease taken exits.
        c = candidates("ha-c")
        wait_for(lambda: "standby; ha-b_" in c.process.log_tail(50), 30, "c is a standby", c.process.log_tail)
        stopped = time.monotonic()
        b.process.stop()
        assert "released the Lease" in b.process.log_tail(50)
        wait_for(lambda: holder(cluster, namespace).startswith("ha-c_"), 30, "c takes over", c.process.log_tail)
        print(f"handover after SIGTERM: {time.monotonic() - stopped:.1f}s")
        wait_for(c.reconciled, 30, "c reconciles", c.process.log_tail)
        steal(cluster, namespace)
        wait_for(lambda: not c.process.alive, 30, "c exits", c.process.log_tail)
        assert c.process.proc.returncode == 1
        assert "is held by intruder; exiting" in c.process.log_tail(50)
        # A standby stops promptly on SIGTERM (ManagedProcess.stop kills it after 10 s), having done nothing.
        d = candidates("ha-d")
        wait_for(lambda: "standby; intruder holds" in d.process.log_tail(50), 30, "d is a standby", d.process.log_tail)
        assert not d.reconciled()
        d.process.stop()
        assert d.process.proc.returncode == 0, d.process.log_tail()
    finally:
        if frozen is not None:
            os.kill(frozen.proc.pid, signal.SIGCONT)
        for agent in agents.values():
            agent.stop()


def steal(cluster, namespace) -> None:
    """Another holder writes the Lease (as a partitioned leader would find on its return)."""
    for _ in range(10):
        body = get(cluster, namespace, "lease", LEASE)
        now = dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        body["spec"].update(holderIdentity="intruder", renewTime=now, acquireTime=now, leaseDurationSeconds=60)
        if cluster.kubectl("replace", "-f", "-", input=json.dumps(body), check=False).returncode == 0:
            return
        time.sleep(0.2)  # the leader renewed in between
    raise AssertionError("could not write the Lease")
