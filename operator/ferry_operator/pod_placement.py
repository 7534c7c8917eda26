"""Weights follow pods (ModelLoad `spec.podSelector`) and warm-node labels; handlers registered by importing this
module (main.py does).

The pods: one list-then-watch per namespace that has a ModelLoad with a podSelector, in a thread of its own (the
blocking client), so only the tenant namespaces Ferry serves are read (RBAC grants pods list/watch there alone,
docs/security.md). A pod change that moves the set of nodes a ModelLoad follows wakes that ModelLoad (in process),
whose reconcile reads the pods from memory (`pod_nodes`), never from the API.

Warm nodes: every node where a ModelLoad's replica is Serving carries `warm_node_label(namespace, modelload)` set to
the version, so engine pods may prefer it (docs/consumers.md); the reconcile sets and removes it (`sync_warm_labels`),
a deleted ModelLoad's label is removed from every node, and a node event removes labels of ModelLoads that no
longer exist (deleted while the operator was down).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import kopf
from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from ferry.api.models import WARM_LABEL_PREFIX, EventAction, ModelLoadEventReason, warm_node_label
from ferry.kube import kube_client
from ferry_operator import kubeapi
from ferry_operator.events import EVENTS
from ferry_operator.kubeapi import ML
from ferry_operator.modelloads import PodFacts, followed_nodes, selector_matches, warm_label_changes
from ferry_operator.wakeups import WAKEUPS

log = logging.getLogger("ferry.operator.pods")

WATCH_SECONDS = 300
REQUEST_TIMEOUT_S = (5.0, 30.0)  # (connect, read): a frozen apiserver must not hang the thread
RETRY_CAP_S = 30.0


class NamespacePods:
    """The pods of one namespace as `PodFacts`: listed, then watched; on any failure listed again after a backoff.
    `on_change(before, after)` runs in the watch thread for every pod whose facts changed (None: absent), and
    `on_change(None, None)` after each list."""

    def __init__(self, namespace: str, on_change: Callable[[PodFacts | None, PodFacts | None], None]) -> None:
        self.namespace = namespace
        self._on_change = on_change
        self._pods: dict[str, PodFacts] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self.synced = False

    def start(self) -> NamespacePods:
        threading.Thread(target=self._run, name=f"ferry-pods-{self.namespace}", daemon=True).start()
        return self

    def stop(self) -> None:
        self._stopping.set()

    def pods(self) -> list[PodFacts]:
        with self._lock:
            return list(self._pods.values())

    def _put(self, uid: str, facts: PodFacts | None) -> None:
        with self._lock:
            before = self._pods.pop(uid, None)
            if facts is not None:
                self._pods[uid] = facts
        if before != facts and not self._stopping.is_set():
            self._on_change(before, facts)

    def _replace(self, pods: dict[str, PodFacts]) -> None:
        """A fresh list: the view is synced from now on; every ModelLoad of the namespace may have moved."""
        with self._lock:
            self._pods = pods
        self.synced = True
        if not self._stopping.is_set():
            self._on_change(None, None)

    def _run(self) -> None:
        api = kube_client()  # its own connection: a watch holds one for minutes
        core = client.CoreV1Api(api)
        failures = 0
        while not self._stopping.is_set():
            try:
                listed = core.list_namespaced_pod(self.namespace, _request_timeout=REQUEST_TIMEOUT_S)
                self._replace({p.metadata.uid: _facts(api, p) for p in listed.items})
                failures = 0
                for event in watch.Watch().stream(
                    core.list_namespaced_pod,
                    self.namespace,
                    resource_version=listed.metadata.resource_version,
                    timeout_seconds=WATCH_SECONDS,
                    _request_timeout=(REQUEST_TIMEOUT_S[0], WATCH_SECONDS + 30),
                ):
                    if self._stopping.is_set():
                        return
                    obj = event["object"]
                    gone = event["type"] == "DELETED"
                    self._put(obj.metadata.uid, None if gone else _facts(api, obj))
            except Exception as exc:  # what is known stays; the next list catches up
                delay = min(RETRY_CAP_S, 0.5 * 2**failures)
                failures += 1
                log.warning("watching the pods of %s failed (%r); again in %.1fs", self.namespace, exc, delay)
                self._stopping.wait(delay)


def _facts(api: client.ApiClient, pod: client.V1Pod) -> PodFacts:
    return PodFacts.from_body(api.sanitize_for_serialization(pod))


# namespace -> its pods; (namespace, ModelLoad) -> its podSelector, and the nodes it was last woken for.
_namespaces: dict[str, NamespacePods] = {}
_selectors: dict[tuple[str, str], Mapping[str, Any]] = {}
_woken: dict[tuple[str, str], frozenset[str]] = {}
_lock = threading.Lock()


def _changed(namespace: str, before: PodFacts | None, after: PodFacts | None) -> None:
    """In a watch thread: wake each ModelLoad whose followed nodes this pod change (or a fresh list: both None)
    moves."""
    relisted = before is None and after is None
    with _lock:
        selectors = [(key, sel) for key, sel in _selectors.items() if key[0] == namespace]
        pods = _namespaces.get(namespace)
    for key, selector in selectors:
        involved = any(p is not None and p.node and selector_matches(selector, p.labels) for p in (before, after))
        if not (relisted or involved):
            continue
        nodes = frozenset(followed_nodes(selector, pods.pods() if pods else []))
        if _woken.get(key) == nodes:
            continue
        _woken[key] = nodes
        WAKEUPS.wake_threadsafe(ML[2], namespace, key[1])


def pod_nodes(namespace: str, name: str, selector: Mapping[str, Any] | None) -> set[str] | None:
    """The nodes where pods that the ModelLoad follows are bound: empty without a podSelector; None while its
    namespace's pods have not been listed yet (the first call starts watching them)."""
    key = (namespace, name)
    with _lock:
        if selector is None:
            _forget(key)
            return set()
        _selectors[key] = dict(selector)
        pods = _namespaces.get(namespace)
        if pods is None:
            pods = _namespaces[namespace] = NamespacePods(namespace, lambda b, a: _changed(namespace, b, a)).start()
    if not pods.synced:
        return None
    return followed_nodes(selector, pods.pods())


def _forget(key: tuple[str, str]) -> None:
    """Stop following pods for a ModelLoad (and watching its namespace, when it was the last one); under _lock."""
    _selectors.pop(key, None)
    _woken.pop(key, None)
    if not any(ns == key[0] for ns, _ in _selectors) and (pods := _namespaces.pop(key[0], None)):
        pods.stop()


# ---------------------------------------------------------------- held replicas, warm labels


def announce_held(body: Mapping[str, Any], held: Iterable[str], announced: set[str]) -> None:
    """One Event per replica that placement no longer wants but an attached consumer keeps; `announced` (in the
    ModelLoad's memo) holds the replicas announced so far."""
    now = set(held)
    for name in sorted(now - announced):
        message = f"{name} stays while a consumer pod is attached to it"
        EVENTS.post(
            body,
            reason=ModelLoadEventReason.REPLICA_HELD_BY_CONSUMERS,
            message=message,
            action=EventAction.DELETE_REPLICA,
        )
    announced.intersection_update(now)
    announced.update(now)


async def sync_warm_labels(
    namespace: str,
    name: str,
    replicas: Iterable[Mapping[str, Any]],
    nodes: Iterable[Mapping[str, Any]],
    stale: Iterable[str],
) -> None:
    """Set and remove the ModelLoad's warm-node label where it differs. A refusal (e.g. a chart older than the
    operator, without `patch nodes`) is logged and leaves placement and status alone."""
    key = warm_node_label(namespace, name)
    for node, value in warm_label_changes(key, replicas, nodes, stale).items():
        try:
            await asyncio.to_thread(kubeapi.label_node, node, key, value)
        except ApiException as exc:
            log.warning(
                "could not %s label %s on node %s: %s %s",
                "set" if value else "remove",
                key,
                node,
                exc.status,
                exc.reason,
            )


@kopf.on.event(*ML)
async def forget_deleted_modelload(event: dict, namespace: str, name: str, memo: kopf.Memo, **_: Any) -> None:
    """A deleted ModelLoad follows no pods, and no node is warm for it any more."""
    if event.get("type") != "DELETED":
        return
    with _lock:
        _forget((namespace, name))
    await sync_warm_labels(namespace, name, [], memo.indexes.all_nodes(), [])


@kopf.on.event("", "v1", "nodes")
async def drop_orphaned_warm_labels(name: str, labels: kopf.Labels, memo: kopf.Memo, **_: Any) -> None:
    """A warm-node label of no ModelLoad that exists (one deleted while the operator was down) is removed. kopf
    runs handlers only once its indexes are filled, so every existing ModelLoad is in the desired index."""
    warm = [key for key in labels if key.startswith(WARM_LABEL_PREFIX)]
    if not warm:
        return
    live = {warm_node_label(ns, ml) for ns, ml in memo.indexes.all_modelloads()}
    for key in warm:
        if key not in live:
            log.info("node %s: removing %s, the label of no ModelLoad", name, key)
            try:
                await asyncio.to_thread(kubeapi.label_node, name, key, None)
            except ApiException as exc:
                log.warning("could not remove label %s of node %s: %s %s", key, name, exc.status, exc.reason)
