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

pytestmark = pytest.mark.unit

PACKAGE = Path(ferry_operator.__file__).parent


def variables_read() -> set[str]:
    found = set()
    for path in PACKAGE.rglob("*.py"):
        found.update(re.findall(r"environ\.get\(\s*\"(FERRY_[A-Z_]+)\"", path.read_text()))
        found.update(re.findall(r"(?:_float|_setting)\(\"(FERRY_[A-Z_]+)\"", path.read_text()))
    return found


def test_help_lists_every_setting_with_its_default():
    out = subprocess.run(
        [sys.executable, "-m", "ferry_operator", "--help"],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "COLUMNS": "400"},
    ).stdout
    names = variables_read()
    assert {"FERRY_VERIFY_CONCURRENCY", "FERRY_LEADER_ELECTION", "FERRY_LEADER_ELECTION_LEASE"} <= names  # scanned
    for name in names:
        assert name in out, name
    assert "[FERRY_VERIFY_CONCURRENCY; default: 16]" in out
    assert "--verify-backoff-seconds" in out


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
