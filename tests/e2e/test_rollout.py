"""Rollouts of a new version (`spec.rollout`) through the real parts: operator + agent processes + the real
apiserver + SeaweedFS, every replica watched through the API for the whole rollout and its bytes read back over NIXL.

- Rolling, maxUnavailable 1, 3 replicas, v1 → a delta v2: at no point is more than one replica moving or serving
  nothing; all end on v2 with v2's bytes.
- Parallel, 3 replicas, S3 frozen while they move: every replica moves at once and keeps serving v1 (never a
  replica that serves nothing once it served); loading v2 fails and v1 still serves, to a peer that loads v1
  mid-rollout and to a direct read; once S3 answers, all serve v2's bytes.
"""

from __future__ import annotations

import json
import os
import signal
import threading

import numpy as np
import pytest
import torch
from kubernetes import client, watch

from ferry.api.models import GROUP, VERSION
from tests.support.agents import content_sha256, node, read_back, replica, start_agent
from tests.support.objects import (
    apply,
    condition,
    get,
    ml_body,
    ml_status,
    publish_delta,
    publish_full,
    tensors,
    wait_for,
    wait_reason,
    wv_body,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(400)]

State = tuple[str, str | None, str | None, str | None, str | None]  # spec.version, phase, version, loading, reason


def sha(weights: dict[str, np.ndarray]) -> str:
    return content_sha256({name: torch.from_numpy(array) for name, array in weights.items()})


class ReplicaWatch:
    """Every state of the namespace's WeightReplicas, from one watch: the apiserver orders a collection's events,
    so each recorded snapshot is a state the cluster was in."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self._objects = client.CustomObjectsApi(api)
        self._namespace = namespace
        self._stop = threading.Event()
        self.snapshots: list[dict[str, State]] = []
        self.error: BaseException | None = None
        listed = self._objects.list_namespaced_custom_object(GROUP, VERSION, namespace, "weightreplicas")
        self._current = {r["metadata"]["name"]: self._state(r) for r in listed["items"]}
        self.snapshots.append(dict(self._current))
        self._version = listed["metadata"]["resourceVersion"]
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def _state(wr: dict) -> State:
        status = wr.get("status") or {}
        return (
            wr["spec"]["version"],
            status.get("phase"),
            status.get("version"),
            status.get("loadingVersion"),
            status.get("reason"),
        )

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for event in watch.Watch().stream(
                    self._objects.list_namespaced_custom_object,
                    GROUP,
                    VERSION,
                    self._namespace,
                    "weightreplicas",
                    resource_version=self._version,
                    timeout_seconds=2,
                ):
                    wr = event["object"]
                    self._version = wr["metadata"]["resourceVersion"]
                    if event["type"] == "DELETED":
                        self._current.pop(wr["metadata"]["name"], None)
                    else:
                        self._current[wr["metadata"]["name"]] = self._state(wr)
                    self.snapshots.append(dict(self._current))
        except BaseException as exc:  # surfaced by stop(): a watch that broke has not seen every state
            self.error = exc

    def stop(self) -> list[dict[str, State]]:
        self._stop.set()
        self._thread.join(10)
        assert self.error is None, f"the replica watch broke: {self.error!r}"
        return self.snapshots


def moving(state: State, desired: str) -> bool:
    return state[0] == desired and not (state[1] == "Serving" and state[2] == desired)


def replicas(cluster, namespace) -> dict[str, dict]:
    items = json.loads(cluster.kubectl("get", "wr", "-n", namespace, "-o", "json").stdout)["items"]
    return {r["metadata"]["name"]: r for r in items if r["spec"]["modelLoad"] == "serve"}


def publish_v1_v2(cluster, s3, namespace) -> tuple[dict, dict]:
    """v1 a full checkpoint, v2 an XorDelta over it, both verified (while S3 answers)."""
    v1, v2 = tensors(701), tensors(702)
    v2["layer0.weight"] = v1["layer0.weight"]  # a delta that leaves a tensor as it was
    publish_full(s3, namespace, "v1", v1)
    publish_delta(s3, namespace, "v2", "v1", v1, v2)
    apply(cluster, namespace, wv_body(namespace, "v1"), wv_body(namespace, "v2", base="v1"))
    for version in ("v1", "v2"):
        wait_reason(cluster, namespace, version, "Ready", "True", "Verified")
    return v1, v2


def start_nodes(cluster, s3, namespace, tmp_path, count: int) -> dict:
    names = [f"{namespace}-n{i}" for i in range(count)]
    for n in names:
        node(cluster, n, {"ferry.dev/pool": namespace})
    return {n: start_agent(cluster, tmp_path, n, s3=s3, retry_seconds=1) for n in names}


def set_desired(cluster, namespace: str, version: str) -> None:
    patch = json.dumps({"spec": {"desiredVersion": version}})
    cluster.kubectl("patch", "ml", "serve", "-n", namespace, "--type=merge", "-p", patch)


def test_rolling_max_unavailable_one(cluster, s3, namespace, operator, tmp_path, kube):
    v1, v2 = publish_v1_v2(cluster, s3, namespace)
    agents = start_nodes(cluster, s3, namespace, tmp_path, 3)

    def describe() -> str:
        states = {n: r.get("status") for n, r in replicas(cluster, namespace).items()}
        return json.dumps([ml_status(cluster, namespace), states], indent=1) + operator.process.log_tail(20)

    try:
        rollout = {"strategy": "Rolling", "maxUnavailable": 1}
        apply(cluster, namespace, ml_body(namespace, "v1", 3, transfer={"timeoutSeconds": 30}, rollout=rollout))
        wait_for(lambda: ml_status(cluster, namespace).get("ready") == "3/3", 120, "3/3 on v1", describe)
        watcher = ReplicaWatch(kube, namespace)
        set_desired(cluster, namespace, "v2")
        wait_for(
            lambda: (s := ml_status(cluster, namespace)).get("ready") == "3/3" and s.get("loadedVersion") == "v2",
            180,
            "3/3 on v2",
            describe,
        )
        snapshots = watcher.stop()

        assert len(snapshots[0]) == 3 and all(s == ("v1", "Serving", "v1", None, None) for s in snapshots[0].values())
        for snapshot in snapshots:
            assert sum(moving(s, "v2") for s in snapshot.values()) <= 1, snapshot
            assert sum(s[1] != "Serving" for s in snapshot.values()) <= 1, snapshot
        assert any(sum(moving(s, "v2") for s in snap.values()) == 1 for snap in snapshots), "the rollout was seen"
        final = replicas(cluster, namespace)
        assert len(final) == 3
        for name, r in final.items():
            assert (r["spec"]["version"], r["status"]["version"], r["status"].get("loadingVersion")) == (
                "v2",
                "v2",
                None,
            )
            assert read_back(r["status"]["ranks"][0], name) == sha(v2), f"{name} serves v2's bytes"
        assert sha(v1) != sha(v2)
    finally:
        for a in agents.values():
            a.stop()


def test_parallel_keeps_the_old_version_serving_until_the_new_one_is(cluster, s3, namespace, operator, tmp_path, kube):
    v1, v2 = publish_v1_v2(cluster, s3, namespace)
    agents = start_nodes(cluster, s3, namespace, tmp_path, 3)
    frozen = False

    def describe() -> str:
        states = {n: r.get("status") for n, r in replicas(cluster, namespace).items()}
        return json.dumps([ml_status(cluster, namespace), states], indent=1) + "".join(
            a.log_tail(10) for a in agents.values()
        )

    try:
        transfer = {"timeoutSeconds": 6, "stallSeconds": 2}
        apply(cluster, namespace, ml_body(namespace, "v1", 3, transfer=transfer, rollout={"strategy": "Parallel"}))
        wait_for(lambda: ml_status(cluster, namespace).get("ready") == "3/3", 120, "3/3 on v1", describe)
        watcher = ReplicaWatch(kube, namespace)
        os.kill(s3.process.proc.pid, signal.SIGSTOP)  # frozen: sockets open, nothing answers; v2 cannot load
        frozen = True
        set_desired(cluster, namespace, "v2")

        # Every replica moves at once, and loads v2 next to v1, which it still serves.
        wait_for(
            lambda: all(
                r["spec"]["version"] == "v2" and r["status"].get("loadingVersion") == "v2"
                for r in replicas(cluster, namespace).values()
            ),
            60,
            "all three load v2",
            describe,
        )
        # Loading v2 fails (S3 frozen): the replica says so and still serves v1.
        failed = wait_for(
            lambda: next(
                (r for r in replicas(cluster, namespace).values() if r["status"].get("reason") == "LoadFailed"), None
            ),
            90,
            "a failed load of v2",
            describe,
        )
        status = failed["status"]
        assert (status["phase"], status["version"], status["loadingVersion"]) == ("Serving", "v1", "v2"), status
        wait_for(
            lambda: condition({"status": ml_status(cluster, namespace)}, "Degraded").get("reason") == "ReplicaFailed",
            30,
            "Degraded=ReplicaFailed",
            describe,
        )

        # Mid-rollout, v1 is still a peer source: a replica of v1 on a fourth node (a reader assigned v1, which
        # cannot read S3 either) copies it from them, and reads of what each moving replica serves give v1.
        reader_node = f"{namespace}-reader"
        node(cluster, reader_node, {})
        agents[reader_node] = start_agent(cluster, tmp_path, reader_node, s3=s3, retry_seconds=1)
        replica(cluster, namespace, "reader", reader_node, "v1")
        reader = wait_for(
            lambda: (
                (r := get(cluster, namespace, "wr", "reader"))
                and (r.get("status") or {}).get("phase") == "Serving"
                and r
            ),
            90,
            "the reader serves v1",
            describe,
        )
        assert reader["status"]["source"].removeprefix("peer/") in replicas(cluster, namespace), reader["status"]
        assert read_back(reader["status"]["ranks"][0], "reader") == sha(v1)
        for name, r in replicas(cluster, namespace).items():
            assert r["status"]["phase"] == "Serving" and r["status"]["version"] == "v1", r["status"]
            assert read_back(r["status"]["ranks"][0], name, reader_node) == sha(v1), f"{name} still serves v1"

        os.kill(s3.process.proc.pid, signal.SIGCONT)
        frozen = False
        wait_for(
            lambda: (s := ml_status(cluster, namespace)).get("ready") == "3/3" and s.get("loadedVersion") == "v2",
            180,
            "3/3 on v2",
            describe,
        )
        snapshots = watcher.stop()

        for name, r in replicas(cluster, namespace).items():
            assert (r["status"]["version"], r["status"].get("loadingVersion"), r["status"].get("reason")) == (
                "v2",
                None,
                None,
            )
            assert read_back(r["status"]["ranks"][0], name) == sha(v2), f"{name} serves v2's bytes"
        # Never a replica that served nothing once it had served: Serving throughout, v1 until v2.
        for name in replicas(cluster, namespace):
            seen = [snap[name] for snap in snapshots if name in snap]
            assert all(s[1] == "Serving" for s in seen), [s for s in seen if s[1] != "Serving"][:3]
            served = [s[2] for s in seen]
            assert served[0] == "v1" and served[-1] == "v2" and served == sorted(served), "v1 until v2, never back"
    finally:
        if frozen:
            os.kill(s3.process.proc.pid, signal.SIGCONT)
        for a in agents.values():
            a.stop()


def test_every_replica_applies_a_small_delta_to_the_version_it_holds(cluster, s3, namespace, operator, tmp_path):
    """3 replicas serve v1 (one read S3, the others copied it from a peer, so their stores lack it); v2 changes one
    tensor of eight. Every replica replays v2's delta from S3 on the v1 it holds in host memory (the newest of the
    chain it holds, by uid), none copies the whole of v2 from a peer, and all serve v2's bytes."""
    v1 = tensors(711, n=8, shape=(128, 128))
    changed = "layer3.weight"
    v2 = {**v1, changed: v1[changed] + 1}
    publish_full(s3, namespace, "v1", v1)
    publish_delta(s3, namespace, "v2", "v1", v1, v2)
    apply(cluster, namespace, wv_body(namespace, "v1"), wv_body(namespace, "v2", base="v1"))
    for version in ("v1", "v2"):
        wait_reason(cluster, namespace, version, "Ready", "True", "Verified")
    agents = start_nodes(cluster, s3, namespace, tmp_path, 3)

    def describe() -> str:
        states = {n: r.get("status") for n, r in replicas(cluster, namespace).items()}
        logs = "".join(a.log_tail(15) for a in agents.values())
        return json.dumps([ml_status(cluster, namespace), states], indent=1) + logs

    try:
        apply(cluster, namespace, ml_body(namespace, "v1", 3, transfer={"timeoutSeconds": 30}))
        wait_for(lambda: ml_status(cluster, namespace).get("ready") == "3/3", 120, "3/3 on v1", describe)
        on_v1 = {name: r["status"]["source"] for name, r in replicas(cluster, namespace).items()}
        assert any(source.startswith("peer/") for source in on_v1.values()), on_v1  # a store without v1

        set_desired(cluster, namespace, "v2")
        wait_for(
            lambda: (s := ml_status(cluster, namespace)).get("ready") == "3/3" and s.get("loadedVersion") == "v2",
            180,
            "3/3 on v2",
            describe,
        )
        for name, r in replicas(cluster, namespace).items():
            status = r["status"]
            tried = [a["source"] for a in status["attempts"] if a["outcome"] != "Skipped"]
            assert (status["version"], status["source"], tried) == ("v2", "s3", ["ObjectStorage"]), describe()
            assert read_back(status["ranks"][0], name) == sha(v2), f"{name} serves v2's bytes"
        for agent in agents.values():  # each replayed on the v1 in its host memory, not on a store copy
            log = agent.log_path.read_text(errors="replace")
            assert "come from object storage before peers" in log and "from held/v1" in log, describe()
    finally:
        for a in agents.values():
            a.stop()
