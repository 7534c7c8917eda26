"""Agent Prometheus metrics: loads by strategy and outcome, bytes moved, load latency, active read leases, and the
progress of each load in flight (bytes placed, bytes expected, last progress), which `LoadProgress` also renders for
people (WeightReplica `status.progress`)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from ferry.api.conditions import human_bytes

LOADS = Counter(
    "ferry_agent_loads_total", "Replica loads by the source that served them and outcome", ["source_kind", "outcome"]
)
BYTES = Counter("ferry_agent_loaded_bytes_total", "Bytes placed in memory, by source kind", ["source_kind"])
LOAD_SECONDS = Histogram(
    "ferry_agent_load_seconds",
    "Time to load one replica",
    ["source_kind"],
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)
READ_LEASES = Gauge("ferry_agent_active_read_leases", "Tensor read leases held by peers on this agent's replicas")
SHMEM_HUGE_PAGES = Gauge(
    "ferry_agent_shmem_huge_pages",
    "1 when the host gives the agent's shared-memory chunks 2 MiB pages (shmem_enabled allows MADV_HUGEPAGE), else 0",
)
_REPLICA = ["namespace", "replica"]
INFLIGHT_BYTES = Gauge(
    "ferry_agent_inflight_bytes", "Bytes the load in flight of a WeightReplica has placed so far", _REPLICA
)
INFLIGHT_EXPECTED_BYTES = Gauge(
    "ferry_agent_inflight_expected_bytes",
    "Bytes the load in flight of a WeightReplica places in all (0: not known yet)",
    _REPLICA,
)
INFLIGHT_PROGRESS_TIME = Gauge(
    "ferry_agent_inflight_last_progress_timestamp_seconds",
    "Unix time a WeightReplica's load in flight last reported progress (a stall: time() minus this grows)",
    _REPLICA,
)
_INFLIGHT = (INFLIGHT_BYTES, INFLIGHT_EXPECTED_BYTES, INFLIGHT_PROGRESS_TIME)


def source_kind(source: str) -> str:
    """`peer/<replica>` → `peer`; keeps label cardinality bounded."""
    return source.split("/", 1)[0] or "none"


def progress_text(done: int, total: int | None, seconds: float) -> str:
    """How far a load is, for `kubectl get wr -o wide`: `42% 1.2Gi/s` (or `3.1Gi 1.2Gi/s` while the total is not
    known). The rate is the average since the load began."""
    so_far = f"{min(100, done * 100 // total)}%" if total else human_bytes(done)
    return f"{so_far} {human_bytes(int(done / seconds))}/s" if seconds > 0 and done else so_far


class LoadProgress:
    """One replica's load in flight: its series exist from `__init__` until `close()`."""

    def __init__(self, namespace: str, replica: str, clock: Callable[[], float] = time.monotonic) -> None:
        self._labels = (namespace, replica)
        self._clock = clock
        self._started = clock()
        self.update(0, 0)

    def update(self, done: int, total: int) -> str:
        """Record progress; returns it as `progress_text`."""
        INFLIGHT_BYTES.labels(*self._labels).set(done)
        INFLIGHT_EXPECTED_BYTES.labels(*self._labels).set(total)
        INFLIGHT_PROGRESS_TIME.labels(*self._labels).set_to_current_time()
        return progress_text(done, total, self._clock() - self._started)

    def close(self) -> None:
        for gauge in _INFLIGHT:
            gauge.remove(*self._labels)


# Set once the agent has repaired its checkpoint store and runs its node: the DaemonSet's readiness probe
# (`/readyz`), so a rolling update waits for recovery. Liveness is `/metrics`: the process answers at all.
READY = threading.Event()


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass  # the probes would log a line every few seconds


def serve(address: str, port: int) -> int:
    """Serve `/readyz` and, on every other path, the metrics, from a daemon thread; returns the bound port."""
    metrics_app = make_wsgi_app()

    def app(environ, start_response):
        if environ.get("PATH_INFO") == "/readyz":
            ok = READY.is_set()
            start_response("200 OK" if ok else "503 Service Unavailable", [("Content-Type", "text/plain")])
            return [b"ready\n" if ok else b"recovering\n"]
        return metrics_app(environ, start_response)

    class Server(ThreadingWSGIServer):
        address_family = socket.AF_INET6 if ":" in address else socket.AF_INET

    server = make_server(address, port, app, Server, handler_class=_QuietHandler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server.server_address[1]
