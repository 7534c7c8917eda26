"""The operator's kopf indexes (one watch per kind; registered by importing this module, main.py does), and
`Indexes`, the one value through which handlers and woken reconciles read them. WeightVersions are not kopf's:
their index is the operator's own (versionwatch.py), filled before kopf starts any watch.

kopf fills every index before it runs any handler, keeps them current on every watch event, and passes the same
index objects to every handler, startup included: `Indexes` is built once, at startup. The indexers are `async`
although they never await: kopf runs a sync one in its thread pool (a thread hop and a shielded task per index per
event, most of an event's cost at thousands of objects), an async one inline on the loop.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

import kopf

from ferry.api.models import GROUP, InvalidObject, WeightReplica
from ferry.chain import VersionView
from ferry_operator.indexkeys import named
from ferry_operator.kubeapi import ML, WR
from ferry_operator.versions import attachment_blockers


@kopf.index(*ML)
async def desired_index(namespace: str, name: str, spec: kopf.Spec, meta: kopf.Meta, **_: Any) -> dict | None:
    if meta.get("deletionTimestamp"):
        return None
    return {(namespace, spec.get("desiredVersion")): name}


@kopf.index(*WR)
async def lease_index(namespace: str, name: str, spec: kopf.Spec, status: kopf.Status, **_: Any) -> dict:
    # {} rather than None when the reads end: None would keep the replica's previous entry (a blocker for good).
    if not status.get("activeLeases"):
        return {}
    # The readers hold the served version, which during a version change is not yet spec.version.
    return {(namespace, status.get("version") or spec.get("version")): name}


@kopf.index(*WR)
async def attach_index(namespace: str, body: kopf.Body, **_: Any) -> dict:
    """(namespace, version) -> the consumer pods a replica holds it for (`attachment_blockers`). Empty, never None,
    once they are gone: kopf keeps an object's previous entries when its handler returns None."""
    try:
        replica = WeightReplica.from_body(body)
    except InvalidObject:
        return {}
    return {(namespace, version): names for version, names in attachment_blockers(replica).items()}


# Replicas and Leases are kept as dict snapshots, not parsed: a ModelLoad reconcile reads a few keys of each of
# its replicas, and parsing hundreds of them per reconcile (or on each of their frequent progress events) costs more.
def snapshot(body: Mapping[str, Any]) -> dict:
    return copy.deepcopy(dict(body))


def node_view(name: str, body: kopf.Body) -> dict:
    return {"metadata": {"name": name, "labels": dict(body.metadata.labels)}, "spec": dict(body.spec)}


@kopf.index("", "v1", "nodes")
async def node_index(name: str, body: kopf.Body, **_: Any) -> dict:
    return {name: node_view(name, body)}


@kopf.index(*WR)
async def replica_index(
    namespace: str, name: str, spec: kopf.Spec, status: kopf.Status, body: kopf.Body, **_: Any
) -> dict:
    """By (namespace, ModelLoad); also by name (a Lease's replica) and by the version it reports (holders)."""
    shot = snapshot(body)
    keys = {(namespace, spec.get("modelLoad")): shot, ("replica", namespace, name): shot}
    if status.get("version"):
        keys[("serving", namespace, status["version"])] = shot
    return keys


@kopf.index("coordination.k8s.io", "v1", "leases", labels={f"{GROUP}/replica": kopf.PRESENT})
async def replica_lease_index(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict:
    return {(namespace, name): snapshot(body)}


@dataclass(frozen=True)
class Indexes:
    versions: Mapping[tuple, Collection[VersionView]]  # keyed by `indexkeys`: versionwatch.VersionIndex
    desired: kopf.Index[tuple[str, str], str]  # (namespace, version) -> the ModelLoads desiring it
    leases: kopf.Index[tuple[str, str], str]  # (namespace, version) -> replicas with readers holding it
    attachments: kopf.Index[tuple[str, str], tuple[str, ...]]  # (namespace, version) -> `attachment_blockers`
    nodes: kopf.Index[str, dict]  # node name -> `node_view`
    replicas: kopf.Index[tuple, dict]  # see `replica_index`
    replica_leases: kopf.Index[tuple[str, str], dict]  # (namespace, Lease name) -> the Lease
    retention_loads: kopf.Index[tuple[str, str], Any]  # (namespace, model) -> `LoadFacts` (handlers/retention.py)
    retention_holds: kopf.Index[tuple[str, str], Any]  # (namespace, model) -> versions each replica holds

    @classmethod
    def of(cls, kwargs: Mapping[str, Any], versions: Mapping[tuple, Collection[VersionView]]) -> Indexes:
        """From a handler's kwargs, where kopf passes each index under its function's name, and the operator's own
        index of WeightVersions (versionwatch.py)."""
        return cls(
            versions=versions,
            desired=kwargs["desired_index"],
            leases=kwargs["lease_index"],
            attachments=kwargs["attach_index"],
            nodes=kwargs["node_index"],
            replicas=kwargs["replica_index"],
            replica_leases=kwargs["replica_lease_index"],
            retention_loads=kwargs["retention_load_index"],
            retention_holds=kwargs["retention_hold_index"],
        )

    def version_lookup(self, namespace: str) -> Callable[[str], VersionView | None]:
        """A version by name in `namespace`, for chain resolution."""

        def lookup(name: str) -> VersionView | None:
            store = self.versions.get(named(namespace, name))
            return next(iter(store), None) if store else None

        return lookup

    def all_nodes(self) -> list[dict]:
        return [n for store in self.nodes.values() for n in store]

    def all_modelloads(self) -> set[tuple[str, str]]:
        """(namespace, name) of every ModelLoad not being deleted."""
        return {(ns, load) for (ns, _), store in self.desired.items() for load in store}
