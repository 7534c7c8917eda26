"""kopf handlers of retention (docs/retention.md), registered by importing this module (main.py does).

The policy runs per (namespace, model) whenever something it depends on changes: a WeightVersion of the model (one
became Ready, one went away), a ModelLoad of it (its policy or desired version), a WeightReplica of it (a reader let
go of a version). A run reads only that model's versions, ModelLoads and replicas, each by key. No timer: nothing
here depends on the passage of time. Deletions go through the API, so the release finalizer holds them as usual.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Mapping
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from ferry.api.models import EventAction, RetentionReason
from ferry.chain import VersionView
from ferry.s3 import credentials_from_secret_data, parse_s3_uri
from ferry.storage import DeletionReport, delete_checkpoint
from ferry_operator import kubeapi
from ferry_operator.config import CONFIG
from ferry_operator.events import EVENTS
from ferry_operator.indexes import Indexes
from ferry_operator.indexkeys import dependents_of, in_folder, named, of_model
from ferry_operator.kubeapi import ML, WR
from ferry_operator.retention import (
    DELETE_STORAGE_ANNOTATION,
    RETIRED_BY_ANNOTATION,
    LoadFacts,
    held_versions,
    plan_retirements,
)
from ferry_operator.s3clients import client_for

REFUSED_RETRY_SECONDS = 60.0  # a refused delete (RBAC) is tried again after this long, at the next change
STORAGE_DELETE_TRIES = 3  # transient storage failures retried at release before it goes ahead without
STORAGE_RETRY_SECONDS = 2.0  # between those tries

log = logging.getLogger("ferry.operator.retention")

Scope = tuple[str, str]  # (namespace, model): a policy run sees only that model's versions, loads and replicas

_locks: dict[Scope, asyncio.Lock] = {}
_queued: set[Scope] = set()  # scopes with a policy run waiting for the lock: later requests join it
# uids this process deleted: the index shows their deletionTimestamp only once the watch delivers it.
_retired: set[str] = set()
_refused: dict[str, float] = {}  # uid -> monotonic time of the last refused delete
_storage_tries: dict[str, int] = {}  # uid -> failed storage deletions at release


@kopf.index(*ML)
async def retention_load_index(namespace: str, body: kopf.Body, meta: kopf.Meta, **_: Any) -> dict | None:
    if meta.get("deletionTimestamp"):
        return None
    facts = LoadFacts.from_body(body)
    return {(namespace, facts.model): facts}


@kopf.index(*WR)
async def retention_hold_index(namespace: str, body: kopf.Body, spec: kopf.Spec, **_: Any) -> dict:
    return {(namespace, spec.get("modelName", "")): held_versions(body)}


@dataclasses.dataclass(frozen=True)
class PolicyInputs:
    versions: list[VersionView]  # the model's, and the live versions of other models based on one of them
    loads: list[LoadFacts]  # the model's ModelLoads
    protected: set[str]  # held by a replica of the model, or desired by any ModelLoad


def policy_inputs(namespace: str, model: str, indexes: Indexes) -> PolicyInputs:
    """What one policy run reads: keyed lookups for the one model, never a walk over the namespace."""
    ours = [
        v if v.uid not in _retired else dataclasses.replace(v, deleting=True)
        for v in indexes.versions.get(of_model(namespace, model), [])
    ]
    names = {v.name for v in ours}
    # A delta of another model keeps its base (its release would be blocked by it anyway).
    foreign = [d for v in ours for d in dependents_of(indexes.versions, namespace, v.name) if d.model_name != model]
    held = {name for names_ in indexes.retention_holds.get((namespace, model), []) for name in names_}
    desired = {name for name in names if indexes.desired.get((namespace, name))}
    return PolicyInputs(ours + foreign, list(indexes.retention_loads.get((namespace, model), [])), held | desired)


async def _apply_policy(namespace: str, model: str, indexes: Indexes) -> None:
    """Coalesced per (namespace, model): a burst of events (10,000 versions published at once) costs a few runs,
    since a run reads the indexes as they are when it starts and a request made before then is served by it."""
    scope = (namespace, model)
    loads = indexes.retention_loads.get(scope, [])
    if not any(load.keep_last is not None for load in loads) or scope in _queued:
        return  # no policy for this model (nothing to walk), or a run that has not started yet will see this
    _queued.add(scope)
    async with _locks.setdefault(scope, asyncio.Lock()):
        _queued.discard(scope)
        inputs = policy_inputs(namespace, model, indexes)
        owners = {load.name: load for load in inputs.loads}
        for retirement in plan_retirements(inputs.versions, inputs.loads, inputs.protected):
            if time.monotonic() - _refused.get(retirement.uid, -REFUSED_RETRY_SECONDS) < REFUSED_RETRY_SECONDS:
                continue
            owner = owners[retirement.owner].reference(namespace)
            annotations = {RETIRED_BY_ANNOTATION: f"ModelLoad/{retirement.owner}"}
            if retirement.delete_storage:
                annotations[DELETE_STORAGE_ANNOTATION] = "true"
            try:
                done = await asyncio.to_thread(
                    kubeapi.retire_version, namespace, retirement.version, retirement.uid, annotations
                )
            except ApiException as exc:
                message = f"could not delete WeightVersion {retirement.version}: {exc.status} {exc.reason}"
                if retirement.uid not in _refused:  # one Warning per refused version, not one per retry
                    EVENTS.post(
                        owner,
                        reason=RetentionReason.RETIREMENT_FAILED,
                        message=message,
                        action=EventAction.RETIRE,
                        warning=True,
                    )
                log.warning("%s/%s: %s", namespace, retirement.owner, message)
                _refused[retirement.uid] = time.monotonic()
                continue
            _retired.add(retirement.uid)
            _refused.pop(retirement.uid, None)
            if done:
                log.info("%s/%s retired by ModelLoad %s", namespace, retirement.version, retirement.owner)
                EVENTS.post(
                    owner, reason=RetentionReason.VERSION_RETIRED, message=retirement.message, action=EventAction.RETIRE
                )


def _model_of(namespace: str, version: str | None, indexes: Indexes) -> str | None:
    found = indexes.versions.get(named(namespace, version)) if version else None
    return next(iter(found)).model_name if found else None


async def _apply_policies(namespace: str, models: set[str], memo: kopf.Memo, indexes: Indexes) -> None:
    """Run the policies of `models` and of those the object concerned at its previous event (what it let go of
    may be another model's)."""
    previous = memo.get("retention_models", set())
    memo["retention_models"] = models
    for model in sorted(models | previous):
        await _apply_policy(namespace, model, indexes)


async def retention_on_version(
    event: dict, namespace: str, body: Mapping[str, Any], spec: Mapping[str, Any], memo: kopf.Memo, **_: Any
) -> None:
    """Its model's policy, and that of its base's model: a delta of another model going frees its base. Called on
    each WeightVersion event by main.py (WeightVersions are watched by versionwatch.py, not kopf)."""
    if event.get("type") == "DELETED":
        uid = body["metadata"].get("uid")
        _retired.discard(uid)
        _refused.pop(uid, None)
        _storage_tries.pop(uid, None)
    await _apply_with(namespace, spec.get("modelName", ""), spec.get("baseVersion"), memo)


@kopf.on.event(*ML)
async def retention_on_modelload(namespace: str, spec: kopf.Spec, memo: kopf.Memo, **_: Any) -> None:
    """Its model's policy, and that of the model of the version it desires (protected whatever its model)."""
    await _apply_with(namespace, spec.get("modelName", ""), spec.get("desiredVersion"), memo)


async def _apply_with(namespace: str, model: str, related: str | None, memo: kopf.Memo) -> None:
    """The policies of `model` and of the model of version `related` (when it exists)."""
    indexes: Indexes = memo.indexes
    models = {model}
    if (other := _model_of(namespace, related, indexes)) is not None:
        models.add(other)
    await _apply_policies(namespace, models, memo, indexes)


@kopf.on.event(*WR)
async def retention_on_replica(namespace: str, spec: kopf.Spec, memo: kopf.Memo, **_: Any) -> None:
    await _apply_policies(namespace, {spec.get("modelName", "")}, memo, memo.indexes)


def _delete_objects(namespace: str, storage: dict, index_digest: str | None) -> DeletionReport:
    secret = storage.get("credentialsSecret")
    if not secret:
        # Never with the operator's own credentials: a tenant could aim a WeightVersion at any bucket they reach.
        return DeletionReport(ok=False, message="Not deleted: the version names no spec.storage.credentialsSecret.")
    try:
        credentials = credentials_from_secret_data(kubeapi.read_secret_data(namespace, secret))
    except kubeapi.NotFound:
        return DeletionReport(ok=False, message=f"Not deleted: Secret {secret} does not exist.", transient=True)
    except ValueError as exc:
        return DeletionReport(ok=False, message=f"Not deleted: Secret {secret}: {exc}.")
    client = client_for(storage.get("endpoint") or CONFIG.s3_endpoint, storage.get("region"), credentials)
    return delete_checkpoint(client, storage["uri"], index_digest=index_digest)


async def release_storage(namespace: str, name: str, body: kopf.Body, version_index: kopf.Index) -> bool:
    """Called by the release once nothing blocks it: delete the objects of a version marked
    `ferry.dev/delete-storage`. False: a transient failure, to be tried again in `STORAGE_RETRY_SECONDS` (a few
    times); after that, or on any other failure, the release goes ahead (True) with a Warning naming what was left."""
    if (body["metadata"].get("annotations") or {}).get(DELETE_STORAGE_ANNOTATION) != "true":
        return True
    storage = dict(body["spec"].get("storage") or {})
    if not storage.get("uri"):
        return True
    uid = body["metadata"]["uid"]
    bucket, key = parse_s3_uri(storage["uri"])
    folder = key.rpartition("/")[0]
    others = sorted(
        f"{v.namespace}/{v.name}"
        for v in version_index.get(in_folder(bucket, folder), [])
        if (v.namespace, v.name) != (namespace, name)
    )
    if others:
        report = DeletionReport(
            ok=False, message=f"Not deleted: s3://{bucket}/{folder}/ also holds {', '.join(others)}."
        )
    else:
        index_digest = (body.get("status") or {}).get("indexDigest")
        report = await asyncio.to_thread(_delete_objects, namespace, storage, index_digest)
    if report.ok:
        _storage_tries.pop(uid, None)
        EVENTS.post(
            body, reason=RetentionReason.STORAGE_DELETED, message=report.message, action=EventAction.DELETE_STORAGE
        )
        return True
    tries = _storage_tries[uid] = _storage_tries.get(uid, 0) + 1
    if report.transient and tries < STORAGE_DELETE_TRIES:  # the outcome, not each try, is the Event
        log.warning("%s/%s: %s Retrying in %.0fs.", namespace, name, report.message, STORAGE_RETRY_SECONDS)
        return False
    _storage_tries.pop(uid, None)
    EVENTS.post(
        body,
        reason=RetentionReason.STORAGE_NOT_DELETED,
        message=f"{report.message} Released without them.",
        action=EventAction.DELETE_STORAGE,
        warning=True,
    )
    return True
