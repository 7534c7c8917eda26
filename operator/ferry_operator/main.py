"""kopf entry point: `kopf run --standalone -A -m ferry_operator.main` (or `python -m ferry_operator`).

Only the handlers live here: the decorated kopf ones, and `version_changed`, which the operator's own watch of
WeightVersions calls (versionwatch.py). Each takes the object and its memo (where `Indexes`, built once at startup,
sits), and hands off to `handlers/` or wakes the objects the change concerns (`wakeups`).
Everything is re-derived from the objects, so a restart at any point converges to the same status.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import logging
from typing import Any

import kopf

from ferry.api.liveness import DEFAULT_LEASE_SECONDS
from ferry.api.models import GROUP

# the indexes, pod_placement and handlers.retention imports register their handlers
from ferry_operator import indexes, kubeaio, leadership, logfilter, metrics, pod_placement  # noqa: F401
from ferry_operator.config import CONFIG
from ferry_operator.deadlines import DEADLINES
from ferry_operator.events import EVENTS
from ferry_operator.handlers import modelload, retention, weightversion
from ferry_operator.indexes import Indexes, node_view
from ferry_operator.kubeapi import ML, WR, WV
from ferry_operator.modelloads import fell_back, renewal_time, renewed_after_expiry
from ferry_operator.versionwatch import VersionIndex, VersionWatch
from ferry_operator.wakeups import RETRY_SECONDS, WAKEUPS

# kopf's own finalizer: no handler here needs one (the release finalizer is the operator's own, see
# handlers/weightversion.py), so kopf never adds it; kopf strips it wherever it finds it, hence another name.
KOPF_FINALIZER = f"{GROUP}/kopf"

log = logging.getLogger("ferry.operator")

_background: set[asyncio.Task] = set()


class NoDiffBase(kopf.DiffBaseStorage):
    """No diff base: every handler here is an event handler, which does not look at a diff.
    kopf's default would write a last-handled-configuration annotation at each creation and each annotation change,
    one more patch and event per object each time. Add a create/update handler and this must go."""

    def build(self, *, body: kopf.Body, extra_fields: Any = None) -> Any:
        return {}

    def fetch(self, *, body: kopf.Body) -> Any:
        return {}

    def store(self, *, body: kopf.Body, patch: kopf.Patch, essence: Any) -> None:
        pass


# Set by `configure` when FERRY_LEADER_ELECTION is on: several replicas, one active.
_leadership: leadership.Leadership | None = None
# Every WeightVersion, listed and watched by the operator itself (not kopf): set by `configure`.
_versions: VersionWatch | None = None


@kopf.on.startup()
async def configure(settings: kopf.OperatorSettings, memo: kopf.Memo, **kwargs: Any) -> None:
    global _leadership, _versions
    settings.persistence.finalizer = KOPF_FINALIZER
    settings.persistence.diffbase_storage = NoDiffBase()
    settings.watching.server_timeout = CONFIG.watch_timeout_seconds
    settings.watching.client_timeout = CONFIG.watch_timeout_seconds + 10
    settings.posting.enabled = False  # every Event is the operator's own (events.EVENTS), with its action
    settings.execution.max_workers = 8
    logfilter.install()
    # The operator memo is copied into each object's memo: what is set here, every handler sees.
    versions = VersionIndex()
    memo.indexes = Indexes.of(kwargs, versions)
    memo.stalled = set()  # (namespace, replica) its ModelLoad last found stalled
    WAKEUPS.register(WV[2], weightversion.reconcile_woken)
    WAKEUPS.register(ML[2], modelload.reconcile_woken)
    task = asyncio.get_running_loop().create_task(DEADLINES.run(), name="deadlines")
    _background.add(task)
    # Every other request rides out an apiserver restart of about two minutes: kopf ends the whole operator when a
    # watch's retries run out on a 5xx, which a starting apiserver answers for a while.
    settings.networking.error_backoffs = [0.5, 1, 2, 4, 8] + [15] * 7
    if CONFIG.metrics_port >= 0:
        port = metrics.serve(CONFIG.metrics_address, CONFIG.metrics_port)
        log.info("metrics on http://%s:%d/metrics", CONFIG.metrics_address, port)
    _leadership = leadership.from_env()
    if _leadership is not None:
        # Startup handlers run before kopf starts any watch: until this returns, the process is a standby.
        await _leadership.acquire()
    EVENTS.start(_leadership.config.identity if _leadership is not None else None)
    # Listed before kopf starts its watches, so that a ModelLoad's first reconcile sees every version.
    _versions = VersionWatch(versions, version_changed, memo)
    await _versions.start()


@kopf.on.event("", "v1", "namespaces")
async def indexes_filled(**_: Any) -> None:
    """kopf runs no handler before each of its indexes holds everything listed, and a namespace always exists
    (`default`): the first namespace event says the ModelLoad, replica and Lease indexes are complete, which a
    WeightVersion's release and retention read. Only then are the WeightVersions' events handled."""
    if _versions is not None:
        _versions.begin()


@kopf.on.cleanup()
async def step_down(**_: Any) -> None:
    """After the last handler: hand the Lease over now rather than let the standby wait for it to expire."""
    if _leadership is not None:
        await asyncio.to_thread(_leadership.release)
    await kubeaio.API.close()


# ---------------------------------------------------------------- WeightVersion


async def version_changed(kind: str | None, body: dict[str, Any], memo: kopf.Memo) -> None:
    """Each event of a WeightVersion (versionwatch.py; `kind` None: found by a list), in order per object. The index
    already shows it."""
    namespace, name = body["metadata"]["namespace"], body["metadata"]["name"]
    event = {"type": kind, "object": body}
    if kind == "MODIFIED" and _older_than_written(body, memo):
        return  # a write of ours is newer, and its own event follows with everything this one has
    if kind == "DELETED":
        weightversion.forget(namespace, name, body)
    else:
        WAKEUPS.seen(WV[2], namespace, name, memo)
        try:
            await weightversion.reconcile(namespace, name, memo, body, log)
        except Exception as exc:  # an apiserver restart: the event is not repeated, so wake it again
            log.warning("reconcile of %s/%s failed (%r); again in %.0fs", namespace, name, exc, RETRY_SECONDS)
            WAKEUPS.later(WV[2], namespace, name, RETRY_SECONDS)
    weightversion.wake_watchers(event, namespace, name, body, memo)
    weightversion.recheck_releases(namespace, memo.indexes)  # a delta gone frees its base
    await retention.retention_on_version(
        event=event, namespace=namespace, body=body, spec=body.get("spec") or {}, memo=memo
    )


def _older_than_written(body: dict[str, Any], memo: kopf.Memo) -> bool:
    """Whether the object is older than our last status write of it (the finalizer's event, say, when the status
    patch sent alongside came after it): reconciling it would write that status again. etcd's resourceVersions are
    integers in commit order; anything else is never taken as older."""
    written, seen = memo.get("written"), body["metadata"].get("resourceVersion")
    if written is None or not (str(written).isdigit() and str(seen).isdigit()):
        return False
    if int(seen) < int(written):
        return True
    del memo["written"]
    return False


# ---------------------------------------------------------------- ModelLoad and what wakes it


@kopf.on.event(*ML)
async def modelload_changed(event: dict, namespace: str, name: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    weightversion.recheck_releases(namespace, memo.indexes)  # it may have let go of a version being released
    if event.get("type") == "DELETED":
        modelload.forget(namespace, name)
        return
    WAKEUPS.seen(ML[2], namespace, name, memo)
    await modelload.reconcile(namespace, name, memo, body)


@kopf.on.event("coordination.k8s.io", "v1", "leases", labels={f"{GROUP}/replica": kopf.PRESENT})
async def replica_lease_changed(
    event: dict, namespace: str, name: str, body: kopf.Body, labels: kopf.Labels, memo: kopf.Memo, **_: Any
) -> None:
    """A replica's Lease that appears, goes away, or is renewed after it had expired: wake its ModelLoad now, so
    that a replica whose agent is back is live (and ready) within a lease period. Ordinary renewals change nothing
    but the Lease's expiry deadline: only a Lease that is not renewed in time wakes its ModelLoad."""
    kind = event.get("type")
    replica = labels.get(f"{GROUP}/replica")
    found = memo.indexes.replicas.get(("replica", namespace, replica), [])
    owner = next((r["spec"].get("modelLoad") for r in found), None)
    if kind == "DELETED":
        DEADLINES.cancel(("lease", namespace, name))
        changed = True
    else:
        previous = memo.get("renewed")
        renewed = memo["renewed"] = renewal_time(body)
        changed = kind == "ADDED" or renewed_after_expiry(previous, body)
        if renewed is not None and owner:
            duration = (body.get("spec") or {}).get("leaseDurationSeconds") or DEFAULT_LEASE_SECONDS
            expires = renewed + dt.timedelta(seconds=duration) - dt.datetime.now(dt.UTC)
            DEADLINES.after(
                ("lease", namespace, name),
                expires.total_seconds() + modelload.DEADLINE_MARGIN,
                modelload.wake_later(namespace, owner),
            )
    if changed and owner:
        WAKEUPS.wake(ML[2], namespace, owner)


def _attached_digest(status: kopf.Status) -> str:
    held = sorted(f"{e.get('podUid')}/{e.get('version')}" for e in status.get("attachments") or [])
    return hashlib.sha256("\n".join(held).encode()).hexdigest()[:12]


@kopf.on.event(*WR)
async def replica_changed(
    event: dict,
    namespace: str,
    name: str,
    body: kopf.Body,
    spec: kopf.Spec,
    status: kopf.Status,
    memo: kopf.Memo,
    **_: Any,
) -> None:
    """A replica changed what its ModelLoad's status is made of (phase, the version it serves or loads next to it,
    a failure, a fallback, who is attached) or went away: wake the ModelLoad now. Progress within a load changes
    nothing there."""
    weightversion.recheck_releases(namespace, memo.indexes)  # read leases or attachments may have let go
    key = (namespace, name)
    if event.get("type") == "DELETED":
        memo.stalled.discard(key)
    else:
        state = (
            status.get("phase"),
            status.get("version"),
            status.get("versionUid"),
            spec.get("version"),
            status.get("loadingVersion"),
            status.get("reason"),
            spec.get("nodeName"),
            fell_back(body),
            bool(body["metadata"].get("deletionTimestamp")),
            status.get("lastProgressTime") if key in memo.stalled else None,
            _attached_digest(status),
        )
        if memo.get("state") == state:
            return
        memo["state"] = state
    if spec.get("modelLoad"):
        WAKEUPS.wake(ML[2], namespace, spec["modelLoad"])


@kopf.on.event("", "v1", "nodes")
async def node_changed(event: dict, name: str, body: kopf.Body, memo: kopf.Memo, **_: Any) -> None:
    """A node that appears, goes, or changes labels or schedulability moves placements: wake every ModelLoad.
    Status heartbeats (most node events) change neither."""
    if event.get("type") != "DELETED":
        view, previous = node_view(name, body), memo.get("view")
        memo["view"] = view
        if previous == view or (previous is None and event.get("type") is None):
            return
    for namespace, load in memo.indexes.all_modelloads():
        WAKEUPS.wake(ML[2], namespace, load)
