"""The WeightReplicas of one node, as its agent sees them: the watch that wakes the agent, the list it reconciles, and
their `/status`, written through a `StatusOutbox` so that nothing the apiserver does not take now is lost.

The agent writes only the status of the replicas assigned to its node (`spec.nodeName`, label `ferry.dev/node`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from kubernetes import client, watch

from ferry.api.models import GROUP, VERSION
from ferry_agent.kube.apiretry import REQUEST_TIMEOUT_S, Backoff, StatusOutbox, describe
from ferry_agent.kube.registry import LABEL_NODE
from ferry_agent.kube.sources import PLURAL

log = logging.getLogger("ferry.agent")

Key = tuple[str, str]  # (namespace, name)


class NodeReplicas:
    """The WeightReplicas assigned to `node`: listed, watched, and their status patched (in order, kept through an
    outage)."""

    def __init__(self, objects: client.CustomObjectsApi, node: str) -> None:
        self._objects = objects
        self.node = node
        self.outbox = StatusOutbox(self._write_status)

    def watch(self, wake: threading.Event, stopping: threading.Event) -> None:
        """Set `wake` on any change to this node's WeightReplicas, until `stopping`. Each (re)started watch lists
        first, so the loop also wakes when the apiserver is back after an outage."""
        backoff = Backoff()
        while not stopping.is_set():
            try:
                for _event in watch.Watch().stream(
                    self._objects.list_cluster_custom_object,
                    GROUP,
                    VERSION,
                    PLURAL,
                    label_selector=f"{LABEL_NODE}={self.node}",
                    timeout_seconds=300,
                    _request_timeout=(REQUEST_TIMEOUT_S[0], 330),
                ):
                    backoff.reset()
                    wake.set()
                    if stopping.is_set():
                        return
            except Exception as exc:  # a dropped watch (410 Gone included) only delays us to the next resync
                delay = backoff.next()
                log.debug("watch ended (%s); again in %.1fs", describe(exc), delay)
                stopping.wait(delay)

    def assigned(self) -> dict[Key, dict[str, Any]]:
        """The replicas of this node that are not being deleted, by (namespace, name)."""
        listed = self._objects.list_cluster_custom_object(
            GROUP, VERSION, PLURAL, label_selector=f"{LABEL_NODE}={self.node}"
        )
        return {
            (wr["metadata"]["namespace"], wr["metadata"]["name"]): wr
            for wr in listed["items"]
            if wr["spec"]["nodeName"] == self.node and not wr["metadata"].get("deletionTimestamp")
        }

    def patch_status(self, key: Key, status: dict[str, Any]) -> None:
        """Never raises: what the apiserver does not take now is written by a later pass (in order)."""
        self.outbox.patch(key, status)

    def stage_status(self, key: Key, status: dict[str, Any]) -> None:
        """Written with the next `patch_status` of `key` (or `write_staged`, or the next reconcile's flush), not on
        its own."""
        self.outbox.stage(key, status)

    def write_staged(self, key: Key) -> None:
        """Write what is staged for `key`, if anything. Never raises, like `patch_status`."""
        self.outbox.flush(key)

    def pending(self, key: Key) -> bool:
        """A status patch of `key` is not written yet: its object does not say what the agent last published."""
        return self.outbox.pending(key)

    def _write_status(self, key: Key, status: dict[str, Any]) -> None:
        namespace, name = key
        self._objects.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name, {"status": status})
