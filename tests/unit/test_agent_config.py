"""The agent's settings: every flag says what it does, the environment fills the defaults the chart sets, and JSON
logs carry the operator's fields."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest

from ferry_agent.config import AgentConfig
from ferry_agent.logs import LogFormat, adopt, configure

pytestmark = pytest.mark.unit


def test_every_flag_has_help():
    undocumented = [a.option_strings for a in AgentConfig.parser()._actions if not a.help]
    assert undocumented == []


def test_flags_default_to_their_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("NODE_NAME", "node-x")
    monkeypatch.setenv("FERRY_CHECKPOINT_DIR", str(tmp_path))
    monkeypatch.setenv("FERRY_AGENT_HOST_MEMORY_BUDGET", "2Gi")
    monkeypatch.setenv("FERRY_AGENT_LOG_FORMAT", "json")
    config = AgentConfig.from_args([])
    assert (config.node, config.checkpoint_dir, config.host_memory_budget) == ("node-x", Path(tmp_path), 2 << 30)
    assert config.log_format == LogFormat.JSON
    assert AgentConfig.from_args(["--log-format", "plain"]).log_format == LogFormat.PLAIN


def test_the_cap_of_rank_processes_defaults_and_comes_from_the_environment(monkeypatch, capsys):
    monkeypatch.delenv("FERRY_MAX_RANK_PROCESSES", raising=False)
    monkeypatch.delenv("FERRY_WARM_RANKS", raising=False)
    assert AgentConfig.from_args(["--node", "n"]).max_rank_processes == 16
    monkeypatch.setenv("FERRY_MAX_RANK_PROCESSES", "4")
    assert AgentConfig.from_args(["--node", "n"]).max_rank_processes == 4
    for argv, said in (
        (["--max-rank-processes", "0"], "'0' is not a positive integer"),
        (["--max-rank-processes", "x"], "'x' is not a positive integer"),
        (["--warm-ranks", "5"], "--warm-ranks 5 is more than --max-rank-processes 4"),
    ):
        with pytest.raises(SystemExit):
            AgentConfig.from_args(["--node", "n", *argv])
        assert said in capsys.readouterr().err


def test_node_is_required(monkeypatch):
    monkeypatch.delenv("NODE_NAME", raising=False)
    with pytest.raises(SystemExit):
        AgentConfig.from_args([])


def test_json_logs(monkeypatch):
    out = io.StringIO()
    try:
        configure(LogFormat.JSON, stream=out, rank=1)
        logging.getLogger("ferry.agent").warning("lost %s", "it")
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("ferry.agent").exception("failed")
    finally:
        logging.basicConfig(force=True)
    first, second = (json.loads(line) for line in out.getvalue().splitlines())
    assert {k: first[k] for k in ("message", "severity", "logger", "rank")} == {
        "message": "lost it",
        "severity": "warn",
        "logger": "ferry.agent",
        "rank": 1,
    }
    assert first["timestamp"].endswith("+00:00")
    assert second["severity"] == "error" and "ValueError: boom" in second["exc_info"]


def test_a_library_handler_is_routed_through_ours():
    out, own = io.StringIO(), io.StringIO()
    library = logging.getLogger("library-with-its-own-handler")
    library.addHandler(logging.StreamHandler(own))
    library.propagate = False
    try:
        configure(LogFormat.JSON, stream=out)
        adopt(library.name)
        library.info("instantiated")
    finally:
        logging.basicConfig(force=True)
    assert own.getvalue() == ""
    assert json.loads(out.getvalue())["message"] == "instantiated"


def test_the_attach_connection_cap_comes_from_the_flag_or_the_environment(monkeypatch, capsys):
    monkeypatch.delenv("FERRY_AGENT_ATTACH_CONNECTIONS_PER_POD", raising=False)
    assert AgentConfig.from_args(["--node", "n"]).attach_connections_per_pod == 64
    monkeypatch.setenv("FERRY_AGENT_ATTACH_CONNECTIONS_PER_POD", "24")
    assert AgentConfig.from_args(["--node", "n"]).attach_connections_per_pod == 24
    assert AgentConfig.from_args(["--node", "n", "--attach-connections-per-pod", "9"]).attach_connections_per_pod == 9
    with pytest.raises(SystemExit):
        AgentConfig.from_args(["--node", "n", "--attach-connections-per-pod", "0"])
    assert "'0' is not a positive integer" in capsys.readouterr().err
