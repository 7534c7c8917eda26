"""The load strategy chain keeps ModelExpress `execute_load_strategies` semantics."""

from __future__ import annotations

import gc
import weakref
from pathlib import Path
from typing import Any

import pytest

from ferry.api.models import AttemptOutcome, AttemptReason
from ferry.errors import LoadFailed
from ferry_agent.strategies.chain import (
    Attempt,
    Leftover,
    LoadContext,
    LoadStrategy,
    StrategyFailed,
    StrategyRecoveryError,
    run_strategy_chain,
)

pytestmark = pytest.mark.unit


class Fake:
    def __init__(
        self,
        name: str,
        log: list[str],
        *,
        available: bool | Exception = True,
        error: BaseException | None = None,
        result: Any = None,
        rollback_error: Exception | None = None,
    ) -> None:
        self.name = name
        self.log = log
        self.available = available
        self.error = error
        self.result = result if result is not None else f"{name}-result"
        self.rollback_error = rollback_error

    def is_available(self, ctx: LoadContext) -> bool:
        self.log.append(f"available:{self.name}")
        if isinstance(self.available, Exception):
            raise self.available
        return self.available

    def load(self, ctx: LoadContext) -> Any:
        self.log.append(f"load:{self.name}")
        if self.error is not None:
            raise self.error
        return self.result

    def rollback(self, ctx: LoadContext) -> None:
        self.log.append(f"rollback:{self.name}")
        if self.rollback_error is not None:
            raise self.rollback_error


def ctx() -> LoadContext:
    return LoadContext(model="m", version="v1", rank=0, target_id="replica-t")


def run(strategies: list[Fake], log: list[str], c: LoadContext | None = None) -> Any:
    return run_strategy_chain(
        strategies,
        c or ctx(),
        reinit=lambda _: log.append("reinit"),
        publish=lambda result, _: log.append(f"publish:{result}"),
    )


def test_fakes_satisfy_the_protocol() -> None:
    assert isinstance(Fake("a", []), LoadStrategy)


def test_availability_is_evaluated_up_front_for_all() -> None:
    log: list[str] = []
    run([Fake("a", log), Fake("b", log), Fake("c", log, available=False)], log)
    assert log[:3] == ["available:a", "available:b", "available:c"]
    assert log[3:] == ["load:a", "publish:a-result"]


def test_is_available_exception_escapes_before_any_load() -> None:
    log: list[str] = []
    with pytest.raises(ValueError, match="probe"):
        run([Fake("a", log), Fake("b", log, available=ValueError("probe"))], log)
    assert log == ["available:a", "available:b"]


def test_success_publishes_and_returns_without_trying_later_strategies() -> None:
    log: list[str] = []
    c = ctx()
    assert run([Fake("a", log, result="A"), Fake("b", log)], log, c) == "A"
    assert log == ["available:a", "available:b", "load:a", "publish:A"]
    assert [(a.source, a.outcome, a.reason) for a in c.attempts] == [("a", AttemptOutcome.LOADED, "Loaded")]


def test_unmutated_failure_rolls_back_and_continues_without_reinit() -> None:
    log: list[str] = []
    c = ctx()
    assert run([Fake("a", log, error=StrategyFailed("miss")), Fake("b", log)], log, c) == "b-result"
    assert log[2:] == ["load:a", "rollback:a", "load:b", "publish:b-result"]
    assert (c.attempts[0].outcome, c.attempts[0].reason) == (AttemptOutcome.FAILED, "Failed")
    assert "miss" in c.attempts[0].message


def test_mutated_failure_rolls_back_then_reinits_then_continues() -> None:
    log: list[str] = []
    c = ctx()
    run([Fake("a", log, error=StrategyFailed("half", mutated=True)), Fake("b", log)], log, c)
    assert log[2:] == ["load:a", "rollback:a", "reinit", "load:b", "publish:b-result"]
    assert c.attempts[0].reason == "FailedMutated"


def test_recovery_error_rolls_back_and_stops_the_chain() -> None:
    log: list[str] = []
    c = ctx()
    with pytest.raises(StrategyRecoveryError, match="unsafe"):
        run([Fake("a", log, error=StrategyRecoveryError("unsafe")), Fake("b", log)], log, c)
    assert log[2:] == ["load:a", "rollback:a"]  # no reinit, no next strategy, no publish
    assert (c.attempts[-1].source, c.attempts[-1].reason) == ("a", "RecoveryFailed")


def test_unexpected_exception_rolls_back_and_continues_without_reinit() -> None:
    log: list[str] = []
    c = ctx()
    run([Fake("a", log, error=KeyError("boom")), Fake("b", log)], log, c)
    assert log[2:] == ["load:a", "rollback:a", "load:b", "publish:b-result"]
    assert c.attempts[0].reason == "UnexpectedError"


def test_base_exceptions_are_not_swallowed() -> None:
    log: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        run([Fake("a", log, error=KeyboardInterrupt()), Fake("b", log)], log)
    assert "load:b" not in log


def test_no_success_lists_every_strategy_failure() -> None:
    log: list[str] = []
    c = ctx()
    strategies = [
        Fake("Peer", log, error=StrategyFailed("no peer source", mutated=True)),
        Fake("Disk", log, available=False),
        Fake("ObjectStorage", log, error=OSError("bucket gone")),
    ]
    with pytest.raises(LoadFailed, match="No load strategy succeeded") as info:
        run(strategies, log, c)
    assert info.value.attempts == [a.to_status() for a in c.attempts]  # what goes into status.attempts[]
    text = str(info.value)
    for part in ("Peer: StrategyFailed: no peer source", "Disk: unavailable", "ObjectStorage: OSError: bucket gone"):
        assert part in text
    assert "publish" not in "".join(log)
    assert [(a.source, a.outcome) for a in c.attempts] == [
        ("Disk", AttemptOutcome.SKIPPED),
        ("Peer", AttemptOutcome.FAILED),
        ("ObjectStorage", AttemptOutcome.FAILED),
    ]


def test_empty_chain_fails_clearly() -> None:
    with pytest.raises(RuntimeError, match="no strategies configured"):
        run([], [])


def test_rollback_failure_is_a_recovery_error() -> None:
    log: list[str] = []
    failing = Fake("a", log, error=StrategyFailed("miss"), rollback_error=OSError("stuck"))
    with pytest.raises(StrategyRecoveryError, match="rollback of a failed") as info:
        run([failing, Fake("b", log)], log)
    assert isinstance(info.value.__cause__, OSError)
    assert "load:b" not in log


def test_reinit_failure_is_a_recovery_error() -> None:
    log: list[str] = []

    def reinit(_: LoadContext) -> None:
        raise NotImplementedError("cannot reinit")

    with pytest.raises(StrategyRecoveryError, match="reinit after a failed") as info:
        run_strategy_chain(
            [Fake("a", log, error=StrategyFailed("x", mutated=True)), Fake("b", log)],
            ctx(),
            reinit=reinit,
            publish=lambda *_: None,
        )
    assert isinstance(info.value.__cause__, NotImplementedError)
    assert "load:b" not in log


def test_mutated_failure_frees_frame_locals_before_reinit() -> None:
    """Device tensors held by the failed load's frames must be collectable when the model is reinitialised."""

    class Big:
        pass

    ref: list[weakref.ref[Big]] = []

    class Holder(Fake):
        def load(self, ctx: LoadContext) -> Any:
            big = Big()
            ref.append(weakref.ref(big))
            raise StrategyFailed("partial", mutated=True)

    alive_at_reinit: list[bool] = []

    def reinit(_: LoadContext) -> None:
        gc.collect()
        alive_at_reinit.append(ref[0]() is not None)

    run_strategy_chain([Holder("a", []), Fake("b", [])], ctx(), reinit=reinit, publish=lambda *_: None)
    assert alive_at_reinit == [False]


def test_attempt_status_is_truncated_to_crd_bounds() -> None:
    status = Attempt("peer/x", AttemptOutcome.FAILED, "R" * 500, "m" * 10_000).to_status()
    assert len(status["reason"]) == 128
    assert len(status["message"]) == 4096
    assert status["outcome"] == "Failed"
    assert status["time"].endswith("Z")


def test_every_attempt_reason_is_documented() -> None:
    """docs/conditions.md lists every reason an attempt can have, as a user reads it from `status.attempts[]`."""
    doc = (Path(__file__).resolve().parents[2] / "docs" / "conditions.md").read_text()
    assert [r for r in AttemptReason if f"| `{r}` |" not in doc] == []


class LeavesOrTakes(Fake):
    """Leaves a target for the next strategy when it fails (`leave`), or takes one over when it loads (`take`)."""

    def __init__(self, name: str, log: list[str], *, leave: bool = False, take: bool = False, **kw: Any) -> None:
        super().__init__(name, log, **kw)
        self.leave, self.take, self.taken = leave, take, None

    def load(self, ctx: LoadContext) -> Any:
        if self.take:
            self.taken = ctx.take_leftover()
        return super().load(ctx)

    def rollback(self, ctx: LoadContext) -> None:
        super().rollback(ctx)
        if self.leave:
            ctx.leftover = Leftover(None, {"t": "00000001"}, lambda: self.log.append(f"release:{self.name}"))  # type: ignore[arg-type]


def test_a_leftover_goes_to_the_next_strategy_only_and_is_released_unless_taken() -> None:
    log: list[str] = []
    taker = LeavesOrTakes("b", log, take=True)
    assert (
        run([LeavesOrTakes("a", log, leave=True, error=StrategyFailed("gone", mutated=True)), taker], log) == "b-result"
    )
    assert taker.taken is not None and taker.taken.checked == {"t": "00000001"}
    assert not [e for e in log if e.startswith("release")]  # the taker owns it now

    log.clear()
    c = ctx()
    run([LeavesOrTakes("a", log, leave=True, error=StrategyFailed("gone")), Fake("b", log)], log, c)
    assert log[2:] == ["load:a", "rollback:a", "load:b", "release:a", "publish:b-result"] and c.leftover is None

    log.clear()  # the next strategy fails too: released before the one after runs, not passed on
    later = LeavesOrTakes("c", log, take=True)
    run(
        [
            LeavesOrTakes("a", log, leave=True, error=StrategyFailed("x")),
            Fake("b", log, error=StrategyFailed("y")),
            later,
        ],
        log,
    )
    assert log.index("release:a") < log.index("load:c") and later.taken is None

    log.clear()  # the chain fails: what the last strategy left is released
    c = ctx()
    with pytest.raises(LoadFailed):
        run([LeavesOrTakes("a", log, leave=True, error=StrategyFailed("x"))], log, c)
    assert log[-1] == "release:a" and c.leftover is None
