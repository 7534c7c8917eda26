"""The operator's scale pieces without a cluster: keyed index lookups, the one deadline scheduler, quiet INFO."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

import pytest

from ferry.chain import VersionView
from ferry_operator import deadlines as deadlines_module
from ferry_operator.deadlines import Deadlines
from ferry_operator.indexkeys import based_on, dependents_of, in_folder, named, of_model, version_keys
from ferry_operator.logfilter import DropBookkeeping

pytestmark = pytest.mark.unit


def view(name: str, namespace: str, base: str | None = None, uri: str = "") -> VersionView:
    return VersionView(
        name,
        "m",
        "XorDelta" if base else "FullCheckpoint",
        base,
        None,
        True,
        False,
        bool(uri),
        namespace=namespace,
        storage_uri=uri,
    )


class KeyedOnly(dict):
    """A kopf index stand-in that fails any walk over its keys or values: lookups must go by key."""

    def __iter__(self) -> Iterator:
        raise AssertionError("walked the whole index")

    def items(self):
        raise AssertionError("walked the whole index")

    def values(self):
        raise AssertionError("walked the whole index")

    def keys(self):
        raise AssertionError("walked the whole index")


def index_of(views: list[VersionView]) -> KeyedOnly:
    index = KeyedOnly()
    for v in views:
        for key, value in version_keys(v).items():
            dict.setdefault(index, key, []).append(value)
    return index


def test_dependents_are_found_by_key_in_their_namespace_only():
    views = [view("v1", "a"), view("d1", "a", "v1"), view("d2", "a", "v1"), view("d3", "a", "d1")]
    views += [view(f"x{i}", f"ns{i}", "v1") for i in range(100)]  # a base named v1 in 100 other namespaces
    index = index_of(views)
    assert sorted(v.name for v in dependents_of(index, "a", "v1")) == ["d1", "d2"]
    assert [v.name for v in dependents_of(index, "ns7", "v1")] == ["x7"]
    assert dependents_of(index, "b", "v1") == []


def test_one_index_answers_names_namespaces_bases_and_folders():
    v = view("d1", "a", "v1", uri="s3://bkt/models/d1/model.safetensors.index.json")
    keys = version_keys(v)
    assert set(keys) == {named("a", "d1"), of_model("a", "m"), based_on("a", "v1"), in_folder("bkt", "models/d1")}
    assert all(value is v for value in keys.values())
    assert set(version_keys(view("p", "a"))) == {named("a", "p"), of_model("a", "m")}  # no base, no storage
    # The kinds of key never collide: a namespace and a version may share a name.
    assert len({named("a", "a"), of_model("a", "a"), based_on("a", "a")}) == 3


def test_deadlines_fire_the_latest_setting_of_a_key_once():
    deadlines = Deadlines()
    fired: list[str] = []

    def note(label: str):
        async def callback() -> None:
            fired.append(label)

        return callback

    deadlines.at("lease", 10.0, note("first"))
    deadlines.at("lease", 20.0, note("renewed"))  # a renewal moves the deadline: the first never fires
    deadlines.at("stall", 15.0, note("stall"))
    deadlines.at("gone", 5.0, note("gone"))
    deadlines.cancel("gone")
    assert [k for k, _ in deadlines.due(12.0)] == []
    assert [k for k, _ in deadlines.due(16.0)] == ["stall"]
    assert [k for k, _ in deadlines.due(30.0)] == ["lease"]
    assert deadlines.due(100.0) == [] and len(deadlines) == 0


def test_the_scheduler_sleeps_until_the_next_deadline_and_retries_a_failure(monkeypatch):
    monkeypatch.setattr(deadlines_module, "RETRY_SECONDS", 0.05)

    async def scenario() -> list[str]:
        deadlines = Deadlines()
        fired: list[str] = []
        failures = iter([RuntimeError("apiserver down")])

        async def flaky() -> None:
            error = next(failures, None)
            if error:
                raise error
            fired.append("flaky")

        async def quick() -> None:
            fired.append("quick")

        task = asyncio.create_task(deadlines.run())
        await asyncio.sleep(0)
        deadlines.after("far", 3600, quick)  # set first, and far: a nearer one set later must not wait for it
        deadlines.after("near", 0.05, quick)
        deadlines.after("flaky", 0.01, flaky)
        started = time.monotonic()
        while len(fired) < 2 and time.monotonic() - started < 10:
            await asyncio.sleep(0.01)
        task.cancel()
        return fired

    assert sorted(asyncio.run(scenario())) == ["flaky", "quick"]


def test_kopf_bookkeeping_is_not_info():
    keep = DropBookkeeping()

    def record(message: str, level: int = logging.INFO) -> logging.LogRecord:
        return logging.LogRecord("kopf.objects", level, __file__, 1, message, None, None)

    root = logging.getLogger()
    saved = root.level
    root.setLevel(logging.INFO)
    try:
        assert not keep.filter(record("Handler 'version_changed' succeeded."))
        assert not keep.filter(record("Timer 'version_resync' succeeded."))
        assert not keep.filter(record("Deletion is processed: 1 succeeded; 0 failed."))
        assert keep.filter(record("ns/v1 is Ready (chain v1)"))
        assert keep.filter(record("Handler 'release_version' succeeded.", logging.WARNING))
        root.setLevel(logging.DEBUG)
        assert keep.filter(record("Handler 'version_changed' succeeded."))
    finally:
        root.setLevel(saved)
