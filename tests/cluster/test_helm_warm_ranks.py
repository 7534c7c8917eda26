"""The chart's warm rank processes: `agent.warmRanks` reaches the agent as FERRY_WARM_RANKS, which its settings take
as `--warm-ranks`, and their cap `agent.maxRankProcesses` as FERRY_MAX_RANK_PROCESSES (`--max-rank-processes`); the
schema refuses what is not a count."""

from __future__ import annotations

import pytest

from ferry_agent.config import AgentConfig
from tests.cluster.test_helm_memory import agent_env
from tests.support.helm import CHART, KUBE_VERSION, helm, render, sets

pytestmark = pytest.mark.cluster


def test_warm_ranks_reach_the_agent(helm_env, monkeypatch):
    assert agent_env(render(helm_env))["FERRY_WARM_RANKS"] == "0"
    env = agent_env(render(helm_env, *sets(agent__warmRanks="8")))
    monkeypatch.setenv("FERRY_WARM_RANKS", env["FERRY_WARM_RANKS"])
    assert AgentConfig.from_args(["--node", "n"]).warm_ranks == 8


@pytest.mark.parametrize("value", ["-1", "two"])
def test_warm_ranks_that_are_not_a_count_are_refused(helm_env, value):
    args = ("template", "ferry", str(CHART), "--kube-version", KUBE_VERSION, *sets(agent__warmRanks=value))
    proc = helm(helm_env, *args, check=False)
    assert proc.returncode != 0 and "warmRanks" in proc.stderr


def test_the_cap_of_rank_processes_reaches_the_agent(helm_env, monkeypatch):
    assert agent_env(render(helm_env))["FERRY_MAX_RANK_PROCESSES"] == "16"
    env = agent_env(render(helm_env, *sets(agent__maxRankProcesses="4")))
    monkeypatch.setenv("FERRY_MAX_RANK_PROCESSES", env["FERRY_MAX_RANK_PROCESSES"])
    monkeypatch.delenv("FERRY_WARM_RANKS", raising=False)
    assert AgentConfig.from_args(["--node", "n"]).max_rank_processes == 4


@pytest.mark.parametrize("value", ["0", "eight"])
def test_a_cap_of_rank_processes_that_is_not_a_positive_count_is_refused(helm_env, value):
    args = ("template", "ferry", str(CHART), "--kube-version", KUBE_VERSION, *sets(agent__maxRankProcesses=value))
    proc = helm(helm_env, *args, check=False)
    assert proc.returncode != 0 and "maxRankProcesses" in proc.stderr


def test_more_warm_ranks_than_the_cap_are_refused_by_the_chart(helm_env):
    """The agent would exit at its start (`--warm-ranks` above `--max-rank-processes`): the chart says so first."""
    sets_ = sets(agent__warmRanks="9", agent__maxRankProcesses="8")
    proc = helm(helm_env, "template", "ferry", str(CHART), "--kube-version", KUBE_VERSION, *sets_, check=False)
    assert proc.returncode != 0 and "agent.warmRanks is more than agent.maxRankProcesses" in proc.stderr
    assert agent_env(render(helm_env, *sets(agent__warmRanks="8", agent__maxRankProcesses="8")))
