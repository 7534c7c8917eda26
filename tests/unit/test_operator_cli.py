"""`python -m ferry_operator` (`ferry_operator.__main__`): --help lists every FERRY_* variable the operator reads,
with its default, and a run is `kopf run` as the chart starts it, flags turned into their variables."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import ferry_operator
from ferry_operator import __main__ as cli
from ferry_operator.config import OperatorConfig

pytestmark = pytest.mark.unit

PACKAGE = Path(ferry_operator.__file__).parent


def test_help_lists_every_setting_with_its_variable_and_default():
    out = subprocess.run(
        [sys.executable, "-m", "ferry_operator", "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "400"},
    ).stdout
    for name in OperatorConfig.model_fields:
        assert OperatorConfig.flag(name) in out, name
        for variable in OperatorConfig.envs(name):
            assert variable in out, variable
    assert "[env FERRY_VERIFY_CONCURRENCY; default: 16]" in out
    assert "--verify-backoff-seconds" in out


def test_no_setting_is_read_beside_the_declaration():
    """Every FERRY_* variable goes through `OperatorConfig`: none is read from the environment anywhere else."""
    for path in PACKAGE.rglob("*.py"):
        assert not re.findall(r"environ(?:\.get\(|\[)\s*\"FERRY_", path.read_text()), path


def test_a_bad_setting_exits_before_kopf_starts(monkeypatch, capsys):
    monkeypatch.setattr(cli.os, "execv", lambda path, argv: pytest.fail("kopf started"))
    with pytest.raises(SystemExit):
        cli.main(["--verify-concurrency", "0"])
    assert "--verify-concurrency (env FERRY_VERIFY_CONCURRENCY)" in capsys.readouterr().err


def test_a_run_is_kopf_run_with_the_flags_as_variables(monkeypatch):
    ran = []
    monkeypatch.setattr(cli.os, "execv", lambda path, argv: ran.append(argv))
    monkeypatch.delenv("FERRY_VERIFY_CONCURRENCY", raising=False)
    cli.main(["--verify-concurrency", "4", "--log-format=json", "--liveness=http://0.0.0.0:8081/healthz"])
    assert os.environ["FERRY_VERIFY_CONCURRENCY"] == "4"
    monkeypatch.delenv("FERRY_VERIFY_CONCURRENCY")
    assert ran == [
        [
            sys.executable,
            "-m",
            "kopf",
            "run",
            "--standalone",
            "--all-namespaces",
            "-m",
            "ferry_operator.main",
            "--log-format=json",
            "--liveness=http://0.0.0.0:8081/healthz",
        ]
    ]
