"""Surviving an unreachable or failing Kubernetes API: which errors pass, capped exponential backoff, bounded
requests, and status patches kept until the apiserver takes them.

An agent holds weights that peers read without the API (worker service, NIXL, read leases), so an apiserver
outage must cost it nothing but delayed status: every call that talks to the API either retries (reads a load
needs), or is kept and written again later (`StatusOutbox`), or is retried by the caller's loop.
"""

from __future__ import annotations

import http.client
import logging
import random
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any, TypeVar

import urllib3.exceptions
from kubernetes.client.exceptions import ApiException

log = logging.getLogger(__name__)
T = TypeVar("T")

# Server-side trouble that passes: timeouts, throttling, an apiserver starting up or overloaded. A watch's 410
# (Gone: its resourceVersion was compacted) is answered by listing again, which every watch here does anyway.
TRANSIENT_STATUS = frozenset({408, 410, 429, 500, 502, 503, 504})
# Every request is bounded (connect, read): a frozen apiserver must not hang a thread forever.
REQUEST_TIMEOUT_S = (5.0, 30.0)
# How long a load waits for the API to answer a read it needs before it fails (and is retried like any failure).
READ_RETRY_S = 120.0


def is_transient(exc: BaseException) -> bool:
    """An error that a later try of the same request may not have: network, timeout, or a 408/429/5xx."""
    if isinstance(exc, ApiException):
        return not exc.status or exc.status in TRANSIENT_STATUS
    return isinstance(exc, urllib3.exceptions.HTTPError | http.client.HTTPException | OSError)


class Backoff:
    """Capped exponential delays with jitter: `initial`, times `factor` after each failure, at most `cap`;
    `reset()` after a success. The jitter (±`jitter` of the delay) keeps a fleet of agents from retrying in lockstep."""

    def __init__(self, initial: float = 0.5, cap: float = 10.0, factor: float = 2.0, jitter: float = 0.2) -> None:
        if not 0 < initial <= cap or factor < 1 or not 0 <= jitter < 1:
            raise ValueError(f"bad backoff: initial={initial} cap={cap} factor={factor} jitter={jitter}")
        self.initial, self.cap, self.factor, self.jitter = initial, cap, factor, jitter
        self.failures = 0

    def next(self) -> float:
        """The delay before the next try, after one more failure."""
        base = min(self.cap, self.initial * self.factor**self.failures)
        self.failures += 1
        return min(self.cap, base * (1 + random.uniform(-self.jitter, self.jitter)))

    def reset(self) -> None:
        self.failures = 0


def call_with_retry(
    fn: Callable[[], T],
    *,
    what: str,
    stop: threading.Event | None = None,
    retry_for_s: float = READ_RETRY_S,
    backoff: Backoff | None = None,
) -> T:
    """`fn()`, tried again with backoff while it fails transiently, for up to `retry_for_s` or until `stop` is set;
    then (and at once for any other error) its last error is raised."""
    stop = stop or threading.Event()
    backoff = backoff or Backoff()
    deadline = time.monotonic() + retry_for_s
    while True:
        try:
            return fn()
        except Exception as exc:
            delay = backoff.next()
            if not is_transient(exc) or stop.is_set() or time.monotonic() + delay > deadline:
                raise
            log.warning("%s failed (%s), retrying in %.1fs", what, describe(exc), delay)
            if stop.wait(delay):
                raise


def describe(exc: BaseException) -> str:
    """One line: an API error's status and reason, or the exception's type and (first line of) text."""
    if isinstance(exc, ApiException):
        return f"{exc.status} {exc.reason}"
    if isinstance(exc, urllib3.exceptions.MaxRetryError) and exc.reason is not None:
        exc = exc.reason  # the URL and pool details say nothing new
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def bound_requests(api: Any, timeout: tuple[float, float] = REQUEST_TIMEOUT_S) -> Any:
    """Give every request of this ApiClient a (connect, read) timeout unless it names its own (a watch does):
    the client's default is none at all. Returns `api`."""
    rest = api.rest_client
    request = rest.request

    def bounded(*args: Any, _request_timeout: Any = None, **kwargs: Any) -> Any:
        return request(*args, _request_timeout=_request_timeout or timeout, **kwargs)

    rest.request = bounded
    return api


K = TypeVar("K", bound=Hashable)


class StatusOutbox:
    """Status merge patches per object, written at once when the API answers and otherwise kept, merged in order,
    and written by `flush()` (with backoff per object) until it does. A patch is never dropped for an outage: a
    replica that loaded must say so, not be unloaded because its status could not be written. An object that is
    gone (404) needs no status; its patches are dropped."""

    def __init__(self, write: Callable[[K, dict[str, Any]], None], backoff: Callable[[], Backoff] = Backoff) -> None:
        self._write = write
        self._backoff = backoff
        self._pending: dict[K, dict[str, Any]] = {}
        self._retry: dict[K, tuple[Backoff, float]] = {}  # key -> (its backoff, monotonic time of the next try)
        self._lock = threading.Lock()

    def patch(self, key: K, status: dict[str, Any]) -> bool:
        """Queue `status` after what is pending for `key` and try to write it all now, unless backing off.
        True when everything for `key` is written."""
        with self._lock:
            # Status fields are scalars and lists (replaced whole by a merge patch), so later keys simply win.
            self._pending.setdefault(key, {}).update(status)
        return self._try(key)

    def stage(self, key: K, status: dict[str, Any]) -> None:
        """Queue `status` after what is pending for `key` without writing it: the next `patch` (or `flush`) of
        `key` writes it, merged with what follows, in one request."""
        with self._lock:
            self._pending.setdefault(key, {}).update(status)

    def flush(self, key: K | None = None) -> bool:
        """Try every pending object (or only `key`) whose backoff has passed. True when nothing of them is pending
        any more."""
        for k in list(self._pending) if key is None else [key]:
            self._try(k)
        return not self._pending if key is None else key not in self._pending

    def pending(self, key: K) -> bool:
        return key in self._pending

    def next_try_in(self) -> float | None:
        """Seconds until the next pending object may be tried (0: now); None when nothing is pending."""
        with self._lock:
            if not self._pending:
                return None
            now = time.monotonic()
            return max(0.0, min((self._retry[k][1] - now if k in self._retry else 0.0) for k in self._pending))

    def discard(self, key: K) -> None:
        with self._lock:
            self._pending.pop(key, None)
            self._retry.pop(key, None)

    def _try(self, key: K) -> bool:
        # One write at a time, under the lock: patches of one object must reach the apiserver in order.
        with self._lock:
            retry = self._retry.get(key)
            if retry is not None and time.monotonic() < retry[1]:
                return False
            body = self._pending.pop(key, None)
            if body is None:
                return True
            try:
                self._write(key, body)
            except Exception as exc:
                if isinstance(exc, ApiException) and exc.status == 404:
                    self._retry.pop(key, None)
                    return True
                self._pending[key] = body
                backoff = self._retry[key][0] if retry is not None else self._backoff()
                delay = backoff.next()
                self._retry[key] = (backoff, time.monotonic() + delay)
                level = logging.WARNING if is_transient(exc) else logging.ERROR
                log.log(level, "status of %s not written (%s); retrying in %.1fs", key, describe(exc), delay)
                return False
            self._retry.pop(key, None)
            return True
