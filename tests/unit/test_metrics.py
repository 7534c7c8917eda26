"""The agent's per-replica load metrics and progress text, and the operator's per-ModelLoad gauges, read back
through the Prometheus exposition (what a scrape sees)."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from ferry_agent import metrics as agent_metrics
from ferry_operator import metrics as operator_metrics

pytestmark = pytest.mark.unit


def samples(name: str) -> dict[tuple, float]:
    text = generate_latest(REGISTRY).decode()
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


@pytest.mark.parametrize(
    ("done", "total", "seconds", "text"),
    [
        (0, 0, 0.0, "0"),
        (0, 100, 1.0, "0%"),
        (42 * 1024**2, 100 * 1024**2, 0.5, "42% 84Mi/s"),
        (3 * 1024**3, 0, 2.0, "3Gi 1.5Gi/s"),
        (10, 10, 4.0, "100% 2/s"),
    ],
)
def test_progress_text_reads_as_a_person_would(done, total, seconds, text):
    assert agent_metrics.progress_text(done, total, seconds) == text


def test_a_load_in_flight_has_series_until_it_closes():
    now = [100.0]
    tracked = agent_metrics.LoadProgress("ns", "wr-1", clock=lambda: now[0])
    key = (("namespace", "ns"), ("replica", "wr-1"))
    assert samples("ferry_agent_inflight_bytes")[key] == 0
    now[0] = 102.0
    assert tracked.update(512 * 1024**2, 1024**3) == "50% 256Mi/s"
    assert samples("ferry_agent_inflight_bytes")[key] == 512 * 1024**2
    assert samples("ferry_agent_inflight_expected_bytes")[key] == 1024**3
    assert samples("ferry_agent_inflight_last_progress_timestamp_seconds")[key] > 0
    tracked.close()
    for name in ("ferry_agent_inflight_bytes", "ferry_agent_inflight_expected_bytes"):
        assert key not in samples(name), "a finished load leaves no series behind"


def _replica(phase: str | None) -> dict:
    return {"status": {"phase": phase} if phase else {}}


def test_modelload_gauges_follow_the_last_reconcile_and_go_with_the_modelload():
    status = {
        "conditions": [
            {"type": "Ready", "status": "False"},
            {"type": "Degraded", "status": "True"},
            {"type": "PeerStalled", "status": "False"},
        ]
    }
    operator_metrics.record_modelload("ns", "serve", status, [_replica("Serving"), _replica("Failed"), _replica(None)])
    replicas = samples("ferry_modelload_replicas")
    labels = (("modelload", "serve"), ("namespace", "ns"))
    assert replicas[(*labels, ("phase", "Serving"))] == 1
    assert replicas[(*labels, ("phase", "Failed"))] == 1
    assert replicas[(*labels, ("phase", "Pending"))] == 1, "a replica no agent has written yet is Pending"
    assert replicas[(*labels, ("phase", "Loading"))] == 0
    conditions = samples("ferry_modelload_condition")
    assert conditions[(("condition", "Degraded"), *labels, ("status", "True"))] == 1
    assert conditions[(("condition", "Ready"), *labels, ("status", "False"))] == 1

    operator_metrics.record_modelload("ns", "serve", {"conditions": [{"type": "Ready", "status": "True"}]}, [])
    conditions = samples("ferry_modelload_condition")
    assert (("condition", "Degraded"), *labels, ("status", "True")) not in conditions
    assert conditions[(("condition", "Ready"), *labels, ("status", "True"))] == 1

    operator_metrics.forget_modelload("ns", "serve")
    assert not [k for k in samples("ferry_modelload_replicas") if ("modelload", "serve") in k]
    assert not [k for k in samples("ferry_modelload_condition") if ("modelload", "serve") in k]
