"""The load strategy chain, with ModelExpress `execute_load_strategies` semantics.

- `is_available` is evaluated for every strategy up front, outside any try: an exception there escapes.
- `StrategyFailed` → rollback; plus `reinit` when `mutated` (the target may hold partial bytes).
- `StrategyRecoveryError` → rollback, then re-raise: the chain stops, since trying another loader on a
  model we could not restore would hide the original failure.
- Any other `Exception` → rollback and continue, without reinit.
- First success → `publish` and return its result. None → `LoadFailed` naming every strategy's failure.

A failed strategy may leave its target for the next one (`LoadContext.leftover`: the tensors it checked), so that
a peer load whose holders all died goes on from object storage for the rest instead of starting over. The next
strategy takes it or not; whatever is not taken is released before the one after runs.

Every step is recorded as an `Attempt` on the context so the caller can copy it into status.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from ferry.api.conditions import now_rfc3339
from ferry.api.models import AttemptOutcome, AttemptReason

if TYPE_CHECKING:
    from ferry_agent.store.resident import ResidentWeights

from ferry.errors import LoadFailed, NotFound

log = logging.getLogger(__name__)

# WeightReplica status.attempts[] bounds (ferry.api.models.LoadAttempt).
_MAX_REASON = 128
_MAX_MESSAGE = 4096


class StrategyFailed(NotFound, RuntimeError):
    """An expected miss. `mutated=True` means target weights may have changed: rollback + reinit. `reason`: the
    attempt's, when it says more than Failed (an AttemptReason)."""

    def __init__(self, message: str, *, mutated: bool = False, reason: str | None = None) -> None:
        super().__init__(message)
        self.mutated = mutated
        self.reason = reason


class StrategyRecoveryError(RuntimeError):
    """The strategy cannot restore a safe state; the chain must stop."""


class SourceTransferError(RuntimeError):
    """A failure that is demonstrably the source's (a data-plane error), as opposed to a target-local one."""


@dataclass(frozen=True)
class Attempt:
    """One tried source: a strategy (`Peer`) or a peer (`peer/<replica>`)."""

    source: str
    outcome: AttemptOutcome
    reason: AttemptReason
    message: str = ""
    time: str = field(default_factory=now_rfc3339)

    def to_status(self) -> dict[str, str]:
        """The WeightReplica `status.attempts[]` item, truncated to the CRD's bounds."""
        return {
            "source": self.source,
            "outcome": str(self.outcome),
            "reason": str(self.reason)[:_MAX_REASON],
            "message": self.message[:_MAX_MESSAGE],
            "time": self.time,
        }


@dataclass(frozen=True)
class Leftover:
    """A failed strategy's target: `checked` maps each tensor that passed its check to its adler32 (the others'
    bytes are unknown). `release()` undoes what the failed strategy still holds for it (its NIXL registration);
    a strategy that takes it over (`LoadContext.take_leftover`) owns the weights and that registration."""

    resident: ResidentWeights
    checked: Mapping[str, str]
    release: Callable[[], None]


@dataclass
class LoadContext:
    """What one load of one rank is about. Strategies hold their own dependencies."""

    model: str
    version: str
    rank: int
    target_id: str  # this replica's name: the rendezvous-hash key of the target
    device: str = "cpu"
    world_size: int = 1  # ranks of the replica; each holds its share of the tensors (ferry_agent.ranks.sharding)
    expected_manifest_digest: str | None = None  # when known, every source must match it
    # uid of the WeightVersion object a strategy checked and loaded `version` from; published as the replica's
    # status.versionUid, so that peers copy only from replicas of the very same object (not an old one of the name)
    version_uid: str | None = None
    attempts: list[Attempt] = field(default_factory=list)
    leftover: Leftover | None = None  # what the strategy that just failed left for the next one

    def take_leftover(self) -> Leftover | None:
        leftover, self.leftover = self.leftover, None
        return leftover

    def drop_leftover(self) -> None:
        leftover = self.take_leftover()
        if leftover is not None:
            leftover.release()

    def record(self, source: str, outcome: AttemptOutcome, reason: AttemptReason, message: str = "") -> Attempt:
        attempt = Attempt(source=source, outcome=outcome, reason=reason, message=message)
        self.attempts.append(attempt)
        return attempt


class LoadResult(Protocol):
    """What a strategy's `load` hands over: this rank's weights, now the caller's, and where they came from."""

    @property
    def resident(self) -> ResidentWeights: ...

    @property
    def bytes_moved(self) -> int: ...

    @property
    def source_label(self) -> str:
        """The `status.source` value: `peer/<replica>`, `s3` or `local`."""


@runtime_checkable
class LoadStrategy(Protocol):
    name: str

    def is_available(self, ctx: LoadContext) -> bool: ...

    def load(self, ctx: LoadContext) -> LoadResult: ...

    def rollback(self, ctx: LoadContext) -> None:
        """Undo strategy-owned state only; it must not decide whether the target is dirty."""


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _clear_tracebacks(exc: BaseException) -> None:
    """Drop frame locals along the exception chain so device tensors they hold can be freed before reinit."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [exc]
    while todo:
        cur = todo.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        if cur.__traceback__ is not None:
            traceback.clear_frames(cur.__traceback__)  # skips frames that are still executing
        todo.extend((cur.__cause__, cur.__context__))


def _rollback(strategy: LoadStrategy, ctx: LoadContext) -> None:
    try:
        strategy.rollback(ctx)
    except Exception as exc:
        # A strategy that cannot clean up its own state leaves the target in an unknown state.
        raise StrategyRecoveryError(f"rollback of {strategy.name} failed: {_describe(exc)}") from exc


def run_strategy_chain(
    strategies: Sequence[LoadStrategy],
    ctx: LoadContext,
    *,
    reinit: Callable[[LoadContext], None],
    publish: Callable[[LoadResult, LoadContext], None],
) -> LoadResult:
    """Run `strategies` in order until one loads; publish and return its result."""
    eligible: list[LoadStrategy] = []
    failures: list[str] = []
    for strategy in strategies:
        if strategy.is_available(ctx):
            eligible.append(strategy)
        else:
            ctx.record(strategy.name, AttemptOutcome.SKIPPED, AttemptReason.UNAVAILABLE)
            failures.append(f"{strategy.name}: unavailable")

    try:
        for strategy in eligible:
            offered = ctx.leftover
            try:
                result = strategy.load(ctx)
            except StrategyRecoveryError as exc:
                ctx.record(strategy.name, AttemptOutcome.FAILED, AttemptReason.RECOVERY_FAILED, _describe(exc))
                log.error("strategy %s cannot recover, stopping the chain: %s", strategy.name, exc)
                _rollback(strategy, ctx)
                raise
            except StrategyFailed as exc:
                reason = exc.reason or (AttemptReason.FAILED_MUTATED if exc.mutated else AttemptReason.FAILED)
                ctx.record(strategy.name, AttemptOutcome.FAILED, reason, _describe(exc))
                failures.append(f"{strategy.name}: {_describe(exc)}")
                log.info("strategy %s failed (mutated=%s): %s", strategy.name, exc.mutated, exc)  # an expected miss
                _rollback(strategy, ctx)
                if exc.mutated:
                    _clear_tracebacks(exc)
                    try:
                        reinit(ctx)
                    except Exception as reinit_exc:
                        raise StrategyRecoveryError(
                            f"reinit after {strategy.name} failed: {_describe(reinit_exc)}"
                        ) from reinit_exc
                continue
            except Exception as exc:
                # Unexpected: the strategy did not claim a mutation, so (as in ModelExpress) no reinit.
                ctx.record(strategy.name, AttemptOutcome.FAILED, AttemptReason.UNEXPECTED_ERROR, _describe(exc))
                failures.append(f"{strategy.name}: {_describe(exc)}")
                log.warning("strategy %s raised unexpectedly: %s", strategy.name, exc, exc_info=True)
                _rollback(strategy, ctx)
                continue
            finally:
                if offered is not None and ctx.leftover is offered:  # not taken: no later strategy gets it
                    ctx.drop_leftover()
            # A result may say more than "loaded" (`S3LoadResult.detail`: what a load kept of a failed one's, and
            # `reason` StoreSkipped: served from memory, the node's checkpoint store could not fit it).
            reason = getattr(result, "reason", AttemptReason.LOADED)
            ctx.record(strategy.name, AttemptOutcome.LOADED, reason, getattr(result, "detail", ""))
            publish(result, ctx)
            return result
    finally:
        ctx.drop_leftover()  # the last strategy's, or one left when the chain stopped
    detail = "; ".join(failures) if failures else "no strategies configured"
    raise LoadFailed(
        f"No load strategy succeeded for model {ctx.model!r} version {ctx.version!r} rank {ctx.rank}: {detail}",
        [a.to_status() for a in ctx.attempts],
    )
