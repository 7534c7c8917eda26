"""kopf handlers of retention (docs/retention.md), registered by importing this module (main.py does).

The policy runs whenever something it depends on changes: a WeightVersion (one became Ready, one went away), a
ModelLoad (its policy or desired version), a WeightReplica (a reader let go of a version). No timer: nothing here
depends on the passage of time. Deletions go through the API, so the release finalizer holds them as usual.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import kopf
from kubernetes.client.exceptions import ApiException

from ferry.api.models import RetentionReason
from ferry.s3 import credentials_from_secret_data, parse_s3_uri
from ferry.storage import DeletionReport, delete_checkpoint
from ferry_operator import kubeapi
from ferry_operator.config import CONFIG
from ferry_operator.indexes import Indexes
from ferry_operator.indexkeys import in_folder, in_namespace
from ferry_operator.kubeapi import ML, WR, WV
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

log = logging.getLogger("ferry.operator.retention")

_locks: dict[str, asyncio.Lock] = {}
_queued: set[str] = set()  # namespaces with a policy run waiting for the lock: later requests join it
# uids this process deleted: the index shows their deletionTimestamp only once the watch delivers it.
_retired: set[str] = set()
_refused: dict[str, float] = {}  # uid -> monotonic time of the last refused delete
_storage_tries: dict[str, int] = {}  # uid -> failed storage deletions at release


@kopf.index(*ML)
async def retention_load_index(namespace: str, body: kopf.Body, meta: kopf.Meta, **_: Any) -> dict | None:
    if meta.get("deletionTimestamp"):
        return None
    return {namespace: LoadFacts.from_body(body)}


@kopf.index(*WR)
async def retention_hold_index(namespace: str, body: kopf.Body, **_: Any) -> dict:
    return {namespace: held_versions(body)}


async def _apply_policy(namespace: str, indexes: Indexes) -> None:
    """Coalesced per namespace: a burst of events (10,000 versions published at once) costs a few runs, since a
    run reads the indexes as they are when it starts and a request made before then is served by it."""
    versions, loads, holds = indexes.versions, indexes.retention_loads, indexes.retention_holds
    load_facts = list(loads.get(namespace, []))
    if not any(load.keep_last is not None for load in load_facts) or namespace in _queued:
        return  # no policy here (nothing to walk), or a run that has not started yet will see this change
    _queued.add(namespace)
    async with _locks.setdefault(namespace, asyncio.Lock()):
        _queued.discard(namespace)
        load_facts = list(loads.get(namespace, []))
        facts = [
            v if v.uid not in _retired else dataclasses.replace(v, deleting=True)
            for v in versions.get(in_namespace(namespace), [])
        ]
        held = {name for names in holds.get(namespace, []) for name in names}
        owners = {load.name: load for load in load_facts}
        for retirement in plan_retirements(facts, load_facts, held):
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
                    kopf.warn(owner, reason=RetentionReason.RETIREMENT_FAILED, message=message)
                log.warning("%s/%s: %s", namespace, retirement.owner, message)
                _refused[retirement.uid] = time.monotonic()
                continue
            _retired.add(retirement.uid)
            _refused.pop(retirement.uid, None)
            if done:
                log.info("%s/%s retired by ModelLoad %s", namespace, retirement.version, retirement.owner)
                kopf.info(owner, reason=RetentionReason.VERSION_RETIRED, message=retirement.message)


@kopf.on.event(*WV)
async def retention_on_version(event: dict, namespace: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    if event.get("type") == "DELETED":
        uid = body["metadata"].get("uid")
        _retired.discard(uid)
        _refused.pop(uid, None)
        _storage_tries.pop(uid, None)
    await _apply_policy(namespace, memo.indexes)


@kopf.on.event(*ML)
async def retention_on_modelload(namespace: str, memo: kopf.Memo, **_: Any) -> None:
    await _apply_policy(namespace, memo.indexes)


@kopf.on.event(*WR)
async def retention_on_replica(namespace: str, memo: kopf.Memo, **_: Any) -> None:
    await _apply_policy(namespace, memo.indexes)


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


async def release_storage(namespace: str, name: str, body: kopf.Body, version_index: kopf.Index) -> None:
    """Called by the release handler once nothing blocks the release: delete the objects of a version marked
    `ferry.dev/delete-storage`. A transient failure is retried a few times (TemporaryError); after that, or on
    any other failure, the release goes ahead with a Warning naming what was left."""
    if (body["metadata"].get("annotations") or {}).get(DELETE_STORAGE_ANNOTATION) != "true":
        return
    storage = dict(body["spec"].get("storage") or {})
    if not storage.get("uri"):
        return
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
        kopf.info(body, reason=RetentionReason.STORAGE_DELETED, message=report.message)
        return
    tries = _storage_tries[uid] = _storage_tries.get(uid, 0) + 1
    if report.transient and tries < STORAGE_DELETE_TRIES:  # the outcome, not each try, is the Event
        log.warning("%s/%s: %s Retrying.", namespace, name, report.message)
        raise kopf.TemporaryError(report.message, delay=CONFIG.release_retry_seconds)
    _storage_tries.pop(uid, None)
    kopf.warn(body, reason=RetentionReason.STORAGE_NOT_DELETED, message=f"{report.message} Released without them.")
