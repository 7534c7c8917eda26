"""The chart's Grafana dashboards (charts/ferry/dashboards/*.json) parse, and every metric their PromQL names is one
the operator or the agent registers (imported from their metrics modules, not listed here)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from prometheus_client import REGISTRY

import ferry_agent.metrics
import ferry_operator.metrics

pytestmark = pytest.mark.unit

DASHBOARDS = sorted((Path(__file__).resolve().parents[2] / "charts" / "ferry" / "dashboards").glob("*.json"))
# Sample names per metric type, as the exposition writes them (a Counter `x` is exposed as `x_total`).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
    "info": ("_info",),
}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset", "and", "or", "unless"}


def exposed_names() -> set[str]:
    names = set()
    for family in REGISTRY.collect():
        names.update(family.name + suffix for suffix in SUFFIXES.get(family.type, ("",)))
    return names


def metric_names(expr: str) -> set[str]:
    """The series names a PromQL expression selects: identifiers that are not functions, keywords, label matchers,
    grouping labels, ranges or Grafana variables."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    expr = re.sub(r"\$\{[^}]*\}|\$\w+", "", expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    found = re.findall(r"(?<![\w.:])([a-zA-Z_:][\w:]*)(?![\w:])(?!\s*\()", expr)
    return {name for name in found if name not in KEYWORDS}


def targets(panels: list[dict]) -> Iterator[tuple[str, str]]:
    for panel in panels:
        yield from targets(panel.get("panels") or [])  # collapsed rows hold their panels
        for target in panel.get("targets") or []:
            yield panel["title"], target["expr"]


def test_the_chart_ships_a_dashboard():
    assert [p.name for p in DASHBOARDS] == ["ferry.json"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_metric_the_dashboard_queries_exists(path):
    dashboard = json.loads(path.read_text())
    known = exposed_names()
    used: dict[str, set[str]] = {}
    for title, expr in targets(dashboard["panels"]):
        for name in metric_names(expr):
            used.setdefault(name, set()).add(title)
    unknown = {name: sorted(titles) for name, titles in used.items() if name not in known}
    assert not unknown, f"{path.name} queries metrics nobody registers: {unknown}"
    # What users alert on is on it: load progress, stalls and ModelLoad health, from both processes.
    for wanted in (
        ferry_agent.metrics.INFLIGHT_BYTES._name,
        ferry_agent.metrics.INFLIGHT_PROGRESS_TIME._name,
        "ferry_modelload_condition",
        "ferry_modelload_replicas",
    ):
        assert wanted in used, wanted


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_dashboard_panels_use_the_datasource_variable(path):
    dashboard = json.loads(path.read_text())
    assert "datasource" in {v["name"] for v in dashboard["templating"]["list"]}
    panels = [p for p in dashboard["panels"] if p["type"] != "row"]
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])
    for panel in panels:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]


def test_metric_names_finds_what_a_typo_would_break():
    assert metric_names('sum by (le, kind) (rate(ferry_x_bucket{kind="a"}[$__rate_interval]))') == {"ferry_x_bucket"}
    assert metric_names('time() - a_seconds{n=~"$ns"} / (b > 0) or vector(0)') == {"a_seconds", "b"}
    assert "ferry_agent_inflight_byte" not in exposed_names()
    assert {"ferry_agent_loads_total", "ferry_reconcile_seconds_bucket", "ferry_modelload_condition"} <= exposed_names()
    assert ferry_operator.metrics.RECONCILES._name == "ferry_reconciles"
