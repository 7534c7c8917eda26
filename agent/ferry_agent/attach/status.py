"""Who is attached, in each WeightReplica's status: `status.attachments` (pod, version, rank, since) and
`status.attachedPods` (distinct pods), from the attach server's leases.

A lease taken or let go (attach, release, a refit's make-before-break, a socket the kernel closed) only wakes a
thread of its own, which waits a moment so a burst is one write, and hands the replicas whose consumers changed to
the agent's status outbox: the attach socket never waits on the apiserver, and what an outage keeps from being
written is written when it answers (`kube.apiretry.StatusOutbox`). The agent's resync also compares what each replica's
object says with the leases (`publish(observed=...)`), so an entry left by an earlier agent process, whose
consumers' sockets closed with it, is cleared.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

from ferry.api.models import MAX_ATTACHMENTS
from ferry_agent.attach.server import AttachServer

log = logging.getLogger("ferry.agent.attach")

Key = tuple[str, str]  # a WeightReplica: (namespace, name)


def attachment_status(entries: list[dict[str, Any]], pods: int | None = None) -> dict[str, Any]:
    """The status fields for a replica's attachment entries (`pods`: their distinct pods, counted unless given).
    The list is cut at what the CRD admits (a patch the apiserver refuses would hold every later status write of
    the replica); the count is of all."""
    count = len({e["podUid"] for e in entries}) if pods is None else pods
    return {"attachments": list(entries[:MAX_ATTACHMENTS]), "attachedPods": count}


NONE = attachment_status([])


class AttachmentPublisher:
    def __init__(
        self, server: AttachServer, patch: Callable[[Key, dict[str, Any]], None], *, settle_s: float = 0.2
    ) -> None:
        self._server = server
        self._patch = patch
        self._settle_s = settle_s
        self._published: dict[Key, list[dict[str, Any]]] = {}  # what was last handed to `patch`, per replica
        self._lock = threading.Lock()  # one computation and its patches at a time: a stale one never wins
        self._changed = threading.Event()
        self._stopping = threading.Event()
        server.on_leases_changed(self._changed.set)

    def start(self) -> None:
        threading.Thread(target=self._run, name="ferry-attach-status", daemon=True).start()

    def stop(self) -> None:
        self._stopping.set()
        self._changed.set()

    def _run(self) -> None:
        while True:
            self._changed.wait()
            if self._stopping.wait(self._settle_s):
                return
            self._changed.clear()
            try:
                self.publish()
            except Exception:  # the outbox keeps what the apiserver refuses; this is a bug, and the resync retries
                log.exception("publishing attachments failed")

    def publish(self, observed: Mapping[Key, Mapping[str, Any] | None] | None = None) -> None:
        """Patch every replica whose attachments differ from what was last patched; with `observed` (replica ->
        its status as listed, for replicas with no status write pending), also every one of those whose object
        says otherwise."""
        with self._lock:
            now = {key: attachment_status(entries) for key, entries in self._server.attachments().items()}
            recorded = dict(self._published)
            for key, status in (observed or {}).items():
                status = status or {}
                recorded[key] = attachment_status(status.get("attachments") or [], status.get("attachedPods") or 0)
            for key in set(now) | set(recorded):
                wanted = now.get(key, NONE)
                if recorded.get(key, NONE) != wanted:
                    self._patch(key, wanted)
                if wanted == NONE:
                    self._published.pop(key, None)  # nothing attached and nothing to undo: forget the replica
                else:
                    self._published[key] = wanted
