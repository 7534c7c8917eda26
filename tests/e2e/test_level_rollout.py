"""Fast `desiredVersion` changes through the real parts (operator + agent processes, apiserver, SeaweedFS): the
operator acts only on the newest ModelLoad, so no WeightReplica's spec.version ever moves back to a version desired
earlier, the ModelLoad's observedGeneration never goes down, and every replica ends serving the last desired version.
Every change is counted from watches on the WeightReplicas and the ModelLoad.
"""

from __future__ import annotations

import threading

import pytest
from kubernetes import client, watch

from ferry.api.models import GROUP, VERSION
from tests.support.agents import node, start_agent
from tests.support.objects import apply, ml_body, ml_status, publish_full, tensors, wait_for, wait_reason, wv_body

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


class Changes:
    """Every (name, spec.version, observedGeneration) a watch on one plural of the namespace sees, in order."""

    def __init__(self, api: client.ApiClient, namespace: str, plural: str) -> None:
        self._objects, self._namespace, self._plural = client.CustomObjectsApi(api), namespace, plural
        self._stop = threading.Event()
        self.seen: list[tuple[str, str, int | None]] = []
        self.error: BaseException | None = None
        listed = self._objects.list_namespaced_custom_object(GROUP, VERSION, namespace, plural)
        for item in listed["items"]:
            self._record(item)
        self._version = listed["metadata"]["resourceVersion"]
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _record(self, item: dict) -> None:
        version = item["spec"].get("version") or item["spec"].get("desiredVersion")
        self.seen.append((item["metadata"]["name"], version, (item.get("status") or {}).get("observedGeneration")))

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                for event in watch.Watch().stream(
                    self._objects.list_namespaced_custom_object,
                    GROUP,
                    VERSION,
                    self._namespace,
                    self._plural,
                    resource_version=self._version,
                    timeout_seconds=2,
                ):
                    self._version = event["object"]["metadata"]["resourceVersion"]
                    if event["type"] != "DELETED":
                        self._record(event["object"])
        except BaseException as exc:  # a watch that broke has not seen every change
            self.error = exc

    def stop(self) -> list[tuple[str, str, int | None]]:
        self._stop.set()
        self._thread.join(10)
        assert self.error is None, f"the watch broke: {self.error!r}"
        return self.seen


def backward_moves(seen: list[tuple[str, str, int | None]], order: list[str]) -> list[tuple[str, str, str]]:
    """Each spec.version change to a version desired earlier than the one the replica had."""
    rank = {v: i for i, v in enumerate(order)}
    last: dict[str, str] = {}
    moves = []
    for name, version, _ in seen:
        before = last.get(name)
        if before is not None and version != before and rank[version] < rank[before]:
            moves.append((name, before, version))
        last[name] = version
    return moves


def generation_drops(seen: list[tuple[str, str, int | None]]) -> list[tuple[int, int]]:
    drops, highest = [], None
    for _, _, generation in seen:
        if generation is None:
            continue
        if highest is not None and generation < highest:
            drops.append((highest, generation))
        highest = generation if highest is None else max(highest, generation)
    return drops


@pytest.mark.parametrize(
    ("strategy", "changes"),
    [("Parallel", 25), ("Rolling", 25), ("Parallel", 100)],
)
def test_fast_desired_changes_never_move_a_replica_back(
    cluster, s3, namespace, operator, tmp_path, kube, strategy, changes
):
    order = [f"v{i:03d}" for i in range(changes + 1)]
    for i, version in enumerate(order):
        publish_full(s3, namespace, version, tensors(900 + i, n=1, shape=(8, 8)))
    apply(cluster, namespace, *(wv_body(namespace, v) for v in order))
    for version in order:
        wait_reason(cluster, namespace, version, "Ready", "True", "Verified")
    names = [f"{namespace}-n{i}" for i in range(3)]
    for n in names:
        node(cluster, n, {"ferry.dev/pool": namespace})
    agents = [start_agent(cluster, tmp_path, n, s3=s3, retry_seconds=1) for n in names]
    objects = client.CustomObjectsApi(kube)

    def describe() -> str:
        return str(ml_status(cluster, namespace)) + operator.process.log_tail(30)

    try:
        rollout = {"strategy": strategy, "maxUnavailable": 1} if strategy == "Rolling" else {"strategy": strategy}
        apply(cluster, namespace, ml_body(namespace, order[0], 3, transfer={"timeoutSeconds": 30}, rollout=rollout))
        wait_for(lambda: ml_status(cluster, namespace).get("ready") == "3/3", 120, "3/3 on the first", describe)
        replicas = Changes(kube, namespace, "weightreplicas")
        loads = Changes(kube, namespace, "modelloads")
        for version in order[1:]:  # as fast as the apiserver takes them
            objects.patch_namespaced_custom_object(
                GROUP, VERSION, namespace, "modelloads", "serve", {"spec": {"desiredVersion": version}}
            )
        last = order[-1]
        wait_for(
            lambda: (s := ml_status(cluster, namespace)).get("ready") == "3/3" and s.get("loadedVersion") == last,
            90,
            f"3/3 serving {last}",
            describe,
        )
        seen, load_seen = replicas.stop(), loads.stop()
        assert backward_moves(seen, order) == [], "a replica was moved back to an older version"
        assert generation_drops(load_seen) == [], "observedGeneration went down"
        final = {
            r["metadata"]["name"]: r
            for r in objects.list_namespaced_custom_object(GROUP, VERSION, namespace, "weightreplicas")["items"]
        }
        assert len(final) == 3
        for r in final.values():
            assert (r["spec"]["version"], r["status"]["phase"], r["status"]["version"]) == (last, "Serving", last)
        assert {v for _, v, _ in seen} - {order[0]}, "the watch saw the replicas move"
    finally:
        for a in agents:
            a.stop()
