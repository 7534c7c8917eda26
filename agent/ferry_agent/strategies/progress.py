"""Load progress: the `Progress` callback every strategy reports (bytes done, bytes total, the source waited on)
and the throttle that keeps those reports, which become status writes, to about one per interval."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

Progress = Callable[[int, int, str], None]  # (bytes_done, bytes_total, source label)


class ProgressThrottle:
    """Forwards at most one report per interval, but always the first one, a completion, and any report that
    changes the total (a transfer whose size just became known) or, with `source_is_news`, the source (a new
    candidate); a report identical to the last one forwarded is dropped. A load that reads many sources at once
    (chunk by chunk from peers) passes `source_is_news=False`: its status writes must not scale with chunks."""

    def __init__(
        self,
        callback: Progress | None,
        interval_s: float,
        clock: Callable[[], float] = time.monotonic,
        *,
        source_is_news: bool = True,
    ):
        self._callback = callback
        self._interval_s = interval_s
        self._clock = clock
        self._source_is_news = source_is_news
        self._last: float | None = None
        self._sent: tuple[int, int, str] | None = None
        self._lock = threading.Lock()  # reports come from several threads (a peer load's checks)

    def __call__(self, done: int, total: int, source: str) -> None:
        if self._callback is None:
            return
        with self._lock:  # the decision only: a callback writes status and must not hold up the other reporters
            if self._sent == (done, total, source):
                return
            now = self._clock()
            if self._last is not None and self._sent is not None and done < total:
                _, sent_total, sent_source = self._sent
                same = total == sent_total and (source == sent_source or not self._source_is_news)
                if same and now - self._last < self._interval_s:
                    return
            self._last, self._sent = now, (done, total, source)
        try:
            self._callback(done, total, source)
        except Exception as exc:  # a status writer must not break a transfer
            log.warning("progress callback failed: %s", exc)
