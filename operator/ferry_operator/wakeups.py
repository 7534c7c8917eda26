"""Re-running an object's reconcile in process when something it is derived from changes.

kopf runs an object's handlers only on that object's own watch events, and offers no way to have another object
handled now. The ModelLoads desiring a version, the deltas based on it, the ModelLoad of a replica, Lease or
followed pod, and a version whose verification backoff ran out are woken here instead: nothing is written onto the
objects to make kopf look at them. A woken object's reconcile reads the object fresh from the API (the event that
woke it says nothing of it) and runs under the same per-object lock as its own handler, so the two never
interleave; wakes that arrive while it runs coalesce into one more run.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import kopf

from ferry_operator.deadlines import DEADLINES

log = logging.getLogger("ferry.operator.wakeups")

Key = tuple[str, str, str]  # (plural, namespace, name)
# Reconciles a woken object: (namespace, name, its memo).
Reconcile = Callable[[str, str, kopf.Memo], Awaitable[None]]
RETRY_SECONDS = 2.0  # a woken reconcile that raised (an apiserver restart) runs again after this long


class Wakeups:
    def __init__(self) -> None:
        self._reconcilers: dict[str, Reconcile] = {}
        self._memos: dict[Key, kopf.Memo] = {}  # objects kopf has handled, and not seen deleted
        self._again: set[Key] = set()  # woken while running: one more run
        self._running: dict[Key, asyncio.Task] = {}
        self._loop: asyncio.AbstractEventLoop | None = None

    def register(self, plural: str, reconcile: Reconcile) -> None:
        self._reconcilers[plural] = reconcile

    def seen(self, plural: str, namespace: str, name: str, memo: kopf.Memo) -> None:
        """Called by the object's own handler on each event: from now on it can be woken."""
        self._memos[(plural, namespace, name)] = memo
        self._loop = asyncio.get_running_loop()

    def forget(self, plural: str, namespace: str, name: str) -> None:
        """The object is deleted: nothing of it stays (kopf drops its memo as well)."""
        key = (plural, namespace, name)
        self._memos.pop(key, None)
        self._again.discard(key)
        DEADLINES.cancel(("wake", *key))

    def wake(self, plural: str, namespace: str, name: str) -> None:
        """Reconcile the object soon; on the event loop. An object kopf has not handled yet is left alone: its
        first event reconciles it with everything known by then."""
        key = (plural, namespace, name)
        if key not in self._memos or plural not in self._reconcilers:
            return
        if key in self._running:
            self._again.add(key)
            return
        self._running[key] = asyncio.get_running_loop().create_task(self._run(key))

    def later(self, plural: str, namespace: str, name: str, seconds: float) -> None:
        """`wake` after `seconds`, instead of any later wake set for the object before."""
        key = (plural, namespace, name)
        DEADLINES.after(("wake", *key), seconds, self._later(key))

    def wake_threadsafe(self, plural: str, namespace: str, name: str) -> None:
        """`wake` from another thread (a pod watch)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.wake, plural, namespace, name)

    def lock(self, memo: kopf.Memo) -> asyncio.Lock:
        """The object's own lock, held by its handler and by its woken runs alike."""
        if "lock" not in memo:
            memo["lock"] = asyncio.Lock()
        return memo["lock"]

    async def _run(self, key: Key) -> None:
        try:
            while key in self._memos:
                self._again.discard(key)
                try:
                    await self._reconcilers[key[0]](key[1], key[2], self._memos[key])
                except Exception as exc:
                    log.warning("reconcile of %s %s/%s failed (%r); again in %.0fs", *key, exc, RETRY_SECONDS)
                    self.later(*key, RETRY_SECONDS)
                    return
                if key not in self._again:
                    return
        finally:
            self._running.pop(key, None)

    def _later(self, key: Key) -> Callable[[], Awaitable[None]]:
        async def wake() -> None:
            self.wake(*key)

        return wake


WAKEUPS = Wakeups()
