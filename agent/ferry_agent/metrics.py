"""Agent Prometheus metrics: loads by strategy and outcome, bytes moved, load latency, active read leases."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, start_http_server

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


def serve(address: str, port: int) -> int:
    server, _thread = start_http_server(port, addr=address)
    return server.server_address[1]
