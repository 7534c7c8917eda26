"""Load progress: the `Progress` callback every strategy reports (bytes done, bytes total, the source waited on)
and the throttle that keeps those reports, which become status writes, to about one per interval."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

Progress = Callable[[int, int, str], None]  # (bytes_done, bytes_total, source label)


class ProgressThrottle:
    """Forwards at most one report per interval, but always the first one, a completion, and any report that
    changes the source or the total (a new candidate, or a transfer whose size just became known)."""

    def __init__(self, callback: Progress | None, interval_s: float, clock: Callable[[], float] = time.monotonic):
        self._callback = callback
        self._interval_s = interval_s
        self._clock = clock
        self._last: float | None = None
        self._shape: tuple[int, str] | None = None

    def __call__(self, done: int, total: int, source: str) -> None:
        if self._callback is None:
            return
        now = self._clock()
        shape = (total, source)
        if self._last is not None and done < total and shape == self._shape and now - self._last < self._interval_s:
            return
        self._last, self._shape = now, shape
        try:
            self._callback(done, total, source)
        except Exception as exc:  # a status writer must not break a transfer
            log.warning("progress callback failed: %s", exc)
