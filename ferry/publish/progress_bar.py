"""The upload's progress line on stderr."""

from __future__ import annotations

import threading
import time
from typing import TextIO


class ProgressBar:
    """One stderr line, redrawn in place: bytes done of total and the rate. Thread-safe."""

    def __init__(self, label: str, total: int, stream: TextIO | None) -> None:
        self.label, self.total, self.stream = label, total, stream
        self.done = 0
        self.started = time.monotonic()
        self._drawn = 0.0
        self._lock = threading.Lock()

    def add(self, n: int) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now - self._drawn >= 0.1 or self.done >= self.total:
                self._drawn = now
                self._draw(now)

    def _draw(self, now: float) -> None:
        if self.stream is None:
            return
        rate = self.done / max(now - self.started, 1e-6) / 1e6
        pct = 100 * self.done // self.total if self.total else 100
        line = f"{self.label}: {self.done / 1e6:.2f}/{self.total / 1e6:.2f} MB ({pct}%) {rate:.1f} MB/s"
        self.stream.write(f"\r{line:<78}")
        self.stream.flush()

    def close(self) -> None:
        if self.stream is not None:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()
