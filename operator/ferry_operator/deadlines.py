"""One in-process scheduler for everything whose trigger is the passage of time (a Lease that is not renewed, a
load that stops progressing, a verification backoff running out), so that there is no timer per object: a single
task sleeps until the earliest deadline. Setting a key's deadline again replaces the earlier one."""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import time
from collections.abc import Awaitable, Callable, Hashable

log = logging.getLogger("ferry.operator.deadlines")

Callback = Callable[[], Awaitable[None]]
RETRY_SECONDS = 2.0  # a callback that raised is tried again after this long


class Deadlines:
    def __init__(self) -> None:
        self._due: dict[Hashable, tuple[float, Callback]] = {}
        self._heap: list[tuple[float, int, Hashable]] = []  # stale entries are skipped when popped
        self._counter = 0
        self._wakeup: asyncio.Event | None = None
        self._running: set[asyncio.Task] = set()  # fired callbacks, referenced until done

    def __len__(self) -> int:
        return len(self._due)

    def at(self, key: Hashable, when: float, callback: Callback) -> None:
        """Run `callback` at monotonic time `when`, instead of whatever `key` was due for before."""
        self._due[key] = (when, callback)
        self._counter += 1
        heapq.heappush(self._heap, (when, self._counter, key))
        if self._wakeup is not None and self._heap[0][2] == key:
            self._wakeup.set()

    def after(self, key: Hashable, seconds: float, callback: Callback) -> None:
        self.at(key, time.monotonic() + max(0.0, seconds), callback)

    def cancel(self, key: Hashable) -> None:
        self._due.pop(key, None)

    def due(self, now: float) -> list[tuple[Hashable, Callback]]:
        """Pop what is due at `now`."""
        fired = []
        while self._heap and self._heap[0][0] <= now:
            when, _, key = heapq.heappop(self._heap)
            entry = self._due.get(key)
            if entry is not None and entry[0] == when:
                del self._due[key]
                fired.append((key, entry[1]))
        # Drop superseded entries from the top so the next sleep is for a live deadline.
        while self._heap and self._due.get(self._heap[0][2], (None,))[0] != self._heap[0][0]:
            heapq.heappop(self._heap)
        return fired

    async def run(self) -> None:
        self._wakeup = asyncio.Event()
        while True:
            for key, callback in self.due(time.monotonic()):
                task = asyncio.create_task(self._fire(key, callback))
                self._running.add(task)
                task.add_done_callback(self._running.discard)
            delay = self._heap[0][0] - time.monotonic() if self._heap else None
            self._wakeup.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wakeup.wait(), timeout=delay)

    async def _fire(self, key: Hashable, callback: Callback) -> None:
        try:
            await callback()
        except Exception as exc:
            log.warning("deadline %s failed (%s); retrying in %.0fs", key, exc, RETRY_SECONDS)
            if key not in self._due:
                self.after(key, RETRY_SECONDS, callback)


DEADLINES = Deadlines()
