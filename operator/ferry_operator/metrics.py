"""Prometheus metrics: reconcile counts and latency, storage verifications, versions by phase."""

from __future__ import annotations

from collections import Counter as _Tally
from collections.abc import Iterator

from prometheus_client import REGISTRY, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

RECONCILES = Counter("ferry_reconciles_total", "Reconciliations by kind and resulting phase", ["kind", "phase"])
RECONCILE_SECONDS = Histogram(
    "ferry_reconcile_seconds", "Time to reconcile one object", ["kind"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)  # fmt: skip
VERIFICATIONS = Counter("ferry_storage_verifications_total", "S3 checkpoint verifications by outcome", ["result"])

_phases: dict[tuple[str, str], str] = {}


def record_phase(namespace: str, name: str, phase: str) -> None:
    _phases[(namespace, name)] = phase


def forget(namespace: str, name: str) -> None:
    _phases.pop((namespace, name), None)


class _PhaseCollector(Collector):
    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily("ferry_weightversions", "WeightVersions by phase", labels=["phase"])
        for phase, count in sorted(_Tally(_phases.values()).items()):
            family.add_metric([phase], count)
        yield family


REGISTRY.register(_PhaseCollector())


def serve(address: str, port: int) -> int:
    server, _thread = start_http_server(port, addr=address)
    return server.server_address[1]
