"""Agent Prometheus metrics: loads by strategy and outcome, bytes moved, load latency, active read leases."""

from __future__ import annotations

import socket
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import Counter, Gauge, Histogram, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

LOADS = Counter("ferry_agent_loads_total", "Replica loads by the source that served them and outcome",
                ["source_kind", "outcome"])  # fmt: skip
BYTES = Counter("ferry_agent_loaded_bytes_total", "Bytes placed in memory, by source kind", ["source_kind"])
LOAD_SECONDS = Histogram(
    "ferry_agent_load_seconds", "Time to load one replica", ["source_kind"],
    buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600),
)  # fmt: skip
READ_LEASES = Gauge("ferry_agent_active_read_leases", "Tensor read leases held by peers on this agent's replicas")


def source_kind(source: str) -> str:
    """`peer/<replica>` → `peer`; keeps label cardinality bounded."""
    return source.split("/", 1)[0] or "none"


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
