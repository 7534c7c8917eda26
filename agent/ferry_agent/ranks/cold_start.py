"""Desired-version cold start of one replica's ranks (docs/ranks.md), over `ranks.agreement`.

`run_cold_start` is what every rank of a replica runs, one-rank replicas included (with `SingleRank`):

1. Rank 0's desired version is every rank's; a rank configured with another one is fatal for all.
2. No desired version: only the version-agnostic strategies run, and that is logged as a warning.
3. Otherwise the ranks agree on the source order, then run the strategy chain with every strategy wrapped so
   that its availability and its outcome are agreed:
   - `RankAgreedStrategy` (Peer, LocalFile): loaded / miss / fatal per rank; mixed or any fatal is fatal;
     all miss falls through to the next source, keeping `mutated`;
   - `RankAgreedObjectStorage`: the S3 phases (chain and local-leader prepare → loaded → activated), where any
     failure on any rank is fatal: there is no fallback after S3.

Every wrapper normalises its rank's exceptions into a value before the collective, so all ranks always call
the same collectives in the same order, and every rank raises the same error.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from ferry.api.models import SourceKind
from ferry_agent.ranks.agreement import (
    RankGroup,
    S3Steps,
    agree_desired_version,
    agree_peer_outcome,
    agree_phase,
    agree_source_order,
    s3_phases,
)
from ferry_agent.ranks.landing import MappedLanding, MapSealed, unaccounted
from ferry_agent.strategies.chain import (
    LoadContext,
    LoadResult,
    LoadStrategy,
    StrategyFailed,
    StrategyRecoveryError,
    run_strategy_chain,
)
from ferry_agent.strategies.object_storage.strategy import ObjectStorageStrategy, S3LoadResult

log = logging.getLogger(__name__)

DEFAULT_SOURCE_ORDER = tuple(SourceKind)
Release = Callable[[LoadResult], None]  # frees a result this rank loaded but the replica does not keep


class _Agreed:
    """Shared by the wrappers: the group, the pinned and configured versions, and agreed availability."""

    def __init__(self, inner: LoadStrategy, group: RankGroup, *, pinned: str, configured: str | None) -> None:
        self.inner = inner
        self.name = inner.name
        self._group = group
        self._pinned = pinned
        self._configured = configured

    def _agree(self, phase: str, result: Any) -> Any:
        return agree_phase(self._group, phase, pinned=self._pinned, configured=self._configured, result=result)

    def is_available(self, ctx: LoadContext) -> bool:
        try:
            local: bool | str = bool(self.inner.is_available(ctx))
        except Exception as exc:  # reported to every rank: one rank escaping alone would hang the others
            local = f"error: {type(exc).__name__}: {exc}"
        agreed = self._agree(f"{self.name}_available", local)
        if isinstance(agreed, str):
            raise StrategyRecoveryError(f"{self.name}: checking availability failed on every rank: {agreed}")
        return agreed


class RankAgreedStrategy(_Agreed):
    """A version-exact strategy every rank runs for its own tensors; the outcome must be the same on all."""

    def __init__(
        self, inner: LoadStrategy, group: RankGroup, *, pinned: str, configured: str | None, release: Release
    ) -> None:
        super().__init__(inner, group, pinned=pinned, configured=configured)
        self._release = release
        self._held: LoadResult | None = None
        self._missed = False

    def load(self, ctx: LoadContext) -> LoadResult:
        self._missed = False
        result: Any = None
        failure: Exception | None = None
        try:
            result = self.inner.load(ctx)
            outcome = "loaded"
        except StrategyRecoveryError as exc:
            failure, outcome = exc, "fatal"
        except StrategyFailed as exc:
            failure, outcome = exc, "miss"
        except Exception as exc:  # as in ModelExpress: an unexpected error is a miss that mutated nothing
            failure, outcome = StrategyFailed(f"{type(exc).__name__}: {exc}", mutated=False), "miss"
        self._held = result
        try:
            agreed = agree_peer_outcome(
                self._group,
                outcome,
                phase=f"{self.name}_outcome",
                pinned=self._pinned,  # type: ignore[arg-type]
                configured=self._configured,
            )
        except StrategyRecoveryError as exc:
            local = f"; here (rank {ctx.rank}): {failure}" if failure else ""
            raise StrategyRecoveryError(f"{self.name} for {self._pinned!r}: {exc}{local}") from failure
        if agreed == "miss":
            assert failure is not None
            self._missed = True
            raise failure
        self._held = None  # kept by the caller now
        return result

    def rollback(self, ctx: LoadContext) -> None:
        """After an agreed miss the chain goes on to the next source on every rank, so the rollback is agreed
        too: one rank failing to clean up alone would leave the others waiting in the next collective."""
        held, self._held = self._held, None
        failure: Exception | None = None
        try:
            if held is not None:
                self._release(held)
            self.inner.rollback(ctx)
        except Exception as exc:
            failure = exc
        if self._missed:
            self._missed = False
            self._agree(f"{self.name}_rollback", None if failure is None else f"{type(failure).__name__}: {failure}")
        if failure is not None:
            raise failure


class RankAgreedObjectStorage(_Agreed):
    """The S3 cold start in lockstep. What the node's store lacks, the local leader streams once (a full
    checkpoint, or a delta replay on the stored base): its own tensors into its pool, the other ranks' into
    sealed shared memory (`ranks.landing`), which they serve as it is (on `cpu`; a GPU rank copies its share
    out); the store entries are written behind once every rank has loaded. When the store holds the version,
    the leader only marks it prepared and every rank reads its own share from the store at the same time.
    `map_sealed` takes a follower's landed chunks over (its host store's)."""

    inner: ObjectStorageStrategy

    def __init__(
        self,
        inner: ObjectStorageStrategy,
        group: RankGroup,
        *,
        pinned: str,
        configured: str | None,
        local_rank: int | None = None,
        map_sealed: MapSealed = unaccounted,
    ) -> None:
        super().__init__(inner, group, pinned=pinned, configured=configured)
        self._map_sealed = map_sealed
        self._leader = (group.rank if local_rank is None else local_rank) == 0
        self._local_rank = local_rank
        self._result: S3LoadResult | None = None
        self._prepared = False

    def load(self, ctx: LoadContext) -> S3LoadResult:
        self._result, self._prepared = None, False
        if self._group.world_size == 1:
            # Nobody to agree with: the one-rank load itself (a full checkpoint the store lacks streams straight
            # into the pool, each tensor usable as soon as it is checked; the store is written behind).
            return self.inner.load(ctx)
        chain: list[tuple[str, ...]] = []
        mapped: list[MappedLanding] = []

        def resolve() -> tuple[str, ...]:
            chain.append(self.inner.resolve(ctx))
            return chain[0]

        def prepare() -> dict[str, Any] | None:
            """The leader's step; what it returns tells every rank where to load from (None: the store)."""
            self._result = self.inner.lead(ctx)
            if self._result is not None and self._result.landed is not None:
                return {"landing": self._result.landed.landing.descriptor(), "version_uid": ctx.version_uid}
            self._prepared = True  # in the store, for `activate` or `release_prepared`
            return None

        def load(prepared: dict[str, Any] | None) -> None:
            if self._result is not None:  # the leader loaded its tensors while preparing
                return
            if prepared is None:  # every rank reads its share from the store, the leader's too, at once
                self._result = self.inner.load_prepared(ctx)
                return
            try:
                mapped.append(MappedLanding(prepared["landing"], self._group.rank))
            except (OSError, ValueError) as exc:
                raise StrategyFailed(f"ObjectStorage: cannot map the local leader's landing: {exc}") from exc
            ctx.version_uid = prepared["version_uid"]
            if torch.device(ctx.device).type == "cpu":
                self._result = self._map_share(ctx, mapped[0])
            else:
                self._result = self.inner.load_landed(ctx, mapped[0])

        def activate() -> None:
            assert self._result is not None
            if self._result.landed is not None:
                self.inner.commit_landed(self._result.landed)
            else:
                self.inner.activate(ctx, chain[0])
                self._prepared = False

        try:
            s3_phases(
                self._group,
                S3Steps(resolve, prepare, load, activate),
                pinned=self._pinned,
                configured=self._configured,
                local_rank=self._local_rank,
            )
        finally:
            for landing in mapped:  # descriptors not taken over by this rank's share
                landing.close()

        result, self._result = self._result, None
        assert result is not None
        # The landing is the store write's now (it holds the pages until written), not the served result's.
        return dataclasses.replace(result, landed=None)

    def _map_share(self, ctx: LoadContext, landing: MappedLanding) -> S3LoadResult:
        """A follower on `cpu`: its share is the leader's sealed landing itself, mapped read-only (no copy, no S3 or
        store read; the leader checked every tensor as it landed, and the seals keep those bytes)."""
        t0 = time.monotonic()
        try:
            resident = landing.share(ctx.expected_manifest_digest, self._map_sealed)
        except (OSError, ValueError) as exc:
            raise StrategyFailed(f"ObjectStorage: cannot take this rank's share of the landing: {exc}") from exc
        seconds = time.monotonic() - t0
        log.info(
            "rank %d/%d mapped %s (%d bytes) from the local leader's landing in %.3fs",
            ctx.rank,
            ctx.world_size,
            ctx.version,
            resident.total_bytes,
            seconds,
        )
        return S3LoadResult(resident, resident.total_bytes, 0, (), None, seconds, {"map": round(seconds, 6)})

    def rollback(self, ctx: LoadContext) -> None:
        if self._result is not None and self._result.landed is not None:
            self._result.landed.landing.close()  # never stored: the other ranks gave up with this one
        self._result = None  # never registered: dropping it frees it
        if self._prepared:
            self._prepared = False
            self.inner.release_prepared(ctx)


def run_cold_start(
    group: RankGroup,
    ctx: LoadContext,
    *,
    configured: str | None,
    source_order: Sequence[str],
    strategies: Mapping[str, LoadStrategy],
    exact: Sequence[LoadStrategy] = (),
    version_agnostic: Sequence[LoadStrategy] = (),
    release: Release = lambda _result: None,
    reinit: Callable[[LoadContext], None] = lambda _ctx: None,
    publish: Callable[[LoadResult, LoadContext], None] = lambda _result, _ctx: None,
    local_rank: int | None = None,
    map_sealed: MapSealed = unaccounted,
) -> LoadResult:
    """Load this rank of a replica. `strategies` maps source names (`Peer`, `ObjectStorage`) to this rank's
    strategies; `exact` are further version-exact sources tried after the source order (a local seed);
    `version_agnostic` is all that runs when rank 0 has no desired version; `map_sealed` takes over a follower's
    share of its leader's landing (the rank's host store). Sets `ctx.version` to the agreed
    version and returns the chain's result; every disagreement raises StrategyRecoveryError on every rank."""
    desired = agree_desired_version(group, configured)
    if desired is None:
        log.warning(
            "rank %d: no desired version, so only the version-agnostic strategies run (%s): no peer or S3 load",
            group.rank,
            ", ".join(s.name for s in version_agnostic) or "none",
        )
        ctx.version = ""
        return run_strategy_chain(version_agnostic, ctx, reinit=reinit, publish=publish)
    ctx.version = desired
    unknown = [s for s in source_order if s not in DEFAULT_SOURCE_ORDER]
    if unknown:
        raise ValueError(
            f"unknown source(s) {unknown} in the source order; known: {[str(s) for s in DEFAULT_SOURCE_ORDER]}"
        )
    # What this rank can use, in order: a rank lacking one (no checkpoint store) disagrees and so is fatal.
    order = agree_source_order(
        group, [s for s in source_order if s in strategies], pinned=desired, configured=configured
    )
    chain: list[LoadStrategy] = []
    for name in order:
        inner = strategies[name]
        if isinstance(inner, ObjectStorageStrategy):
            chain.append(
                RankAgreedObjectStorage(
                    inner, group, pinned=desired, configured=configured, local_rank=local_rank, map_sealed=map_sealed
                )
            )
        else:
            chain.append(RankAgreedStrategy(inner, group, pinned=desired, configured=configured, release=release))
    chain.extend(RankAgreedStrategy(s, group, pinned=desired, configured=configured, release=release) for s in exact)
    return run_strategy_chain(chain, ctx, reinit=reinit, publish=publish)
