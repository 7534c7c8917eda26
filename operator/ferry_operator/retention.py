"""Retention: which WeightVersions a namespace's ModelLoad policies retire (docs/retention.md).

Pure: the kopf handlers feed in what their indexes hold about the namespace's WeightVersions, ModelLoads and
WeightReplicas and delete what comes out; the release finalizer then applies as for any deletion.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ferry.api.models import API_VERSION, GROUP, MAX_CHAIN_LENGTH
from ferry.chain import VersionView

# Set by the operator on a version it retires: who retired it, and whether its objects go with it at release.
RETIRED_BY_ANNOTATION = f"{GROUP}/retired-by"
DELETE_STORAGE_ANNOTATION = f"{GROUP}/delete-storage"


@dataclass(frozen=True)
class LoadFacts:
    name: str
    uid: str
    model: str
    desired: str
    keep_last: int | None  # None: no retention policy
    delete_storage: bool

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> LoadFacts:
        metadata, spec = body.get("metadata") or {}, body.get("spec") or {}
        retention = spec.get("retention") or {}
        return cls(
            name=metadata.get("name", ""),
            uid=metadata.get("uid", ""),
            model=spec.get("modelName", ""),
            desired=spec.get("desiredVersion", ""),
            keep_last=retention.get("keepLast"),
            delete_storage=bool(retention.get("deleteStorage")),
        )

    def reference(self, namespace: str) -> dict[str, Any]:
        """Enough of the object for an Event about it."""
        return {
            "apiVersion": API_VERSION,
            "kind": "ModelLoad",
            "metadata": {"name": self.name, "namespace": namespace, "uid": self.uid},
        }


def held_versions(replica: Mapping[str, Any]) -> frozenset[str]:
    """Versions a WeightReplica holds or is about to: the one it is assigned, the one it last reported (a
    retargeted replica serves the old bytes until the new ones are in), and those its consumer pods are attached to
    (an engine that has not refit yet)."""
    status = replica.get("status") or {}
    attached = [a.get("version") for a in status.get("attachments") or []]
    names = ((replica.get("spec") or {}).get("version"), status.get("version"), *attached)
    return frozenset(n for n in names if n)


@dataclass(frozen=True)
class Policy:
    keep_last: int
    delete_storage: bool
    owner: str  # the ModelLoad whose keepLast decides (its Events name the deletions)


@dataclass(frozen=True)
class Retirement:
    version: str
    uid: str
    model: str
    owner: str
    keep_last: int
    delete_storage: bool

    @property
    def message(self) -> str:
        storage = "its objects are deleted at release" if self.delete_storage else "its objects are kept"
        return (
            f"deleted WeightVersion {self.version}: older than the newest {self.keep_last} Ready versions of "
            f"model {self.model}, and nothing desires, holds or replays from it; {storage}"
        )


def model_policies(loads: Iterable[LoadFacts]) -> dict[str, Policy]:
    """One policy per model: the most conservative of its ModelLoads' (largest keepLast; storage deleted only if
    every policy says so). ModelLoads without `retention` take no part."""
    by_model: dict[str, list[LoadFacts]] = {}
    for load in loads:
        if load.keep_last is not None:
            by_model.setdefault(load.model, []).append(load)
    policies = {}
    for model, group in by_model.items():
        keep = max(load.keep_last or 0 for load in group)
        owner = min(load.name for load in group if load.keep_last == keep)
        policies[model] = Policy(keep, all(load.delete_storage for load in group), owner)
    return policies


def _natural(name: str) -> tuple:
    """v2 < v10, step-9 < step-10."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name))


def newest_first(versions: Iterable[VersionView]) -> list[VersionView]:
    """By creation (publish order is training order: a slow verification does not make a version newer), then
    readiness, then name, since timestamps have one-second resolution."""
    return sorted(versions, key=lambda v: (v.created, v.ready_time, _natural(v.name)), reverse=True)


def _ancestors(names: Iterable[str], by_name: Mapping[str, VersionView]) -> set[str]:
    """Every version the given ones replay from (their transitive bases), bounded like a chain."""
    found: set[str] = set()
    for name in names:
        current = by_name.get(name)
        for _ in range(MAX_CHAIN_LENGTH):
            if current is None or current.base_version is None or current.base_version in found:
                break
            found.add(current.base_version)
            current = by_name.get(current.base_version)
    return found


def plan_retirements(
    versions: Iterable[VersionView], loads: Iterable[LoadFacts], held: Iterable[str]
) -> list[Retirement]:
    """The versions to delete now, newest first: for each model with a policy, Ready versions older than its
    newest `keepLast` Ready ones that are not desired by any ModelLoad (of any model), not held by any replica,
    and not in the chain of any version that stays (kept, desired, held, not Ready yet, another model's)."""
    loads = list(loads)
    policies = model_policies(loads)
    if not policies:
        return []
    live = [v for v in versions if not v.deleting]
    by_name = {v.name: v for v in live}
    protected = {load.desired for load in loads} | set(held)
    candidates: dict[str, tuple[VersionView, Policy]] = {}
    for model, policy in policies.items():
        ready = newest_first(v for v in live if v.model_name == model and v.ready)
        for version in ready[policy.keep_last :]:
            if version.name not in protected:
                candidates[version.name] = (version, policy)
    staying = by_name.keys() - candidates.keys()
    needed = _ancestors(staying, by_name)
    retire = newest_first(v for name, (v, _) in candidates.items() if name not in needed)
    return [
        Retirement(v.name, v.uid, v.model_name, p.owner, p.keep_last, p.delete_storage)
        for v in retire
        for p in [candidates[v.name][1]]
    ]
