"""The chart's host-memory budget: `agent.hostMemoryBudget` reaches the agent as FERRY_AGENT_HOST_MEMORY_BUDGET (unset
when empty: unlimited), and the schema takes only byte quantities the agent parses."""

from __future__ import annotations

import pytest

from ferry_agent.attach.memstore import parse_bytes
from tests.support.helm import CHART, KUBE_VERSION, helm, render, sets

pytestmark = pytest.mark.cluster


def agent_env(docs: list[dict]) -> dict[str, str]:
    ds = next(d for d in docs if d["kind"] == "DaemonSet")
    return {e["name"]: e.get("value") for e in ds["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_the_budget_is_unlimited_by_default_and_set_when_given(helm_env):
    assert "FERRY_AGENT_HOST_MEMORY_BUDGET" not in agent_env(render(helm_env))
    env = agent_env(render(helm_env, *sets(agent__hostMemoryBudget="64Gi")))
    assert env["FERRY_AGENT_HOST_MEMORY_BUDGET"] == "64Gi" and parse_bytes("64Gi") == 64 << 30


@pytest.mark.parametrize("value", ["64GB", "1.5Gi", "-1", "lots"])
def test_a_budget_that_is_not_a_byte_quantity_is_refused(helm_env, value):
    proc = helm(
        helm_env,
        "template",
        "ferry",
        str(CHART),
        "--kube-version",
        KUBE_VERSION,
        *sets(agent__hostMemoryBudget=value),
        check=False,
    )
    assert proc.returncode != 0 and "hostMemoryBudget" in proc.stderr
