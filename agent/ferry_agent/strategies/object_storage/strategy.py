"""The ObjectStorage load strategy: a WeightVersion's weights from S3, through the node's checkpoint store.

ModelExpress semantics, in four phases:

1. Resolve the replay chain with the operator's `resolve_chain` (at most 64 links, rooted at a FullCheckpoint).
   Every link must be Ready, of this model, and stored in S3.
2. Validate everything before changing anything: every index (canonical shape, delta identity, safe shard names)
   and every shard header (exact object size, the tensor set the index promises, checksums), delta tensors
   against the root's layout. Loading starts from the newest version of the chain the store already holds, so
   only what is missing is fetched (and validated) from S3.
3. Download what is missing with parallel ranged GETs into the store (tmp + fsync + rename), checking every full
   tensor's adler32 before the rename. A one-rank load of a full checkpoint the store lacks streams instead
   (`stream`): the ranged GETs read straight into the new pool, each tensor checked as its last range lands, and
   the store entry is written behind the load (`CheckpointStore.write_behind`, still tmp + fsync + rename), so
   the replica serves without waiting for the disk. A multi-rank leader streams such a load too (`lead` returns
   it `landed`): the other ranks' tensors land in sealed memfd chunks of each rank's own (`ranks.landing`) that
   they map (or copy their shares from: `load_landed`), and the store entry is queued only once every rank has
   loaded (`commit_landed`). When the store holds the version, `lead` only marks it prepared and every rank reads
   its own share from the store at once (`load_prepared`).
4. Build the target in one pass per tensor, in parallel: read the base bytes straight into a freshly allocated
   `ResidentWeights` pool (CPU: the agent's host store; through a host buffer for other devices), from the store,
   or from the base version's sealed host memory when a pod still holds that very version (then the tensors no
   delta changes are not copied at all: the new version shares the base's chunks), check their adler32, apply
   each delta in place (streamed zstd, numpy XOR) checking the exact decoded size and adler32 after each, and
   write the result to `materialized/<target>` (tmp + fsync + rename). Then activate the version in the store.
   A replay into a CPU pool whose base the store holds streams instead (`replay`): the deltas the store lacks
   are fetched with ranged GETs into memory, each tensor is built (base XOR each decoded frame, adler32 after
   each) in the thread its last frame lands in, straight into the new pool (a multi-rank leader: its own share
   there, every other rank's into that rank's landing, as above), and the fetched deltas and
   `materialized/<target>` are written behind the load (for a multi-rank replica, once every rank has loaded).
   A chain whose base the store lacks is fetched into the store first (above). A multi-rank leader on another
   device than `cpu` still builds a delta into the store, which the other ranks read.

A write-behind stores and activates only after the load returned; until then the store stays at its last
activated version, and a crash leaves only what `CheckpointStore.recover()` removes.

A stored artifact is used only for the exact versions it was written from (namespace, WeightVersion uid, storage
URI, index digest: `store.checkpoints.VersionIdentity`); an index fetched from S3 must have the sha256 the operator
recorded as `status.indexDigest` when it verified the version. Every S3 request is bounded by the transfer
timeout (`spec.transfer.timeoutSeconds`: all tries of one request together), and the S3 object a load waits on
is its progress `source`, so a hung endpoint fails the load in bounded time and a stall names what it waits on.

Every failure is `StrategyFailed(mutated=False)`: the new pool is never handed out, so nothing the replica served
changes, and the store goes back to its last activated version. An artifact found corrupt is discarded, so a
retry downloads it again.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from ferry import s3
from ferry.ambient import AmbientCredentialsDenied
from ferry.api.models import AttemptReason, SourceKind
from ferry_agent.ranks.landing import Landing, MappedLanding
from ferry_agent.ranks.sharding import rank_of_tensors
from ferry_agent.store.checkpoints import CheckpointCacheCapacityError, CheckpointStore, chain_refs
from ferry_agent.store.resident import ResidentWeights, TensorSpec, manifest_digest
from ferry_agent.strategies.chain import Leftover, LoadContext, StrategyFailed
from ferry_agent.strategies.object_storage.build import build, unchanged_since
from ferry_agent.strategies.object_storage.checkpoint import Link, LoadError, Plan
from ferry_agent.strategies.object_storage.download import download
from ferry_agent.strategies.object_storage.plan import Planner
from ferry_agent.strategies.object_storage.replay import Replayed, replay, store_replay_behind
from ferry_agent.strategies.object_storage.stream import Streamed, store_full_behind, stream
from ferry_agent.strategies.progress import Progress
from ferry_agent.transport.worker_service import DEFAULT_TRANSFER_TIMEOUT_S

log = logging.getLogger(__name__)

MIB = 1 << 20
DEFAULT_RANGE_BYTES = 16 * MIB
SOURCE = "s3"


@dataclass(frozen=True)
class S3LoadResult:
    resident: ResidentWeights
    bytes_moved: int  # bytes placed in memory (the version's tensor bytes)
    bytes_downloaded: int  # fetched from S3 by this load; 0 when the store already held everything
    chain: tuple[str, ...]  # root → target
    reused: str | None  # the stored artifact the load started from, e.g. "materialized/v2"
    seconds: float
    timings: Mapping[str, float]  # seconds per phase: validate, download (+ checks), build, commit (fsync + rename)
    source: str = SOURCE
    # A multi-rank leader's streamed load: the other ranks' tensors, and the store write held back until every
    # rank has loaded (`commit_landed`).
    landed: Landed | None = None
    detail: str = ""  # the attempt's message: what the load kept of a failed strategy's target, a skipped store
    reason: AttemptReason = AttemptReason.LOADED  # the attempt's: StoreSkipped when served from memory only

    @property
    def source_label(self) -> str:
        return self.source


@dataclass(frozen=True)
class Landed:
    landing: Landing
    store: Callable[[], None]  # queues the store's write-behind of the whole checkpoint (under the store lock)


class ObjectStorageStrategy:
    """Loads a WeightVersion from object storage, replaying its full + XOR-delta chain through `store`."""

    name = SourceKind.OBJECT_STORAGE

    def __init__(
        self,
        *,
        namespace: str,
        fetch_version: Callable[[str], Mapping[str, Any] | None],
        credentials: Callable[[Mapping[str, Any]], Mapping[str, str] | None],
        store: CheckpointStore,
        default_endpoint: str | None = None,
        download_workers: int = 8,
        progress: Progress | None = None,
        range_bytes: int = DEFAULT_RANGE_BYTES,
        timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S,
        allocate: Callable[[Sequence[TensorSpec], str], ResidentWeights] = ResidentWeights.allocate,
        held: Callable[[], Sequence[Any]] = tuple,
        on_checked: Callable[[str, str], None] | None = None,
    ) -> None:
        """`fetch_version(name)`: the WeightVersion object (a dict) of that name in the replica's `namespace`, or
        None. `credentials(storage)`: S3 credentials for a `spec.storage` dict, or None for the environment's.
        `timeout_s` bounds each S3 request, all its tries together (the replica's `spec.transfer.timeoutSeconds`).
        `allocate(specs, device)`: the target's memory (the agent's host store on `cpu`). `held()`: the versions of
        the replica sealed in that host store (`memstore.SealedVersion`), which a one-rank replay may start from.
        `on_checked(name, adler32)`: a tensor of the target passed its check (a load that serves while it loads)."""
        if download_workers < 1 or range_bytes < 1 or timeout_s <= 0:
            raise ValueError("download_workers, range_bytes and timeout_s must be positive")
        self._namespace = namespace
        self._timeout_s = float(timeout_s)
        self._fetch_version = fetch_version
        self._credentials = credentials
        self._store = store
        self._default_endpoint = default_endpoint
        self._workers = download_workers
        self._progress = progress
        self._range_bytes = range_bytes
        self._allocate = allocate
        self._held = held
        self._on_checked = on_checked
        self._planner = Planner(
            namespace=namespace, fetch_version=fetch_version, store=store, client=self._client, progress=progress
        )

    # ------------------------------------------------------------------ LoadStrategy

    def is_available(self, ctx: LoadContext) -> bool:
        """The target version exists and is stored in S3. Errors reading it escape, as the chain expects."""
        body = self._fetch_version(ctx.version)
        return body is not None and bool(((body.get("spec") or {}).get("storage") or {}).get("uri"))

    def load(self, ctx: LoadContext) -> S3LoadResult:
        """Replay `ctx.version` into a new pool and activate it in the store (a one-rank replica); every failure
        is StrategyFailed(mutated=False)."""
        result = self._prepare(ctx, activate=True, land=False)
        assert result is not None
        return result

    def resolve(self, ctx: LoadContext) -> tuple[str, ...]:
        """The replay chain of `ctx.version`, root first (the ranks of a replica agree on it first)."""
        with self._failures():
            return tuple(link.name for link in self._planner.resolve(ctx))

    def lead(self, ctx: LoadContext) -> S3LoadResult | None:
        """A multi-rank local leader's step. What the store lacks is streamed once: a full checkpoint, or a delta
        replay on the stored base (a base the store lacks is fetched into it first), this rank's share into its
        new pool and every other rank's into a sealed landing they map (the result's `landed`); nothing is stored
        until `commit_landed`. When the store holds the target, it is only marked prepared and None is returned:
        every rank, this one included, then reads its own share from the store at once (`load_prepared`)."""
        return self._prepare(ctx, activate=False, land=True)

    def _prepare(self, ctx: LoadContext, *, activate: bool, land: bool) -> S3LoadResult | None:
        t0 = time.monotonic()
        timings: dict[str, float] = {}
        with self._failures():
            links = self._planner.resolve(ctx)
            with (
                self._store.lock(),
                ThreadPoolExecutor(self._workers, thread_name_prefix="ferry-s3") as pool,
                self._holding(ctx, activate) as held,
            ):
                plan = self._planner.plan(ctx, links, pool, held=held)
                timings["validate"] = time.monotonic() - t0
                if land and not plan.deltas and plan.base.path is not None:
                    with self._store.update(plan.model, ctx.version, plan.chain, protect=[plan.base.ref]) as update:
                        update.commit(activate=False)
                    ctx.version_uid = links[-1].uid
                    log.info("%s is in this node's store (%s): prepared for every rank", ctx.version, plan.reused)
                    return None
                resident, downloaded, landed, behind, detail, skipped = self._execute(
                    ctx, plan, pool, timings, activate=activate, land=land
                )
        ctx.version_uid = links[-1].uid
        return self._result(
            ctx, plan, resident, downloaded, t0, timings, landed, behind=behind, detail=detail, skipped=skipped
        )

    @contextlib.contextmanager
    def _holding(self, ctx: LoadContext, activate: bool) -> Iterator[list[Any]]:
        """The held versions a one-rank CPU replay may start from, each referenced until the load is done (one
        freed meanwhile is left out)."""
        held: list[Any] = []
        if activate and ctx.world_size == 1 and torch.device(ctx.device).type == "cpu":
            for version in self._held():
                with contextlib.suppress(RuntimeError):
                    version.ref()
                    held.append(version)
        try:
            yield held
        finally:
            for version in held:
                version.unref()

    def _require_prepared(self, ctx: LoadContext, chain: tuple[str, ...]) -> None:
        if self._store.prepared_head(self._planner.key(ctx), chain) is None:
            raise LoadError(
                f"{ctx.version} (chain {' → '.join(chain)}) is neither prepared nor active in this node's checkpoint "
                f"store {self._store.root}; every rank of a replica must share its node's store"
            )

    def load_prepared(self, ctx: LoadContext) -> S3LoadResult:
        """Another rank's step: load this rank's tensors from what the local leader prepared (checking every
        tensor's adler32), without fetching or changing anything in the store."""
        t0 = time.monotonic()
        timings: dict[str, float] = {}
        with self._failures():
            links = self._planner.resolve(ctx)
            chain = tuple(link.name for link in links)
            with ThreadPoolExecutor(self._workers, thread_name_prefix="ferry-s3") as pool:
                with self._store.lock():
                    self._require_prepared(ctx, chain)
                    plan = self._planner.plan(ctx, links, pool, remote=False)
                if plan.deltas:
                    raise LoadError(f"no materialized {ctx.version} in the store: the local leader did not build it")
                timings["validate"] = time.monotonic() - t0
                # The prepared chain is protected in the store's state, so it is read outside the lock.
                resident = build(self._store, self._allocate, ctx, plan, pool, timings)
        ctx.version_uid = links[-1].uid
        return self._result(ctx, plan, resident, 0, t0, timings)

    def activate(self, ctx: LoadContext, chain: Sequence[str]) -> None:
        """Mark the prepared version active in the store (protecting its chain from eviction)."""
        with self._failures():
            try:
                self._store.activate(self._planner.key(ctx), ctx.version, chain)
            except RuntimeError as exc:
                raise LoadError(str(exc)) from exc

    def load_landed(self, ctx: LoadContext, landing: MappedLanding) -> S3LoadResult:
        """Another rank's step when its local leader streamed the version: this rank's share, copied from the
        leader's sealed landing (checked there as it arrived), without touching S3 or the store."""
        t0 = time.monotonic()
        with self._failures():
            try:
                landing.check(ctx.expected_manifest_digest)
            except ValueError as exc:
                raise LoadError(str(exc)) from exc
            try:
                resident = self._allocate(landing.specs, ctx.device)
            except (RuntimeError, ValueError) as exc:
                nbytes = sum(s.nbytes for s in landing.specs)
                raise LoadError(f"cannot allocate {nbytes} bytes on {ctx.device}: {exc}") from exc
            with ThreadPoolExecutor(self._workers, thread_name_prefix="ferry-landing") as pool:
                landing.copy_share(resident, pool)
        seconds = time.monotonic() - t0
        log.info(
            "rank %d/%d copied %s (%d bytes) from the local leader's landing in %.2fs",
            ctx.rank,
            ctx.world_size,
            ctx.version,
            resident.total_bytes,
            seconds,
        )
        return S3LoadResult(resident, resident.total_bytes, 0, (), None, seconds, {"copy": round(seconds, 6)})

    def commit_landed(self, landed: Landed) -> None:
        """Every rank loaded what the leader landed: store the checkpoint behind (which activates it there)."""
        landed.landing.close()
        with self._failures(), self._store.lock():
            landed.store()

    def release_prepared(self, ctx: LoadContext) -> None:
        """Undo `lead`'s marking of a stored version prepared when the replica gives up: the store forgets it."""
        self._store.release_prepared(self._planner.key(ctx), ctx.version)

    @contextlib.contextmanager
    def _failures(self) -> Iterator[None]:
        """Every failure is StrategyFailed(mutated=False); an artifact found corrupt is discarded first, so that
        a retry fetches it again instead of failing the same way forever."""
        try:
            yield
        except LoadError as exc:
            if exc.discard is not None:
                self._store.discard(exc.discard)
            denied = isinstance(exc.__cause__, AmbientCredentialsDenied)
            reason = AttemptReason.AMBIENT_CREDENTIALS_DENIED if denied else None
            raise StrategyFailed(f"ObjectStorage: {exc}", mutated=False, reason=reason) from exc
        except OSError as exc:  # local I/O (disk full, permissions): the new pool was never handed out
            raise StrategyFailed(f"ObjectStorage: local checkpoint store I/O failed: {exc}", mutated=False) from exc

    @staticmethod
    def _result(
        ctx: LoadContext,
        plan: Plan,
        resident: ResidentWeights,
        downloaded: int,
        t0: float,
        timings: dict[str, float],
        landed: Landed | None = None,
        *,
        behind: bool = False,
        detail: str = "",
        skipped: bool = False,
    ) -> S3LoadResult:
        seconds = time.monotonic() - t0
        checksums = plan.target_checksums
        if all(name in checksums for name in resident.tensors):  # what the load checked every tensor against
            resident.checksums = {name: checksums[name] for name in resident.tensors}
        log.info(
            "rank %d/%d loaded %s (%d bytes, chain %s) from %s in %.2fs, %d bytes downloaded%s",
            ctx.rank,
            ctx.world_size,
            ctx.version,
            resident.total_bytes,
            " → ".join(plan.chain),
            plan.reused or "S3",
            seconds,
            downloaded,
            "; streamed, the store is written behind" if behind else "; served from memory only" if skipped else "",
        )
        return S3LoadResult(
            resident=resident,
            bytes_moved=resident.total_bytes,
            bytes_downloaded=downloaded,
            chain=plan.chain,
            reused=plan.reused,
            seconds=seconds,
            timings={k: round(v, 6) for k, v in timings.items()},
            landed=landed,
            detail=detail,
            reason=AttemptReason.STORE_SKIPPED if skipped else AttemptReason.LOADED,
        )

    def rollback(self, ctx: LoadContext) -> None:
        """Nothing is held after `load` returns or raises: the store restores its own state."""

    def _client(self, link: Link) -> Any:
        endpoint = link.storage.get("endpoint") or self._default_endpoint
        region = link.storage.get("region")
        try:
            creds = self._credentials(link.storage)
        except AmbientCredentialsDenied as exc:  # the message says it all; no request was made
            raise LoadError(str(exc)) from exc
        except Exception as exc:
            raise LoadError(f"no S3 credentials for {link.uri}: {exc}") from exc
        return s3.client(endpoint, region, creds, s3.bulk_download(self._workers, self._timeout_s))

    def _execute(
        self,
        ctx: LoadContext,
        plan: Plan,
        pool: ThreadPoolExecutor,
        timings: dict[str, float],
        *,
        activate: bool,
        land: bool = False,
    ) -> tuple[ResidentWeights, int, Landed | None, bool, str, bool]:
        """The new pool, the bytes downloaded, the other ranks' landing, whether the store is written behind, what
        the load kept of a failed one's and why it skipped the store (`S3LoadResult.detail`), and whether it did."""
        fetch = [c for c in plan.deltas if c.path is None]
        if plan.base.path is None and plan.held is None:
            fetch.insert(0, plan.base)
        downloaded = sum(c.stored_bytes for c in fetch)
        needed = downloaded + (plan.base.stored_bytes if plan.deltas else 0)  # + the materialized target
        alone = activate and ctx.world_size == 1  # no other rank reads what this load stores
        full_stream = alone and fetch == [plan.base] and not plan.deltas  # stored deltas need a replay
        leftover = self._leftover(ctx, plan) if full_stream else None
        ctx.drop_leftover()  # one no path here takes is freed before this load allocates its own pool
        if full_stream:
            try:
                resident, streamed, skipped = self._stream(ctx, plan, pool, timings, needed, leftover=leftover)
            except BaseException:
                if leftover is not None:  # taken over, so the chain no longer frees it
                    leftover.release()
                raise
            if not skipped:
                store_full_behind(self._store, plan, streamed)
            if streamed.kept:
                detail = (
                    f"{streamed.kept} of {len(resident.tensors)} tensors ({streamed.kept_bytes} bytes) kept from the "
                    f"failed load, {streamed.fetched} bytes downloaded"
                )
                log.info("%s: %s", ctx.version, detail)
                both = "; ".join(filter(None, (detail, skipped)))
                return resident, streamed.fetched, None, not skipped, both, bool(skipped)
            return resident, downloaded, None, not skipped, skipped, bool(skipped)
        on_cpu = torch.device(ctx.device).type == "cpu"
        streamed_full = not plan.deltas and fetch == [plan.base]
        if land and not activate and ctx.world_size > 1 and (streamed_full or (plan.deltas and on_cpu)):
            # A multi-rank leader: the other ranks' shares land in shared memory they map, not in the store.
            if plan.deltas and plan.base.path is None and plan.held is None:
                self._fetch_base(ctx, plan, pool, timings)
                needed -= plan.base.stored_bytes
            resident, landed, skipped = self._land_ranks(ctx, plan, pool, timings, needed)
            return resident, downloaded, landed, not skipped, skipped, bool(skipped)
        stored_or_held = plan.base.path is not None or plan.held is not None
        if alone and plan.deltas and stored_or_held and on_cpu:
            # A one-rank replay on a stored or held base into a CPU pool: the deltas stream, the store is written
            # behind.
            resident, replayed, skipped = self._replay(ctx, plan, pool, timings, needed)
            if not skipped:
                store_replay_behind(self._store, plan, replayed, every_version=False)
            return resident, downloaded, None, not skipped, skipped, bool(skipped)
        with self._store.update(plan.model, ctx.version, plan.chain, protect=[plan.base.ref]) as update:
            try:
                self._store.reserve(needed)
            except CheckpointCacheCapacityError as exc:
                raise LoadError(str(exc)) from exc
            if fetch:
                download(self._store, fetch, pool, timings, report=self._progress, range_bytes=self._range_bytes)
            resident = build(self._store, self._allocate, ctx, plan, pool, timings, on_checked=self._on_checked)
            update.commit(activate=activate)
        return resident, downloaded, None, False, "", False

    def _replay(
        self,
        ctx: LoadContext,
        plan: Plan,
        pool: ThreadPoolExecutor,
        timings: dict[str, float],
        needed: int,
        *,
        into: Mapping[str, np.ndarray] | None = None,
    ) -> tuple[ResidentWeights, Replayed, str]:
        """A replay whose base the store or host memory holds: the deltas the store lacks stream from S3 and each
        tensor is built as its frames land (`replay`; tensors the new pool lacks into `into`); the caller writes
        the store behind from what it returns unless the store is skipped (the note, `_allocate_for`)."""
        resident, skipped = self._allocate_for(ctx, plan, needed, timings)
        replayed = replay(
            plan,
            resident,
            pool,
            timings,
            report=self._progress,
            range_bytes=self._range_bytes,
            workers=self._workers,
            on_checked=self._on_checked,
            into=into,
        )
        return resident, replayed, skipped

    def _landing(self, ctx: LoadContext, plan: Plan) -> Landing:
        """Memfd chunks of each other rank's own for its share of the target (`ranks.landing`)."""
        specs = plan.tensor_specs
        owner = rank_of_tensors(specs, ctx.world_size)
        shares: dict[int, list[TensorSpec]] = {}
        for spec in specs:
            if owner[spec.name] != ctx.rank:
                shares.setdefault(owner[spec.name], []).append(spec)
        try:
            # memfd names: < 250 bytes
            return Landing(shares, f"landing:{plan.model}/{ctx.version}"[:200], plan.target_checksums)
        except OSError as exc:
            raise LoadError(f"cannot allocate the other ranks' landing in host memory: {exc}") from exc

    def _land_ranks(
        self, ctx: LoadContext, plan: Plan, pool: ThreadPoolExecutor, timings: dict[str, float], needed: int
    ) -> tuple[ResidentWeights, Landed, str]:
        """A multi-rank leader's load the store lacks, streamed once from S3: a full checkpoint (`_stream`) or a
        delta replay (`_replay`), this rank's share into its new pool and every other rank's into a sealed landing
        they map (`ranks.landing`); the store entry (the checkpoint, or the fetched deltas and
        materialized/<target>) is written behind once every rank has loaded (`commit_landed`), unless the store
        is skipped (the note, `_allocate_for`)."""
        landing = self._landing(ctx, plan)
        try:
            if plan.deltas:
                resident, replayed, skipped = self._replay(ctx, plan, pool, timings, needed, into=landing.views)
                behind = partial(store_replay_behind, self._store, plan, replayed, every_version=True)
            else:
                resident, streamed, skipped = self._stream(ctx, plan, pool, timings, needed, into=landing.views)
                behind = partial(store_full_behind, self._store, plan, streamed)
            landing.seal()
        except BaseException:
            landing.close()
            raise
        return resident, Landed(landing, _nothing if skipped else behind), skipped

    def _fetch_base(self, ctx: LoadContext, plan: Plan, pool: ThreadPoolExecutor, timings: dict[str, float]) -> None:
        """A multi-rank replay whose base the store lacks: the base is downloaded into the store first (on the
        critical path, as for a one-rank replay), then the deltas stream onto it."""
        with self._store.update(plan.model, ctx.version, plan.chain, protect=[plan.base.ref]):
            try:
                self._store.reserve(plan.base.stored_bytes)
            except CheckpointCacheCapacityError as exc:
                raise LoadError(str(exc)) from exc
            download(self._store, [plan.base], pool, timings, report=self._progress, range_bytes=self._range_bytes)

    def _stream(
        self,
        ctx: LoadContext,
        plan: Plan,
        pool: ThreadPoolExecutor,
        timings: dict[str, float],
        needed: int,
        *,
        into: Mapping[str, np.ndarray] | None = None,
        leftover: Leftover | None = None,
    ) -> tuple[ResidentWeights, Streamed, str]:
        """A full load the store lacks, streamed from S3 into the new pool (tensors it lacks into `into`), or into
        a failed load's `leftover`, fetching only what it did not check; the caller writes the store behind from
        what it returns unless the store is skipped (the note, `_allocate_for`)."""
        resident, skipped = self._allocate_for(ctx, plan, needed, timings, leftover)
        streamed = stream(
            plan,
            resident,
            pool,
            timings,
            report=self._progress,
            range_bytes=self._range_bytes,
            into=into,
            on_checked=self._on_checked,
            kept=leftover.checked if leftover is not None else None,
        )
        return resident, streamed, skipped

    @staticmethod
    def _leftover(ctx: LoadContext, plan: Plan) -> Leftover | None:
        """Takes over a failed strategy's target of this very manifest in host memory (a peer load whose holders
        all went away), so that the stream fetches only the tensors it did not check. Not one whose failed load
        checked a tensor against another checksum than the version's shard header lists: that holder's bytes are
        not the version's (and the target may still be served with them), so none of them is kept."""
        leftover = ctx.leftover
        if leftover is None:
            return None
        target = leftover.resident
        if target.device.type != "cpu" or target.shared or target.digest != manifest_digest(plan.specs):
            log.info("%s: the failed load's target is not this checkpoint's pool in host memory: not kept", ctx.version)
            return None
        listed = plan.base.checksums
        wrong = sorted(n for n, c in leftover.checked.items() if listed.get(n) != c)
        if wrong:
            log.warning(
                "%s: the failed load checked %d tensor(s) against other checksums than the version's (%s): none kept",
                ctx.version,
                len(wrong),
                ", ".join(wrong[:3]),
            )
            return None
        return ctx.take_leftover()

    def _allocate_for(
        self, ctx: LoadContext, plan: Plan, needed: int, timings: dict[str, float], leftover: Leftover | None = None
    ) -> tuple[ResidentWeights, str]:
        """The new pool of a load whose store entries are written behind (the `leftover`'s weights, when given),
        and why the store is skipped ("" when it is not). The store's room is made first, evicting nothing the
        load reads; a store that cannot fit the load is a cache that misses: the version is served from memory
        all the same, and nothing is written behind."""
        skipped = ""
        try:
            self._store.reserve(needed, protect=chain_refs(plan.model, plan.chain) | {plan.base.ref})
        except CheckpointCacheCapacityError as exc:
            skipped = f"served from memory, not stored: {exc}"
            log.warning("%s: %s", ctx.version, skipped)
        if leftover is not None:
            return leftover.resident, skipped
        t = time.monotonic()
        try:
            resident = self._allocate(plan.specs, ctx.device, unchanged_since(plan))
        except (RuntimeError, ValueError) as exc:  # e.g. out of device memory
            nbytes = sum(s.nbytes for s in plan.specs)
            raise LoadError(f"cannot allocate {nbytes} bytes on {ctx.device}: {exc}") from exc
        timings["allocate"] = time.monotonic() - t
        return resident, skipped


def _nothing() -> None:
    """A landed load's store write when the store was skipped."""
