"""Prometheus metrics: reconcile counts and latency, storage verifications, WeightVersions by phase, and per
ModelLoad its replicas by phase and its conditions (what users alert on: not Ready, Degraded, PeerStalled)."""

from __future__ import annotations

from collections import Counter as _Tally
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import REGISTRY, Counter, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from ferry.api.models import ReplicaPhase

RECONCILES = Counter("ferry_reconciles_total", "Reconciliations by kind and resulting phase", ["kind", "phase"])
RECONCILE_SECONDS = Histogram(
    "ferry_reconcile_seconds",
    "Time to reconcile one object",
    ["kind"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
VERIFICATIONS = Counter("ferry_storage_verifications_total", "S3 checkpoint verifications by outcome", ["result"])

_phases: dict[tuple[str, str], str] = {}


class _ModelLoadView:
    """What a ModelLoad's last reconcile found: its replicas by phase and its conditions' statuses."""

    def __init__(self, status: Mapping[str, Any], replicas: Iterable[Mapping[str, Any]]) -> None:
        self.replicas = _Tally(str((r.get("status") or {}).get("phase") or ReplicaPhase.PENDING) for r in replicas)
        self.conditions = {str(c["type"]): str(c.get("status")) for c in status.get("conditions") or []}


_modelloads: dict[tuple[str, str], _ModelLoadView] = {}


def record_phase(namespace: str, name: str, phase: str) -> None:
    _phases[(namespace, name)] = phase


def forget(namespace: str, name: str) -> None:
    _phases.pop((namespace, name), None)


def record_modelload(
    namespace: str, name: str, status: Mapping[str, Any], replicas: Iterable[Mapping[str, Any]]
) -> None:
    """After each ModelLoad reconcile: the status it computed and the replicas it read."""
    _modelloads[(namespace, name)] = _ModelLoadView(status, replicas)


def forget_modelload(namespace: str, name: str) -> None:
    _modelloads.pop((namespace, name), None)


class _StateCollector(Collector):
    """Gauges read from the last reconciles at scrape time, so a deleted object's series go with it."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        versions = GaugeMetricFamily("ferry_weightversions", "WeightVersions by phase", labels=["phase"])
        for phase, count in sorted(_Tally(_phases.values()).items()):
            versions.add_metric([phase], count)
        yield versions
        replicas = GaugeMetricFamily(
            "ferry_modelload_replicas",
            "A ModelLoad's WeightReplicas by phase",
            labels=["namespace", "modelload", "phase"],
        )
        conditions = GaugeMetricFamily(
            "ferry_modelload_condition",
            "1 for the status (True, False, Unknown) of each ModelLoad condition (Ready, Degraded, PeerStalled, ...)",
            labels=["namespace", "modelload", "condition", "status"],
        )
        for (namespace, name), view in sorted(_modelloads.items()):
            for phase in ReplicaPhase:  # every phase, so "0 Failed" is a sample and not a missing series
                replicas.add_metric([namespace, name, phase], view.replicas.get(phase, 0))
            for condition, status in sorted(view.conditions.items()):
                conditions.add_metric([namespace, name, condition, status], 1)
        yield replicas
        yield conditions


REGISTRY.register(_StateCollector())


def serve(address: str, port: int) -> int:
    server, _thread = start_http_server(port, addr=address)
    return server.server_address[1]
