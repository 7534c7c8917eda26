"""In-process wakes of a reconcile (`ferry_operator.wakeups`): only objects kopf handled, coalesced while one runs,
nothing after a delete, and a failed run retried through the deadline scheduler."""

from __future__ import annotations

import asyncio

import kopf
import pytest

from ferry_operator import wakeups as wakeups_module
from ferry_operator.deadlines import Deadlines
from ferry_operator.wakeups import Wakeups

pytestmark = pytest.mark.unit


@pytest.fixture
def deadlines(monkeypatch) -> Deadlines:
    fresh = Deadlines()
    monkeypatch.setattr(wakeups_module, "DEADLINES", fresh)
    return fresh


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_wakes_run_the_reconcile_coalesced_and_stop_at_delete(deadlines):
    async def scenario() -> None:
        runs: list[tuple[str, str]] = []
        gate = asyncio.Event()
        wakes = Wakeups()

        async def reconcile(namespace: str, name: str, memo: kopf.Memo) -> None:
            runs.append((namespace, name))
            await gate.wait()

        wakes.register("things", reconcile)
        wakes.wake("things", "ns", "a")  # kopf has not handled it yet: its first event will
        await settle()
        assert runs == []

        memo = kopf.Memo()
        wakes.seen("things", "ns", "a", memo)
        wakes.wake("things", "ns", "a")
        await settle()
        assert runs == [("ns", "a")]
        for _ in range(5):  # while it runs: one more run, not five
            wakes.wake("things", "ns", "a")
        gate.set()
        await settle()
        assert len(runs) == 2

        wakes.forget("things", "ns", "a")
        wakes.wake("things", "ns", "a")
        await settle()
        assert len(runs) == 2
        assert wakes.lock(memo) is wakes.lock(memo)

    asyncio.run(scenario())


def test_a_failed_run_is_retried_through_the_deadlines(deadlines):
    async def scenario() -> None:
        wakes = Wakeups()
        calls = []

        async def reconcile(namespace: str, name: str, memo: kopf.Memo) -> None:
            calls.append(name)
            raise RuntimeError("apiserver restarting")

        wakes.register("things", reconcile)
        wakes.seen("things", "ns", "a", kopf.Memo())
        wakes.wake("things", "ns", "a")
        await settle()
        assert calls == ["a"] and len(deadlines) == 1
        wakes.forget("things", "ns", "a")  # deleted meanwhile: the retry goes too
        assert len(deadlines) == 0

    asyncio.run(scenario())
