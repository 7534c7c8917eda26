"""The operator's own list and watch of every WeightVersion, in place of kopf's: the one version index and a work
queue of their events.

kopf's per-event machinery (a worker per object, its handler bookkeeping, its indexes' thread hops) cost about as
much CPU per WeightVersion event as the apiserver spent on it, and a burst of thousands of new versions is two or
three events each. Here an event costs a JSON parse, an index update and, when the object's own reconcile runs,
what that does: kopf keeps no state for WeightVersions at all (no handler or index of it names them).

- `VersionIndex`: every WeightVersion's `VersionView`, keyed as `indexkeys` says (the same questions, one lookup
  each); `Indexes.versions` is this object, the one source of truth for chains, dependents, retention and folders.
- `VersionWatch`: lists every WeightVersion (pages of `LIST_PAGE`), then watches from the list's resourceVersion
  with bookmarks; a watch that ends is resumed where it stopped, one the apiserver can no longer resume (410 Gone)
  is replaced by a new list, whose differences become events (a version gone meanwhile is DELETED). Each event
  updates the index at once and queues the object's key; `WORKERS` tasks take the keys and hand each object's
  events to the handler in order, one object at a time, so a burst of events of one object coalesces into its
  latest body (a deletion is never folded away).
- Leadership: the list, and so the index, happens in kopf's startup after the leader Lease is held (main.py); the
  workers start (`begin`) only once kopf has filled its own indexes, which a release or retention decision reads.
"""

from __future__ import annotations

import asyncio
import copy
import logging
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

import aiohttp
import kopf
from kubernetes.client.exceptions import ApiException

from ferry.api.models import InvalidObject
from ferry.chain import VersionView
from ferry_operator.config import CONFIG
from ferry_operator.indexkeys import version_keys
from ferry_operator.kubeaio import API, custom_path
from ferry_operator.kubeapi import WV

log = logging.getLogger("ferry.operator.versionwatch")

LIST_PAGE = 500
WORKERS = 64  # objects handled at once; their verifications and writes are bounded further down
WATCH_BACKOFF = (0.5, 1.0, 2.0, 4.0, 8.0, 15.0)  # between attempts to resume a broken watch

Key = tuple[str, str]  # (namespace, name)
# (event type: ADDED, MODIFIED, DELETED, or None for an object found by a list; the object; its memo)
Handler = Callable[[str | None, dict[str, Any], kopf.Memo], Awaitable[None]]


class VersionIndex(Mapping[tuple, tuple[VersionView, ...]]):
    """Key (`indexkeys`) -> the versions under it, as kopf's indexes answer: `index.get(key)` is None or a
    non-empty collection. A version whose spec does not validate is not in it: to the others it does not exist."""

    def __init__(self) -> None:
        self._by_key: dict[tuple, dict[Key, VersionView]] = {}
        self._keys_of: dict[Key, tuple[tuple, ...]] = {}

    def put(self, namespace: str, name: str, view: VersionView | None) -> None:
        """Index `view` as the version `namespace/name` (None: it is gone, or does not validate)."""
        obj = (namespace, name)
        for key in self._keys_of.pop(obj, ()):
            store = self._by_key.get(key)
            if store is not None:
                store.pop(obj, None)
                if not store:
                    del self._by_key[key]
        if view is None:
            return
        keys = version_keys(view)
        for key, value in keys.items():
            self._by_key.setdefault(key, {})[obj] = value
        self._keys_of[obj] = tuple(keys)

    def __getitem__(self, key: tuple) -> tuple[VersionView, ...]:
        return tuple(self._by_key[key].values())  # a copy: a caller may await while it iterates

    def __iter__(self) -> Iterator[tuple]:
        return iter(self._by_key)

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: object) -> bool:
        return key in self._by_key


def view_of(body: Mapping[str, Any]) -> VersionView | None:
    try:
        return VersionView.from_body(body)
    except InvalidObject:
        return None


class VersionWatch:
    def __init__(self, index: VersionIndex, handler: Handler, memo: kopf.Memo, *, workers: int = WORKERS) -> None:
        self.index = index
        self._handler = handler
        self._memo = memo  # the operator's: each version's memo starts as a copy, as kopf's do
        self._workers = workers
        self.memos: dict[Key, kopf.Memo] = {}
        self._known: dict[Key, dict[str, Any]] = {}  # every listed or watched object: what a DELETED needs
        self._pending: dict[Key, list[tuple[str | None, dict[str, Any]]]] = {}
        self._queue: asyncio.Queue[Key] = asyncio.Queue()
        self._queued: set[Key] = set()
        self._active: set[Key] = set()
        self._tasks: set[asyncio.Task] = set()
        self._started = False

    async def start(self) -> None:
        """List every version into the index and queue them; then watch. Returns once the index is complete (an
        apiserver that is away is tried again, as the watch would be)."""
        failures = 0
        while True:
            try:
                resource_version = await self._relist()
                break
            except (ApiException, aiohttp.ClientError, TimeoutError) as exc:
                failures = await self._backoff(failures, exc)
        self._spawn(self._watch(resource_version), "versionwatch")

    def begin(self) -> None:
        """Start handling the queued events (once kopf's own indexes are filled)."""
        if self._started:
            return
        self._started = True
        for i in range(self._workers):
            self._spawn(self._work(), f"versionwatch-{i}")

    def _spawn(self, coro: Any, name: str) -> None:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------ the list and the watch

    async def _relist(self) -> str:
        """A full list: each listed object is an event of type None, each known one missing from it DELETED."""
        seen: set[Key] = set()
        params = {"limit": str(LIST_PAGE)}
        while True:
            page = await API.request("GET", custom_path(WV[2]), params=params)
            for body in page.get("items") or []:
                body.setdefault("apiVersion", page.get("apiVersion"))
                body.setdefault("kind", "WeightVersion")
                meta = body["metadata"]
                seen.add((meta["namespace"], meta["name"]))
                self._event(None, body)
            cont = (page.get("metadata") or {}).get("continue")
            if not cont:
                resource_version = page["metadata"]["resourceVersion"]
                break
            params = {"limit": str(LIST_PAGE), "continue": cont}
        for key in [k for k in self._known if k not in seen]:
            self._event("DELETED", self._known[key])
        log.info("listed %d WeightVersions", len(seen))
        return resource_version

    async def _watch(self, resource_version: str) -> None:
        timeout = CONFIG.watch_timeout_seconds  # as kopf's watches
        failures = 0
        relist = False
        while True:
            try:
                if relist:
                    resource_version = await self._relist()
                    relist = False
                params = {
                    "watch": "1",
                    "allowWatchBookmarks": "true",
                    "resourceVersion": resource_version,
                    "timeoutSeconds": str(timeout),
                }
                async for event in API.stream(custom_path(WV[2]), params, timeout + 10):
                    kind, obj = event.get("type"), event.get("object") or {}
                    if kind == "ERROR":
                        raise ApiException(status=obj.get("code"), reason=obj.get("message"))
                    resource_version = obj["metadata"]["resourceVersion"]
                    if kind != "BOOKMARK":
                        self._event(kind, obj)
                    failures = 0
            except ApiException as exc:
                if exc.status == 410:
                    log.info("the WeightVersion watch expired (410 Gone); listing again")
                    relist = True
                else:
                    failures = await self._backoff(failures, exc)
            except (aiohttp.ClientError, TimeoutError) as exc:
                failures = await self._backoff(failures, exc)
            except Exception as exc:  # anything else must not end the watch for good: events may be lost, so list
                log.exception("the WeightVersion watch failed unexpectedly; listing again")
                failures = await self._backoff(failures, exc)
                relist = True

    async def _backoff(self, failures: int, exc: BaseException) -> int:
        delay = WATCH_BACKOFF[min(failures, len(WATCH_BACKOFF) - 1)]
        log.warning("listing or watching WeightVersions failed (%r); again in %.1fs", exc, delay)
        await asyncio.sleep(delay)
        return failures + 1

    def _event(self, kind: str | None, body: dict[str, Any]) -> None:
        meta = body["metadata"]
        key = (meta["namespace"], meta["name"])
        if kind == "DELETED":
            self._known.pop(key, None)
            self.index.put(*key, None)
        else:
            self._known[key] = _identity(body)
            self.index.put(*key, view_of(body))
        self._enqueue(key, (kind, body))

    # ------------------------------------------------------------------ the work queue

    def _enqueue(self, key: Key, item: tuple[str | None, dict[str, Any]]) -> None:
        items = self._pending.setdefault(key, [])
        if items and "DELETED" not in (items[-1][0], item[0]):
            items[-1] = item  # only the latest body of a live object matters
        else:
            items.append(item)
        if key not in self._queued and key not in self._active:
            self._queued.add(key)
            self._queue.put_nowait(key)

    async def _work(self) -> None:
        while True:
            key = await self._queue.get()
            self._queued.discard(key)
            self._active.add(key)
            try:
                while items := self._pending.pop(key, None):
                    for kind, body in items:
                        await self._handle(key, kind, body)
            finally:
                self._active.discard(key)

    async def _handle(self, key: Key, kind: str | None, body: dict[str, Any]) -> None:
        memo = self.memos.get(key)
        if memo is None:
            memo = self.memos[key] = copy.copy(self._memo)
        try:
            await self._handler(kind, body, memo)
        except Exception:
            log.exception("handling %s of WeightVersion %s/%s failed", kind or "the listing", *key)
        finally:
            if kind == "DELETED":
                self.memos.pop(key, None)


def _identity(body: Mapping[str, Any]) -> dict[str, Any]:
    """What a DELETED event found by a relist carries: the object's identity and the spec fields handlers read."""
    meta, spec = body["metadata"], body.get("spec") or {}
    return {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": {"namespace": meta["namespace"], "name": meta["name"], "uid": meta.get("uid")},
        "spec": {k: spec[k] for k in ("modelName", "baseVersion") if k in spec},
    }
