"""A TCP relay in front of the test S3 that paces what S3 sends (bytes per second) and can hold it entirely: an
object store slow enough, and stoppable at a chosen moment or after a chosen number of data bytes, for tests of what
happens while a load is under way."""

from __future__ import annotations

import contextlib
import re
import socket
import threading
import time
from dataclasses import dataclass

PROBE_ANSWER = 80 << 10  # a shard's header probe (64 KiB) and its HTTP headers
_SLOW_DOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
    b"<Message>Please reduce your request rate.</Message></Error>"
)
SLOW_DOWN = (
    b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
    b"Content-Length: %d\r\n\r\n" % len(_SLOW_DOWN_BODY) + _SLOW_DOWN_BODY
)


class SlowRelay:
    """127.0.0.1:<port> → `upstream` (host:port). Responses flow at `rate` bytes/s per connection; `hold()` stops
    them until `release()`, and `hold_after(n)` does once `n` bytes more of data have flowed. `cut=(marker, n)`: the
    first request whose bytes contain `marker` gets only the first `n` bytes of its response, then its connection
    is closed (a server or network dropping mid-body). `throttle=(pattern, n)`: the first `n` requests whose bytes
    match `pattern` (a bytes regex, searched with DOTALL) are answered `503 SlowDown` by the relay itself (S3
    throttling), never reaching S3."""

    def __init__(
        self,
        upstream: str,
        rate: float,
        cut: tuple[bytes, int] | None = None,
        throttle: tuple[bytes, int] | None = None,
    ) -> None:
        host, _, port = upstream.rpartition(":")
        self._upstream = (host.removeprefix("http://").removeprefix("https://"), int(port))
        self._rate = rate
        self._cut = cut
        self._throttle = throttle
        self.throttled = 0  # requests answered 503 SlowDown so far
        self._lock = threading.Lock()
        self._flowing = threading.Event()
        self._flowing.set()
        self._budget: int | None = None  # data bytes still let through before `hold_after` holds
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def hold(self) -> None:
        self._flowing.clear()

    def hold_after(self, n: int) -> None:
        """Hold once `n` more bytes of data have flowed: the first `PROBE_ANSWER` bytes of each answer do not count,
        so a loader gets every shard's header probe and so much of the tensors, however slow the test watching it."""
        with self._lock:
            self._budget = n

    def release(self) -> None:
        with self._lock:
            self._budget = None
        self._flowing.set()

    def close(self) -> None:
        self._closed = True
        self._flowing.set()
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self._upstream)
            except OSError:
                client.close()
                continue
            armed: list[int] = []  # this connection's response bytes still let through before the cut
            answered = [0]  # bytes of its answer to the request this connection serves now
            threading.Thread(target=self._pipe, args=(client, server, False, armed, answered), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True, armed, answered), daemon=True).start()

    def _arm(self, request: bytes, armed: list[int]) -> None:
        with self._lock:
            if self._cut is not None and self._cut[0] in request:
                armed.append(self._cut[1])
                self._cut = None  # the first such request only

    def _throttled(self, request: bytes) -> bool:
        with self._lock:
            if self._throttle is None or request[:4] not in (b"GET ", b"HEAD"):
                return False
            if not re.search(self._throttle[0], request, re.DOTALL):
                return False
            marker, left = self._throttle
            self._throttle = (marker, left - 1) if left > 1 else None
            self.throttled += 1
            return True

    def _spend(self, n: int) -> None:
        with self._lock:
            if self._budget is None:
                return
            self._budget -= n
            if self._budget < 0:  # this block goes past it: it waits with the rest
                self._budget = None
                self._flowing.clear()

    def _pipe(self, src: socket.socket, dst: socket.socket, paced: bool, armed: list[int], answered: list[int]) -> None:
        due = 0.0  # when the bytes sent so far are paid for: no credit builds up while the connection is idle
        try:
            while True:
                data = src.recv(64 << 10)
                if not data:
                    break
                if not paced:
                    if self._throttled(data):  # a GET or HEAD has no body: its headers are all it sends
                        src.sendall(SLOW_DOWN)
                        continue
                    self._arm(data, armed)
                    if data[:4] in (b"GET ", b"HEAD"):
                        answered[0] = 0
                elif armed:
                    if len(data) >= armed[0]:
                        dst.sendall(data[: armed[0]])
                        break
                    armed[0] -= len(data)
                if paced:
                    before, answered[0] = answered[0], answered[0] + len(data)
                    self._spend(max(0, answered[0] - max(before, PROBE_ANSWER)))
                    self._flowing.wait()
                    due = max(due, time.monotonic()) + len(data) / self._rate
                    time.sleep(max(0.0, due - time.monotonic()))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()


@dataclass(frozen=True)
class SlowS3:
    """What `start_agent(s3=...)` needs of an S3 server, reached through a `SlowRelay`."""

    relay: SlowRelay
    real: object  # the S3Server

    @property
    def endpoint(self) -> str:
        return self.relay.endpoint

    def env(self) -> dict[str, str]:
        return {**self.real.env(), "AWS_ENDPOINT_URL": self.relay.endpoint}  # type: ignore[attr-defined]
