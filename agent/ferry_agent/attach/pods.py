"""Which pods get an attach socket: every Pod bound to this node (`spec.nodeName`) that has not finished, as the
API says (a list, then a watch; on any failure a fresh list after a backoff)."""

from __future__ import annotations

import logging
import threading
from typing import Any

from kubernetes import client, watch

from ferry_agent.attach.server import AttachServer, Pod
from ferry_agent.kube.apiretry import REQUEST_TIMEOUT_S, Backoff, describe

log = logging.getLogger("ferry.agent.attach")

_FINISHED = ("Succeeded", "Failed")


def _pod(obj: Any) -> Pod | None:
    """The socket a Pod object calls for, or None when it has finished."""
    if (obj.status and obj.status.phase) in _FINISHED:
        return None
    account = (obj.spec.service_account_name if obj.spec else None) or ""
    return Pod(obj.metadata.uid, obj.metadata.namespace, obj.metadata.name, account)


class PodWatcher:
    def __init__(self, api: client.ApiClient, node: str, server: AttachServer) -> None:
        self._core = client.CoreV1Api(api)
        self._node = node
        self._server = server
        self._stopping = threading.Event()

    def start(self) -> None:
        threading.Thread(target=self._run, name="ferry-attach-pods", daemon=True).start()

    def stop(self) -> None:
        self._stopping.set()

    def _run(self) -> None:
        backoff = Backoff(cap=30.0)
        selector = f"spec.nodeName={self._node}"
        while not self._stopping.is_set():
            try:
                listed = self._core.list_pod_for_all_namespaces(field_selector=selector)
                self._server.sync_pods(pod for obj in listed.items if (pod := _pod(obj)) is not None)
                backoff.reset()
                for event in watch.Watch().stream(
                    self._core.list_pod_for_all_namespaces,
                    field_selector=selector,
                    resource_version=listed.metadata.resource_version,
                    timeout_seconds=300,
                    _request_timeout=(REQUEST_TIMEOUT_S[0], 330),
                ):
                    if self._stopping.is_set():
                        return
                    obj = event["object"]
                    pod = _pod(obj) if event["type"] != "DELETED" else None
                    if pod is None:
                        self._server.remove_pod(obj.metadata.uid)
                    else:
                        self._server.add_pod(pod)
            except Exception as exc:  # the sockets that exist keep serving; the next list catches up
                delay = backoff.next()
                log.warning("watching this node's pods failed (%s); again in %.1fs", describe(exc), delay)
                self._stopping.wait(delay)
