"""Rank agreement for a desired-version cold start (docs/ranks.md).

The ranks of one replica load the same version or none of them does. Rank 0's desired version is every rank's;
every later step is all-gathered and any disagreement raises `StrategyRecoveryError` on every rank, so the
chain stops everywhere instead of one rank falling back to another source while the others load.

- `agree_desired_version`: rank 0's value wins; a rank configured with a different non-empty value is fatal.
  A rank with nothing configured follows rank 0 (one all-gather tells every rank rank 0's value).
- `agree_phase`: (phase, pinned, configured, result) must agree on every rank.
- `agree_source_order`, `agree_peer_outcome`: uniform, and a peer outcome is loaded | miss on all ranks or fatal.

Every collective carries its phase name (and, after the first, the pinned and configured versions), so ranks that
are out of step fail instead of agreeing by accident on values that happen to be equal.
- `s3_phases`: chain and local-leader prepare → loaded → activated; one rank's failure in any phase is fatal
  for all, and every rank's exception carries the failing ranks' error text.

Every function is a collective: all ranks of the group must call it in the same order.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, runtime_checkable

from ferry_agent.strategies.chain import StrategyRecoveryError

log = logging.getLogger(__name__)

PeerOutcome = Literal["loaded", "miss", "fatal"]
PEER_OUTCOMES: tuple[str, ...] = ("loaded", "miss", "fatal")
DEFAULT_TIMEOUT = dt.timedelta(minutes=5)
DESIRED_VERSION_PHASE = "desired_version"
SOURCE_ORDER_PHASE = "source_order"


@runtime_checkable
class RankGroup(Protocol):
    """The collective the agreement needs (vLLM's `all_gather_state` in ModelExpress)."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's `obj`, indexed by rank."""


class SingleRank:
    """A one-rank replica: every collective is the identity."""

    rank = 0
    world_size = 1

    def all_gather_object(self, obj: Any) -> list[Any]:
        return [obj]


class TorchRankGroup:
    """torch.distributed object collectives on a CPU (gloo) group: the default group, or `group` within it."""

    def __init__(self, group: Any = None, *, owned: bool = False) -> None:
        import torch.distributed as dist

        self._dist = dist
        self._group = group
        self._owned = owned

    @classmethod
    def init(
        cls,
        *,
        rank: int,
        world_size: int,
        store: Any = None,
        master_addr: str | None = None,
        master_port: int | None = None,
        timeout: dt.timedelta = DEFAULT_TIMEOUT,
    ) -> TorchRankGroup:
        """Initialise the default process group with gloo, from a store (TCPStore, FileStore) or over TCP at
        master_addr:master_port (default $MASTER_ADDR or 127.0.0.1, $MASTER_PORT). The timeout bounds every
        collective, so a dead peer fails the others instead of hanging them."""
        import torch.distributed as dist

        if store is None:
            addr = master_addr or os.environ.get("MASTER_ADDR", "127.0.0.1")
            port = master_port or int(os.environ.get("MASTER_PORT", "0"))
            if not port:
                raise ValueError("TorchRankGroup.init needs a store, a master_port or $MASTER_PORT")
            store = dist.TCPStore(addr, port, world_size, is_master=rank == 0, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        return cls(owned=True)

    @property
    def rank(self) -> int:
        return self._dist.get_rank(self._group)

    @property
    def world_size(self) -> int:
        return self._dist.get_world_size(self._group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        with _collective("all_gather"):
            self._dist.all_gather_object(out, obj, group=self._group)
        return out

    def close(self) -> None:
        if self._owned and self._dist.is_initialized():
            self._dist.destroy_process_group()
            self._owned = False

    def __enter__(self) -> TorchRankGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def _collective(what: str) -> Iterator[None]:
    """A collective that fails (a peer rank died, the group timed out) leaves this rank unable to agree on
    anything: the chain must stop here, not try the next source alone."""
    try:
        yield
    except RuntimeError as exc:  # gloo errors (DistBackendError, timeouts) are RuntimeErrors
        raise StrategyRecoveryError(f"rank group {what} failed: {exc}") from exc


# ---------------------------------------------------------------- agreement


def _ranks(values: Sequence[Any]) -> str:
    return "; ".join(f"rank {r}: {v!r}" for r, v in enumerate(values))


def _conflicts(pinned: str | None, configured: Sequence[Any]) -> list[tuple[int, Any]]:
    return [(r, c) for r, c in enumerate(configured) if c and c != pinned]


def agree_desired_version(group: RankGroup, configured: str | None) -> str | None:
    """Rank 0's desired version, on every rank. None (nothing configured on rank 0) means only the
    version-agnostic load path may run."""
    configured = configured or None  # an empty variable is "not set"
    # One all-gather: every rank learns rank 0's value (what a broadcast would tell it) and every rank's, to check.
    # Tagged with the phase, like every later collective: a rank out of step never reads another's payload as this.
    states = group.all_gather_object((DESIRED_VERSION_PHASE, configured))
    if any(not (isinstance(s, tuple) and len(s) == 2 and s[0] == DESIRED_VERSION_PHASE) for s in states):
        raise StrategyRecoveryError(f"phase disagreement during {DESIRED_VERSION_PHASE}: {_ranks(states)}")
    desired = states[0][1]
    if desired is not None and not isinstance(desired, str):
        raise StrategyRecoveryError(f"rank 0 sent a desired version of type {type(desired).__name__}")
    conflicts = _conflicts(desired, [s[1] for s in states])
    if conflicts:
        others = ", ".join(f"rank {r} is configured with {c!r}" for r, c in conflicts)
        raise StrategyRecoveryError(
            f"desired-version disagreement: rank 0 pins {desired!r} but {others}; every rank of a replica must load "
            "the same version"
        )
    if desired is None:
        log.warning(
            "no desired version configured on rank 0: only the version-agnostic load path runs "
            "(no desired-version peer or S3 strategy)"
        )
    else:
        log.info("rank %d/%d: desired version %s agreed", group.rank, group.world_size, desired)
    return desired


def _gather_phase(group: RankGroup, phase: str, pinned: str | None, configured: str | None, result: Any) -> list[Any]:
    """Every rank's result for `phase`, after checking all ranks are in the same phase with the same pinned
    version and no conflicting configured one."""
    configured = configured or None
    states = group.all_gather_object((phase, pinned, configured, result))
    for rank, state in enumerate(states):
        if not (isinstance(state, tuple) and len(state) == 4):
            raise StrategyRecoveryError(f"invalid phase state from rank {rank} during {phase}: {state!r}")
    if any(s[0] != phase for s in states):
        raise StrategyRecoveryError(f"phase disagreement during {phase}: {_ranks(states)}")
    if any(s[1] != pinned for s in states) or _conflicts(pinned, [s[2] for s in states]):
        raise StrategyRecoveryError(f"desired-version disagreement during {phase}: {_ranks(states)}")
    return [s[3] for s in states]


def agree_phase(group: RankGroup, phase: str, *, pinned: str | None, configured: str | None, result: Any) -> Any:
    """The result every rank got in `phase`; any difference in (phase, pinned, configured, result) is fatal."""
    results = _gather_phase(group, phase, pinned, configured, result)
    if any(r != results[0] for r in results):
        states = [(phase, pinned, configured or None, r) for r in results]
        raise StrategyRecoveryError(f"result disagreement during {phase}: {_ranks(states)}")
    return results[0]


def agree_source_order(
    group: RankGroup, order: Sequence[str], *, pinned: str | None, configured: str | None
) -> tuple[str, ...]:
    """The source order, which must be the same on every rank (a rank trying S3 while another waits on a peer
    would deadlock the later collectives)."""
    orders = _gather_phase(group, SOURCE_ORDER_PHASE, pinned, configured, tuple(order))
    if any(o != orders[0] for o in orders):
        raise StrategyRecoveryError(f"source order disagreement: {_ranks(orders)}")
    return orders[0]


def agree_peer_outcome(
    group: RankGroup, outcome: PeerOutcome, *, phase: str, pinned: str | None, configured: str | None
) -> PeerOutcome:
    """`loaded` or `miss` when every rank got it; mixed outcomes or any `fatal` → StrategyRecoveryError. A mixed
    loaded/miss is fatal because the loaded ranks hold a version the others would fetch from elsewhere. `phase`
    names the strategy (`Peer_outcome`), so ranks one source apart never agree on each other's outcome."""
    if outcome not in PEER_OUTCOMES:
        raise ValueError(f"peer outcome {outcome!r} is not one of {PEER_OUTCOMES}")
    outcomes = _gather_phase(group, phase, pinned, configured, outcome)
    fatal = [r for r, o in enumerate(outcomes) if o == "fatal"]
    if fatal:
        raise StrategyRecoveryError(f"peer load was fatal on rank(s) {fatal}: {_ranks(outcomes)}")
    if any(o != outcomes[0] for o in outcomes):
        raise StrategyRecoveryError(f"mixed peer outcomes: {_ranks(outcomes)}")
    return outcomes[0]


# ---------------------------------------------------------------- S3 cold start


@dataclass(frozen=True)
class S3Steps:
    """What each S3 phase does on this rank. `resolve_chain` runs on every rank and its (picklable) result must be
    the same everywhere; `prepare` runs on the local leader right after it, and what it returns is given to every
    rank's `load` (where to load from: the leader's landing, or the node's store); `activate` runs on the local
    leader only, once every rank has loaded."""

    resolve_chain: Callable[[], Any]
    prepare: Callable[[], Any]
    load: Callable[[Any], None]
    activate: Callable[[], None]


# The chain is resolved in the first phase, by every rank, while the leader prepares: one collective less on every
# load, and a chain disagreement is still found before any rank loads (the leader then drops what it prepared).
S3_PHASES = ("s3_local_leader_prepared", "s3_engine_loaded", "s3_checkpoint_activated")


def _run_phase(
    group: RankGroup, phase: str, step: Callable[[], Any] | None, *, pinned: str, configured: str | None
) -> list[Any]:
    """Run `step` here (None: nothing to do on this rank), then agree; any rank's failure is fatal for all."""
    failure: Exception | None = None
    outcome: tuple[str, Any] = ("ok", None)
    if step is not None:
        try:
            outcome = ("ok", step())
        except Exception as exc:  # reported to every rank, then raised here as the cause
            failure = exc
            outcome = ("err", f"{type(exc).__name__}: {exc}")
    outcomes = _gather_phase(group, phase, pinned, configured, outcome)
    errors = [(r, o[1]) for r, o in enumerate(outcomes) if o[0] != "ok"]
    if errors:
        text = "; ".join(f"rank {r}: {e}" for r, e in errors)
        raise StrategyRecoveryError(f"S3 cold start of {pinned!r} failed in {phase}: {text}") from failure
    log.debug("rank %d: %s agreed", group.rank, phase)
    return [o[1] for o in outcomes]


def s3_phases(
    group: RankGroup, steps: S3Steps, *, pinned: str, configured: str | None, local_rank: int | None = None
) -> Any:
    """Run the S3 cold-start phases in lockstep and return the agreed chain. `local_rank` 0 is the node's
    leader (default: the group rank, i.e. all ranks on one node, as a WeightReplica's are)."""
    leader = (group.rank if local_rank is None else local_rank) == 0
    leader_rank = 0 if local_rank is None else group.rank - local_rank  # a node's ranks are contiguous

    def resolve_and_prepare() -> tuple[Any, Any]:
        chain = steps.resolve_chain()
        return chain, steps.prepare() if leader else None

    outcomes = _run_phase(group, S3_PHASES[0], resolve_and_prepare, pinned=pinned, configured=configured)
    chains = [chain for chain, _ in outcomes]
    if any(c != chains[0] for c in chains):
        raise StrategyRecoveryError(f"replay chain disagreement for {pinned!r}: {_ranks(chains)}")
    prepared = outcomes[leader_rank][1]
    _run_phase(group, S3_PHASES[1], lambda: steps.load(prepared), pinned=pinned, configured=configured)
    _run_phase(group, S3_PHASES[2], steps.activate if leader else None, pinned=pinned, configured=configured)
    return chains[0]
