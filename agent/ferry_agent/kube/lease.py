"""The replica Leases an agent holds: taken when a replica serves, renewed every third of their duration from a thread
each (recreated when deleted, taken over from an older agent's unlabelled one), deleted when it stops serving.

A Lease is a served replica's heartbeat: peers and the operator count a replica as a source, and ready, only while its
Lease is live and labelled with its node (`ferry.api.liveness`). The chart's admission policy lets an agent write only
Leases labelled with its own node.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from ferry.api.conditions import now_rfc3339
from ferry_agent.kube.apiretry import Backoff, describe
from ferry_agent.kube.registry import LABEL_NODE, lease_body, lease_name

log = logging.getLogger("ferry.agent")


@dataclass
class Renewal:
    """A Lease this agent renews: `stop` ends the renewals; `lock` keeps a renewal and the deletion apart."""

    stop: threading.Event
    lock: threading.Lock


class ReplicaLeases:
    """The Leases `ferry-wr-<replica>` of the replicas this agent (`holder`, on `node`) serves, by (namespace, name)."""

    def __init__(self, leases: client.CoordinationV1Api, *, holder: str, node: str, lease_seconds: int) -> None:
        self._leases = leases
        self.holder = holder
        self.node = node
        self.lease_seconds = lease_seconds
        self._renewing: dict[tuple[str, str], Renewal] = {}  # replicas whose Lease this agent renews

    def held(self, key: tuple[str, str]) -> bool:
        return key in self._renewing

    def hold(self, key: tuple[str, str]) -> None:
        """Take the replica's Lease (this agent holds it from now on) and keep renewing it until `release`."""
        renewal = self._renewing.get(key)
        if renewal is None:  # else kept across a version change: already renewed
            renewal = self._renewing[key] = Renewal(threading.Event(), threading.Lock())
            threading.Thread(target=self._renew, args=(key, renewal), daemon=True).start()
        try:
            with renewal.lock:
                self.write(key, acquire=True)
        except Exception as exc:
            log.warning("taking the Lease of %s/%s failed (%s); the renewals retry", *key, describe(exc))

    def write(self, key: tuple[str, str], *, acquire: bool) -> None:
        namespace, name = key
        now = now_rfc3339(micro=True)
        body = lease_body(name, self.holder, now, self.lease_seconds, node=self.node)
        # Acquiring takes over a Lease left by an earlier agent (or kept across a version change) as it is: a
        # replace would need its resourceVersion.
        spec = body["spec"] if acquire else {"renewTime": now, "holderIdentity": self.holder}
        try:
            patch = {"metadata": {"labels": body["metadata"]["labels"]}, "spec": spec} if acquire else {"spec": spec}
            self._leases.patch_namespaced_lease(lease_name(name), namespace, patch)
            return
        except ApiException as exc:
            # Refused by the admission policy (403, or 422 for an Invalid reason): the Lease may be an older agent's,
            # without the node label, which no agent may update but one may delete. Anything else is raised, and a
            # Lease of another node is left to the operator (it deletes it; the next renewal then creates ours).
            if exc.status in (403, 422):
                if not self._delete_unlabelled(namespace, name):
                    raise
                log.warning(
                    "the Lease of %s/%s had no %s label (an older agent's); replaced it", namespace, name, LABEL_NODE
                )
            elif exc.status != 404:
                raise
            elif not acquire:
                log.warning("the Lease of %s/%s was gone; recreated it", namespace, name)
        # None yet, deleted (by hand, by the operator, by the lines above) while this agent still serves the replica.
        self._leases.create_namespaced_lease(namespace, body)

    def _delete_unlabelled(self, namespace: str, name: str) -> bool:
        """Delete the replica's Lease if it has no node label (that version of it only); True when it is gone."""
        try:
            lease = self._leases.read_namespaced_lease(lease_name(name), namespace)
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        if LABEL_NODE in (lease.metadata.labels or {}):
            return False
        options = client.V1DeleteOptions(
            preconditions=client.V1Preconditions(resource_version=lease.metadata.resource_version)
        )
        try:
            self._leases.delete_namespaced_lease(lease_name(name), namespace, body=options)
        except ApiException as exc:
            if exc.status != 404:  # 409: changed since it was read; the next renewal looks again
                raise
        return True

    def release(self, key: tuple[str, str]) -> None:
        renewal = self._renewing.pop(key, None)
        if renewal is None:
            return
        renewal.stop.set()
        namespace, name = key
        with renewal.lock:  # after any renewal in flight, which could otherwise recreate it
            try:
                self._leases.delete_namespaced_lease(lease_name(name), namespace)
            except Exception as exc:
                if not (isinstance(exc, ApiException) and exc.status == 404):
                    log.warning("deleting the Lease of %s/%s failed (%s); it expires", namespace, name, describe(exc))

    def _renew(self, key: tuple[str, str], renewal: Renewal) -> None:
        """Every third of the lease duration; after a failure sooner (backoff capped at that third), so a Lease
        that expired while the apiserver was away is live again as soon as it answers."""
        period = self.lease_seconds / 3
        backoff = Backoff(initial=min(0.5, period), cap=period)
        delay = period
        while not renewal.stop.wait(delay):
            try:
                with renewal.lock:
                    if renewal.stop.is_set():
                        return
                    self.write(key, acquire=False)
                backoff.reset()
                delay = period
            except Exception as exc:
                delay = backoff.next()
                log.warning("lease renewal for %s/%s failed (%s); again in %.1fs", *key, describe(exc), delay)
