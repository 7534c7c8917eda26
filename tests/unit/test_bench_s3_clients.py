"""bench/_s3_clients.py without the bench extra: a reference client that is not installed is a printed note (its
row skipped), never a crash of bench_s3; the streamer's settings do not outlive its load."""

from __future__ import annotations

import os

import pytest

from bench import _s3_clients

pytestmark = pytest.mark.unit


def test_a_missing_client_is_a_note_naming_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(
        _s3_clients,
        "REFERENCES",
        {"absent": (("json", "ferry_no_such_module"), "no-such-dist"), "present": (("json",), "json")},
    )
    note = _s3_clients.missing("absent")
    assert note is not None and "absent skipped" in note and "no-such-dist" in note and ".[bench]" in note
    assert _s3_clients.missing("present") is None


def test_every_reference_row_names_its_distributions() -> None:
    for row, (modules, dists) in _s3_clients.REFERENCES.items():
        assert modules and dists, row
        note = _s3_clients.missing(row)
        assert note is None or dists in note


def test_environment_is_restored(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FERRY_TEST_SET", "before")
    monkeypatch.delenv("FERRY_TEST_UNSET", raising=False)
    with _s3_clients.environment({"FERRY_TEST_SET": "during", "FERRY_TEST_UNSET": "during"}):
        assert os.environ["FERRY_TEST_SET"] == os.environ["FERRY_TEST_UNSET"] == "during"
    assert os.environ["FERRY_TEST_SET"] == "before"
    assert "FERRY_TEST_UNSET" not in os.environ
