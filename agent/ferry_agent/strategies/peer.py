"""The Peer load strategy: READ a rank's weights from other replicas of the exact version, chunk by chunk.

Pipelined fan-out (`strategies.fanout`): the sources are Serving replicas and replicas still loading the version,
which serve the tensors they hold so far. The reader cuts the version into chunks and, until it holds every one,
takes a read lease on the holder `fanout.choose` names and READs every chunk it still needs that the lease covers:
one transfer per chunk, all posted at once, each chunk's tensors checked (adler32, the checksums the lease lists)
as it lands and only then counted as held (and served on, when the agent serves this load while it runs:
`on_verified`). A holder at its reader limit refuses (RESOURCE_EXHAUSTED) and another is chosen; a holder that fails
is dropped for this load and its chunks come from the others; with no live holder of a chunk left, the first
loader among the live replicas goes to object storage (this strategy fails, so the chain goes on to it, leaving it
the target with the tensors checked so far: `chain.Leftover`, so only the rest is fetched) and the others wait for
it. Against a Serving source with free slots this is one lease and the whole version, as before.

Per lease (so that a failed READ never leaves a half-open connection on the source):
  PrepareTensorRead lease → manifest checks → remote agent name claimed → add_remote (on failure:
  remove the claimed name, re-raise) → READ (errors wrapped as SourceTransferError) → device sync →
  finally remove_remote → outer finally release the lease.
Teardown therefore always runs transfer → sync → remove_remote → lease release, during the load and on
every path; nothing relies on process exit, and nothing is removed for a peer that was never claimed.
"""

from __future__ import annotations

import functools
import logging
import math
import random
import threading
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import torch

from ferry import checkpoint_format as ckpt
from ferry.api.models import AttemptOutcome, AttemptReason, SelectorKind, SourceKind
from ferry_agent.store.resident import ResidentWeights, TensorSpec
from ferry_agent.strategies.candidate import SourceCandidate
from ferry_agent.strategies.chain import Leftover, LoadContext, SourceTransferError, StrategyFailed
from ferry_agent.strategies.fanout import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_READERS,
    Chunk,
    HolderView,
    choose,
    chunks_held,
    lease_batch,
    lease_chunks,
    plan_chunks,
)
from ferry_agent.strategies.progress import Progress, ProgressThrottle
from ferry_agent.strategies.selector import Selector, make_selector
from ferry_agent.transport.holdings import HoldingsView
from ferry_agent.transport.nixl import ManifestMismatchError, RemoteTensor, TransferStalled
from ferry_agent.transport.worker_auth import TokenUnavailable
from ferry_agent.transport.worker_service import (
    DEFAULT_RPC_TIMEOUT_S,
    DEFAULT_TRANSFER_TIMEOUT_S,
    NO_RETRY,
    RetryPolicy,
    SourceCredentials,
    SourceIdentity,
    SourceManifest,
    get_holdings,
    prepare_tensor_read,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_SOURCE_ATTEMPTS = 3
DEFAULT_RPC_RETRIES = 3
DEFAULT_RPC_BACKOFF_S = 0.5
BUSY_BACKOFF_S = 0.05  # a holder at its reader limit is asked again after this, doubling (jittered) up to 0.4 s
HOLDINGS_WAIT_S = 0.25  # one long poll of a loading holder for more tensors
RELIST_S = 0.5  # while waiting, the sources are listed again (new holders, a new first loader) this often
GONE_RELIST_S = 0.1  # ... and this soon after a loading holder went away (it is most likely Serving now)
DEFAULT_STALL_S = 60.0  # spec.transfer.stallSeconds' default
TAKEOVER_S = 1.0  # no live holder of what is needed for this long (two listings) before the next loader reads S3


def transfer_timeout_seconds(value: object) -> float:
    """The per-candidate timeout. Anything unusable (non-numeric, <= 0, inf/nan) means the default,
    never "no timeout": a wedged transfer reports neither completion nor error."""
    if value is None:
        return DEFAULT_TRANSFER_TIMEOUT_S
    try:
        seconds = float(value) if not isinstance(value, bool) else math.nan
    except (TypeError, ValueError):
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        log.warning("invalid transfer timeout %r, using %gs", value, DEFAULT_TRANSFER_TIMEOUT_S)
        return DEFAULT_TRANSFER_TIMEOUT_S
    return seconds


@dataclass(frozen=True)
class TransferSettings:
    timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S  # per candidate: lease, handshake and READ together
    max_source_attempts: int = DEFAULT_MAX_SOURCE_ATTEMPTS
    selector: str = SelectorKind.RENDEZVOUS_HASH
    rpc_timeout_s: float = DEFAULT_RPC_TIMEOUT_S  # one Worker RPC; the lease release always gets this much
    progress_interval_s: float = 1.0
    rpc_retries: int = DEFAULT_RPC_RETRIES  # lease RPCs, on UNAVAILABLE only
    rpc_backoff_s: float = DEFAULT_RPC_BACKOFF_S
    max_readers: int = DEFAULT_MAX_READERS  # read leases one source grants at once (a source's own setting)
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # the reader's chunk: what one READ of a lease moves and checks
    # A holder whose READ completes no chunk for this long is dropped for the load (its chunks come from others,
    # or object storage): spec.transfer.stallSeconds, after which the ModelLoad reports the stall too.
    stall_s: float = DEFAULT_STALL_S

    def __post_init__(self) -> None:
        object.__setattr__(self, "timeout_s", transfer_timeout_seconds(self.timeout_s))
        if not isinstance(self.max_source_attempts, int) or self.max_source_attempts < 1:
            raise ValueError(f"maxSourceAttempts must be a positive integer, got {self.max_source_attempts!r}")
        if not isinstance(self.max_readers, int) or self.max_readers < 1:
            raise ValueError(f"maxReadersPerSource must be a positive integer, got {self.max_readers!r}")
        if not isinstance(self.chunk_bytes, int) or self.chunk_bytes < 1:
            raise ValueError(f"chunkMiB must be positive, got {self.chunk_bytes!r}")
        if isinstance(self.stall_s, bool) or not isinstance(self.stall_s, int | float) or not self.stall_s > 0:
            raise ValueError(f"stallSeconds must be positive, got {self.stall_s!r}")
        make_selector(self.selector)  # unknown selector names fail here, at configuration time
        _ = self.retry  # invalid retry settings fail here too

    @property
    def retry(self) -> RetryPolicy:
        return RetryPolicy(self.rpc_retries, float(self.rpc_backoff_s))

    @classmethod
    def from_spec(cls, transfer: Mapping[str, Any], **overrides: Any) -> TransferSettings:
        """From a ModelLoad `spec.transfer` mapping."""
        return cls(
            timeout_s=transfer.get("timeoutSeconds"),  # type: ignore[arg-type]  # validated in __post_init__
            max_source_attempts=transfer.get("maxSourceAttempts", DEFAULT_MAX_SOURCE_ATTEMPTS),
            selector=transfer.get("selector", SelectorKind.RENDEZVOUS_HASH),
            rpc_retries=transfer.get("rpcRetries", DEFAULT_RPC_RETRIES),
            rpc_backoff_s=transfer.get("rpcBackoffSeconds", DEFAULT_RPC_BACKOFF_S),
            max_readers=transfer.get("maxReadersPerSource", DEFAULT_MAX_READERS),
            chunk_bytes=int(transfer.get("chunkMiB", DEFAULT_CHUNK_BYTES >> 20)) << 20,
            stall_s=transfer.get("stallSeconds", DEFAULT_STALL_S),
            **overrides,
        )


class ReadLease(Protocol):
    manifest: SourceManifest
    holdings: HoldingsView  # the tensors the lease covers, with their checksums

    def close(self) -> None: ...


class SourceClient(Protocol):
    def prepare(self, candidate: SourceCandidate, *, reader: str, timeout_s: float) -> ReadLease: ...

    def holdings(
        self, candidate: SourceCandidate, *, tensors: int, known: int, wait_s: float, timeout_s: float
    ) -> HoldingsView: ...


class TransferPeer(Protocol):
    """The part of `NixlPeer` the strategy uses."""

    name: str

    def register(self, resident: ResidentWeights) -> None: ...

    def deregister(self, resident: ResidentWeights) -> None: ...

    def add_remote(self, blob: bytes) -> str: ...

    def remove_remote(self, name: str) -> bool: ...

    def read_groups(
        self,
        remote_name: str,
        remote_tensors: Sequence[RemoteTensor],
        local: ResidentWeights,
        groups: Sequence[Sequence[str]],
        timeout_s: float,
        *,
        on_start: Callable[[int], None] | None = None,
        on_done: Callable[[int], None] = ...,
        stall_s: float | None = None,
    ) -> int: ...

    def synchronize(self, device: torch.device) -> None: ...


class GrpcSourceClient:
    """Leases over gRPC; `credentials(node)` is the reader's worker token for a source on that node (None only
    against an open test source)."""

    def __init__(
        self,
        release_timeout_s: float = DEFAULT_RPC_TIMEOUT_S,
        *,
        credentials: SourceCredentials | None = None,
        retry: RetryPolicy | None = None,
    ) -> None:
        self._release_timeout_s = release_timeout_s
        self._credentials = credentials
        self._retry = retry or RetryPolicy()

    def _tokens(self, candidate: SourceCandidate) -> Callable[[], str] | None:
        return None if self._credentials is None else functools.partial(self._credentials, candidate.node)

    def prepare(self, candidate: SourceCandidate, *, reader: str, timeout_s: float) -> ReadLease:
        return prepare_tensor_read(
            candidate.grpc_endpoint,
            SourceIdentity(candidate.agent_name, candidate.instance_id),
            reader=reader,
            timeout_s=timeout_s,
            release_timeout_s=self._release_timeout_s,
            credentials=self._tokens(candidate),
            # A loading holder that goes away is moving to Serving (or died): other holders have its chunks.
            retry=NO_RETRY if candidate.loading else self._retry,
        )

    def holdings(
        self, candidate: SourceCandidate, *, tensors: int, known: int, wait_s: float, timeout_s: float
    ) -> HoldingsView:
        return get_holdings(
            candidate.grpc_endpoint,
            SourceIdentity(candidate.agent_name, candidate.instance_id),
            tensors,
            known=known,
            wait_s=wait_s,
            timeout_s=timeout_s,
            credentials=self._tokens(candidate),
        )


@dataclass(frozen=True)
class PeerLoadResult:
    source: SourceCandidate  # the holder that delivered the most bytes
    resident: ResidentWeights
    bytes_moved: int
    seconds: float
    sources: int = 1  # holders that delivered chunks

    @property
    def source_label(self) -> str:
        return self.source.label


def _describe(exc: BaseException) -> str:
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)):
        return f"{exc.code().name}: {exc.details()}"  # the repr of a gRPC error is a multi-line dump
    return f"{type(exc).__name__}: {exc}"


def _reason(exc: BaseException) -> AttemptReason:
    if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)):
        code = exc.code()
        return {
            grpc.StatusCode.UNAVAILABLE: AttemptReason.SOURCE_UNAVAILABLE,
            grpc.StatusCode.DEADLINE_EXCEEDED: AttemptReason.SOURCE_RPC_TIMEOUT,
            grpc.StatusCode.FAILED_PRECONDITION: AttemptReason.SOURCE_IDENTITY_MISMATCH,
            grpc.StatusCode.UNAUTHENTICATED: AttemptReason.UNAUTHENTICATED,
            grpc.StatusCode.PERMISSION_DENIED: AttemptReason.PERMISSION_DENIED,
        }.get(code, AttemptReason.SOURCE_RPC_FAILED)
    if isinstance(exc, ManifestMismatchError):
        return AttemptReason.MANIFEST_MISMATCH
    if isinstance(exc, TokenUnavailable):
        return AttemptReason.WORKER_TOKEN_UNAVAILABLE
    if isinstance(exc, SourceTransferError):
        if isinstance(exc.__cause__, TransferStalled):
            return AttemptReason.TRANSFER_STALLED
        return (
            AttemptReason.TRANSFER_TIMEOUT if isinstance(exc.__cause__, TimeoutError) else AttemptReason.TRANSFER_FAILED
        )
    if isinstance(exc, TimeoutError):
        return AttemptReason.TIMEOUT
    return AttemptReason.FAILED


def _code(exc: BaseException) -> grpc.StatusCode | None:
    return exc.code() if isinstance(exc, grpc.RpcError) and callable(getattr(exc, "code", None)) else None


def _sharing(manifest: SourceManifest, holdings: HoldingsView) -> Callable[[Any], list[str]] | None:
    """A `share` for the allocator: the tensors the holder says the new version has, byte for byte, of the
    WeightVersion `holdings.base_uid` (when this replica holds that very version, its memory is used for them)."""
    if not holdings.base_uid or not holdings.unchanged:
        return None
    names = [manifest.tensors[i].name for i in sorted(holdings.unchanged)]

    def share(version: Any) -> list[str]:
        return names if getattr(version, "uid", None) == holdings.base_uid else []

    share.checked_later = True  # type: ignore[attr-defined]  # held only once `_check_shared` checked them
    return share


class ChecksumMismatch(SourceTransferError):
    """Bytes read from a holder do not have the checksum it listed for them."""


@dataclass(eq=False)
class _Holder:
    """One source as this load sees it."""

    cand: SourceCandidate
    view: HoldingsView | None = None  # as of its last lease or long poll; None: not asked yet
    chunks: frozenset[int] | None = None  # of `view`, once the chunk plan is known
    dead: bool = False
    busy_until: float = 0.0
    refusals: int = 0  # RESOURCE_EXHAUSTED in a row
    moved: int = 0  # bytes this load read from it
    read_chunks: int = 0
    while_loading: int = 0  # of those, chunks read while it was still loading

    @property
    def key(self) -> str:
        return f"{self.cand.replica}@{self.cand.grpc_endpoint}"


@dataclass
class _Load:
    """The state of one load: the target once the first manifest is known, its chunks and what is still needed."""

    ctx: LoadContext
    started: float
    holders: dict[str, _Holder] = field(default_factory=dict)
    chunks: list[Chunk] = field(default_factory=list)
    names: tuple[str, ...] = ()
    sizes: tuple[int, ...] = ()
    needed: set[int] = field(default_factory=set)
    checksums: dict[str, str] = field(default_factory=dict)  # every tensor checked so far
    failures: list[str] = field(default_factory=list)
    failed_sources: int = 0
    progress_at: float = 0.0  # last time a chunk landed (or the load started)
    orphaned_since: float | None = None  # since when no live holder had a needed chunk (a chunk landing, a holder
    # coming or going starts it again)
    listed_at: float = 0.0
    polled: int = 0  # round robin over the holders waited on
    lock: threading.Lock = field(default_factory=threading.Lock)  # the checks of one lease run on two threads
    total: int = 0  # bytes of every chunk, once they are planned
    done: int = 0  # bytes of the chunks no longer needed (kept as they go: a sum per report is O(chunks) each)


class PeerStrategy:
    """Loads one rank from peers (`fanout`: chunk by chunk, from Serving and still-loading holders). The target
    tensors are allocated from the first source manifest (or supplied by `allocate`), registered once, and handed
    over in the result with every tensor's checksum (`resident.checksums`)."""

    name = SourceKind.PEER

    def __init__(
        self,
        *,
        peer: TransferPeer,
        candidates: Callable[[LoadContext], Sequence[SourceCandidate]],
        settings: TransferSettings | None = None,
        client: SourceClient | None = None,
        allocate: Callable[[Sequence[TensorSpec], str], ResidentWeights] = ResidentWeights.allocate,
        progress: Progress | None = None,
        selector: Selector | None = None,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
        credentials: SourceCredentials | None = None,
        on_verified: Callable[[Mapping[str, str]], None] | None = None,
        first_loader: Callable[[LoadContext, Collection[str]], str] | None = None,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        """`on_verified(checksums)`: tensors of the target that landed and passed their checks (what a loading
        replica serves on). `first_loader(ctx, dead)`: the replica that goes to object storage when no live holder
        has a chunk, the replicas in `dead` excluded (None: never this one)."""
        self.settings = settings or TransferSettings()
        self._peer = peer
        self._candidates = candidates
        self._client = client or GrpcSourceClient(
            self.settings.rpc_timeout_s, credentials=credentials, retry=self.settings.retry
        )
        self._allocate = allocate
        self._selector = selector or make_selector(self.settings.selector)
        self._enabled = enabled
        self._clock = clock
        self._progress_to = progress
        self._progress = self._throttle()
        self._sleep = sleep
        self._on_verified = on_verified
        self._first_loader = first_loader
        self._target: ResidentWeights | None = None
        self._load: _Load | None = None  # the current load, until it returns or is rolled back
        self._landed = False
        self._lease_chunks = lease_chunks(self.settings.chunk_bytes)

    def _throttle(self) -> ProgressThrottle:
        """A load's progress: the first report, a new total and completion at once, the rest at most once an
        interval (a report that names another holder is not more urgent)."""
        return ProgressThrottle(self._progress_to, self.settings.progress_interval_s, self._clock, source_is_news=False)

    def is_available(self, ctx: LoadContext) -> bool:
        return self._enabled

    def _usable(self, ctx: LoadContext, listed: Sequence[SourceCandidate]) -> list[SourceCandidate]:
        usable: list[SourceCandidate] = []
        for cand in listed:
            if cand.rank != ctx.rank or cand.agent_name == self._peer.name:
                continue
            if ctx.expected_manifest_digest and cand.manifest_digest not in ("", ctx.expected_manifest_digest):
                ctx.record(
                    cand.label,
                    AttemptOutcome.SKIPPED,
                    AttemptReason.MANIFEST_MISMATCH,
                    "advertised manifest digest differs",
                )
                continue
            usable.append(cand)
        return usable

    def _add(self, load: _Load, cands: Sequence[SourceCandidate]) -> bool:
        """New holders of this load, in the selector's order after the known ones; True if any was new."""
        fresh = [c for c in cands if f"{c.replica}@{c.grpc_endpoint}" not in load.holders]
        ctx = load.ctx
        for cand in self._selector.order(fresh, model=ctx.model, target_id=ctx.target_id, target_rank=ctx.rank):
            load.holders[f"{cand.replica}@{cand.grpc_endpoint}"] = _Holder(cand)
        if fresh:
            load.orphaned_since = None
        return bool(fresh)

    def load(self, ctx: LoadContext) -> PeerLoadResult:
        self._landed = False
        self._progress = self._throttle()
        try:
            listed = list(self._candidates(ctx))
        except Exception as exc:
            raise StrategyFailed(f"listing peer sources failed: {exc}", mutated=False) from exc
        usable = self._usable(ctx, listed)
        if not usable:
            raise StrategyFailed(f"no peer source for rank {ctx.rank} ({len(listed)} listed)", mutated=False)
        now = self._clock()
        load = self._load = _Load(ctx, now, progress_at=now, listed_at=now)
        self._add(load, usable)
        with ThreadPoolExecutor(2, thread_name_prefix="ferry-verify") as verifier:
            while not load.chunks or load.needed:
                ranked = [
                    HolderView(h.key, h.chunks if load.chunks else None, usable=not h.dead and h.busy_until <= now)
                    for h in load.holders.values()
                ]
                pick = choose(sorted(load.needed) if load.chunks else [0], ranked, self._lease_chunks)
                if pick is None:
                    self._wait(load)
                else:
                    self._from_holder(load, load.holders[pick[0]], verifier)
                now = self._clock()
        return self._result(load)

    def _from_holder(self, load: _Load, holder: _Holder, verifier: ThreadPoolExecutor) -> None:
        """One lease on `holder`; a failure drops it for this load (or for a moment, when it is only full)."""
        ctx = load.ctx
        try:
            self._load_from(holder.cand, ctx, load=load, holder=holder, verifier=verifier)
        except StrategyFailed:
            raise
        except grpc.RpcError as exc:
            if _code(exc) == grpc.StatusCode.RESOURCE_EXHAUSTED:  # at its reader limit: not a failure
                wait = min(0.4, BUSY_BACKOFF_S * 2**holder.refusals) * random.uniform(0.5, 1.0)
                holder.busy_until = self._clock() + wait
                holder.refusals += 1
                return
            self._failed(load, holder, exc)
        except Exception as exc:
            self._failed(load, holder, exc)

    def _failed(self, load: _Load, holder: _Holder, exc: Exception) -> None:
        """Drop `holder` for this load. A Serving source's failure counts against `maxSourceAttempts`; a loading
        holder's does not (it stops serving when it switches to Serving, or died: its chunks come from others)."""
        holder.dead = True
        message = _describe(exc)
        if holder.cand.loading and _code(exc) == grpc.StatusCode.UNAVAILABLE:
            log.info("loading holder %s went away: %s", holder.cand.label, message)
            load.listed_at = min(load.listed_at, self._clock() - RELIST_S + GONE_RELIST_S)
            load.orphaned_since = None  # most likely it turns Serving: give the listing time to show it
            return
        load.ctx.record(holder.cand.label, AttemptOutcome.FAILED, _reason(exc), message)
        load.failures.append(f"{holder.cand.label}: {message}")
        log.warning("peer load of rank %d from %s failed: %s", load.ctx.rank, holder.cand.label, message)
        if holder.cand.loading:
            return
        load.failed_sources += 1
        if load.failed_sources >= self.settings.max_source_attempts:
            raise StrategyFailed(
                f"no peer source succeeded for rank {load.ctx.rank}: " + "; ".join(load.failures),
                mutated=self._landed,
            ) from exc

    def _wait(self, load: _Load) -> None:
        """No usable holder has a chunk this load needs: wait for one, list the sources again, or give up (to
        object storage, when this replica is the first loader among the live ones)."""
        ctx, now = load.ctx, self._clock()
        alive = [h for h in load.holders.values() if not h.dead]
        if not alive and load.failed_sources:  # as before pipelining: the sources failed, object storage is next
            raise StrategyFailed(
                f"no peer source succeeded for rank {ctx.rank}: " + "; ".join(load.failures), mutated=self._landed
            )
        if not alive and now - load.listed_at < RELIST_S:
            self._sleep(max(0.0, RELIST_S - (now - load.listed_at)))
            now = self._clock()
        if now - load.progress_at > self.settings.timeout_s:
            raise StrategyFailed(
                f"no chunk of {ctx.version} arrived from a peer for {self.settings.timeout_s:g}s"
                + (f" ({'; '.join(load.failures)})" if load.failures else ""),
                mutated=self._landed,
            )
        if now - load.listed_at >= RELIST_S:
            load.listed_at = now
            try:
                if self._add(load, self._usable(ctx, list(self._candidates(ctx)))):
                    return
            except Exception as exc:  # the holders known so far may still do
                log.warning("listing peer sources again failed: %s", exc)
            alive = [h for h in load.holders.values() if not h.dead]
            orphaned = load.chunks and not any(h.chunks is None or h.chunks & load.needed for h in alive)
            if not (orphaned or not alive):
                load.orphaned_since = None
            elif load.orphaned_since is None:
                load.orphaned_since = now  # a holder that restarts its load republishes meanwhile: look again
            elif now - load.orphaned_since >= TAKEOVER_S and self._first_loader is not None:
                dead = {h.cand.replica for h in load.holders.values() if h.dead} - {h.cand.replica for h in alive}
                leader = self._first_loader(ctx, dead)
                if leader == ctx.target_id:
                    raise StrategyFailed(
                        f"no live peer holds the rest of {ctx.version} and this replica is the first loader now",
                        mutated=self._landed,
                    )
            if not alive:
                if self._first_loader is None:
                    raise StrategyFailed(
                        f"no peer source left for rank {ctx.rank}: " + "; ".join(load.failures or ["none listed"]),
                        mutated=self._landed,
                    )
                return
        busy = [h for h in alive if h.busy_until > now and (h.chunks is None or h.chunks & load.needed)]
        waiting = [h for h in alive if h.view is not None and not h.view.full and h.busy_until <= now]
        if busy or not waiting:  # a holder of what we need is at its reader limit: a slot frees soon
            self._sleep(BUSY_BACKOFF_S)
            return
        holder = waiting[load.polled % len(waiting)]
        load.polled += 1
        self._report(load, holder.cand.label)
        try:
            view = self._client.holdings(
                holder.cand,
                tensors=len(load.names),
                known=len(holder.view.held) if holder.view else 0,
                wait_s=HOLDINGS_WAIT_S,
                timeout_s=self.settings.rpc_timeout_s,
            )
        except Exception as exc:
            self._failed(load, holder, exc)
            return
        self._update(load, holder, view)

    def _update(self, load: _Load, holder: _Holder, view: HoldingsView) -> None:
        holder.view = view
        if load.chunks:
            holder.chunks = chunks_held(load.chunks, view.held)

    def _report(self, load: _Load, label: str) -> None:
        self._progress(load.done, load.total, label)

    def _result(self, load: _Load) -> PeerLoadResult:
        ctx = load.ctx
        seconds = self._clock() - load.started
        target = self._target
        assert target is not None
        target.checksums = dict(load.checksums)
        contributed = [h for h in load.holders.values() if h.read_chunks]
        for h in contributed:
            loading = f", {h.while_loading} of them while it was loading" if h.while_loading else ""
            ctx.record(
                h.cand.label,
                AttemptOutcome.LOADED,
                AttemptReason.LOADED,
                f"{h.moved} bytes in {h.read_chunks} chunk(s){loading}, {seconds:.3f}s",
            )
        best = max(contributed, key=lambda h: h.moved) if contributed else next(iter(load.holders.values()))
        self._report(load, best.cand.label)
        self._target, self._load = None, None  # ownership moves to the caller with the result
        return PeerLoadResult(best.cand, target, load.total, seconds, len(contributed))

    def rollback(self, ctx: LoadContext) -> None:
        """Drop the target we allocated (its registration first). Peers were already removed per attempt. A
        one-rank target that holds checked tensors is left for the next strategy instead (`ctx.leftover`), still
        registered (a load that serves while it loads goes on serving them), when it is one the S3 stream can
        take over."""
        target, self._target = self._target, None
        load, self._load = self._load, None
        if target is None:
            return
        # Only what the S3 stream can take over: one rank's unshared pool in host memory (else freed now).
        if load and load.checksums and ctx.world_size == 1 and target.device.type == "cpu" and not target.shared:
            ctx.leftover = Leftover(target, dict(load.checksums), functools.partial(self._peer.deregister, target))
        else:
            self._peer.deregister(target)

    # -- one lease ------------------------------------------------------------------------------------

    def _load_from(
        self,
        cand: SourceCandidate,
        ctx: LoadContext,
        *,
        load: _Load | None = None,
        holder: _Holder | None = None,
        verifier: ThreadPoolExecutor | None = None,
    ) -> int:
        """One lease on `cand`: READ every chunk the load still needs that the lease covers, checking each as it
        lands. Returns the bytes moved."""
        if load is None:  # a single lease outside a load (tests of the per-lease rules)
            now = self._clock()
            load = _Load(ctx, now, progress_at=now, listed_at=now)
        holder = holder or _Holder(cand)
        deadline = self._clock() + self.settings.timeout_s
        self._report(load, cand.label)  # which peer we wait on shows before the dial (stall diagnosis)
        lease = self._client.prepare(cand, reader=ctx.target_id, timeout_s=self._rpc_budget(deadline))
        holder.refusals = 0
        remote_name: str | None = None
        moved = 0
        checks: list[Future[None]] = []
        try:
            manifest = lease.manifest
            target = self._prepare_target(manifest, cand, ctx, load, lease.holdings)
            self._update(load, holder, lease.holdings)
            held = holder.chunks or frozenset()
            wanted = [c for c in load.chunks if c.index in load.needed and c.index in held]
            batch = lease_batch(wanted, self.settings.chunk_bytes)
            if not batch:
                return 0  # nothing new here yet (the lease is released below)
            remote_name = manifest.identity.agent_name  # claimed before the add, so a failed add is undone
            try:
                loaded = self._peer.add_remote(manifest.nixl_metadata)
                if loaded != remote_name:
                    self._peer.remove_remote(loaded)
                    raise ManifestMismatchError(f"NIXL metadata names agent {loaded!r}, manifest {remote_name!r}")
            except BaseException:
                self._peer.remove_remote(remote_name)
                remote_name = None
                raise
            try:
                remaining = deadline - self._clock()
                if remaining <= 0:
                    raise TimeoutError(f"{cand.label}: transfer budget of {self.settings.timeout_s:g}s spent")

                def on_start(total: int) -> None:
                    self._landed = True  # from here on target bytes may change
                    self._report(load, cand.label)

                def on_done(i: int) -> None:
                    chunk = batch[i]
                    if verifier is None:
                        self._check(load, holder, lease.holdings, target, chunk)
                    else:
                        checks.append(verifier.submit(self._check, load, holder, lease.holdings, target, chunk))

                groups = [[load.names[t] for t in c.tensors if load.names[t] not in target.shared] for c in batch]
                try:
                    moved = self._peer.read_groups(
                        remote_name,
                        manifest.tensors,
                        target,
                        groups,
                        remaining,
                        on_start=on_start,
                        on_done=on_done,
                        stall_s=self.settings.stall_s,
                    )
                except Exception as exc:
                    raise SourceTransferError(f"NIXL read from {cand.label} failed: {exc}") from exc
                self._peer.synchronize(target.device)
            finally:
                if remote_name is not None:
                    self._peer.remove_remote(remote_name)
        finally:
            # The lease covers the READ, not the checks of what landed: it goes back while the last ones run.
            self._release(lease, cand)
            for check in checks:
                check.exception()  # wait for every check of what landed, whatever happens next
        for check in checks:
            check.result()  # a failed check fails this holder
        self._report(load, cand.label)
        return moved

    def _check(
        self, load: _Load, holder: _Holder, holdings: HoldingsView, target: ResidentWeights, chunk: Chunk
    ) -> None:
        """A chunk landed: every tensor's adler32 against the one the holder listed (and any this load already
        knows); only then is it held, and served on."""
        verified: dict[str, str] = {}
        moved = 0
        for t in chunk.tensors:
            name = load.names[t]
            if name in target.shared:
                continue  # this replica's own copy of the base, checked when it was shared
            moved += load.sizes[t]
            expected = holdings.checksums[t]
            known = load.checksums.get(name)
            if known and known != expected:
                raise ChecksumMismatch(f"{holder.cand.label} lists {name} as {expected}, another holder as {known}")
            tensor = target.tensors[name]
            got = ckpt.adler32_hex(tensor.detach().reshape(-1).view(torch.uint8).cpu().numpy())
            if got != expected:
                raise ChecksumMismatch(f"{name} from {holder.cand.label} fails its adler32 check: {got} != {expected}")
            verified[name] = got
        with load.lock:
            load.checksums.update(verified)
            if chunk.index in load.needed:
                load.needed.discard(chunk.index)
                load.done += chunk.nbytes
            load.progress_at = self._clock()
            load.orphaned_since = None
            holder.moved += moved
            holder.read_chunks += 1
            holder.while_loading += 1 if holder.cand.loading else 0
        if self._on_verified is not None:
            self._on_verified(verified)
        self._report(load, holder.cand.label)

    def _check_shared(self, load: _Load, target: ResidentWeights, holdings: HoldingsView) -> None:
        """The tensors the target shares with the version this replica holds (the holder says the new version has
        their very bytes): each must have the checksum the holder lists, and then is held without a READ."""
        if not target.shared:
            return
        index = {name: i for i, name in enumerate(load.names)}
        verified = {}
        for name in target.shared:
            got = ckpt.adler32_hex(target.tensors[name].detach().reshape(-1).view(torch.uint8).cpu().numpy())
            if got != holdings.checksums[index[name]]:
                # The shared tensors are read-only: this target cannot take other bytes for them.
                raise StrategyFailed(
                    f"{name}: the held base has adler32 {got}, the new version {holdings.checksums[index[name]]}",
                    mutated=False,
                )
            verified[name] = got
        load.checksums.update(verified)
        if self._on_verified is not None:
            self._on_verified(verified)
        log.info("%d of %d tensors shared with the held %s, not read", len(verified), len(load.names), "base")

    def _rpc_budget(self, deadline: float) -> float:
        return max(0.001, min(self.settings.rpc_timeout_s, deadline - self._clock()))

    def _release(self, lease: ReadLease, cand: SourceCandidate) -> None:
        try:
            lease.close()
        except Exception as exc:  # never mask the load's own outcome; the lease expires by its TTL
            log.warning("releasing the read lease at %s failed: %s", cand.label, _describe(exc))

    def _prepare_target(
        self, manifest: SourceManifest, cand: SourceCandidate, ctx: LoadContext, load: _Load, holdings: HoldingsView
    ) -> ResidentWeights:
        if manifest.identity.agent_name != cand.agent_name:
            raise ManifestMismatchError(f"manifest is from {manifest.identity.agent_name}, expected {cand.agent_name}")
        if manifest.rank != ctx.rank:
            raise ManifestMismatchError(f"source serves rank {manifest.rank}, target is rank {ctx.rank}")
        for expected, what in ((cand.manifest_digest, "advertised"), (ctx.expected_manifest_digest, "expected")):
            if expected and manifest.digest != expected:
                raise ManifestMismatchError(f"manifest digest {manifest.digest[:12]} != {what} {expected[:12]}")
        if cand.tensor_count and len(manifest.tensors) != cand.tensor_count:
            raise ManifestMismatchError(f"{len(manifest.tensors)} tensors, {cand.tensor_count} advertised")
        if self._target is None:
            share = _sharing(manifest, holdings)
            if share is None:
                self._target = self._allocate(manifest.specs, ctx.device)
            else:
                self._target = self._allocate(manifest.specs, ctx.device, share)
            self._peer.register(self._target)
        if not load.chunks:
            load.names = tuple(t.name for t in manifest.tensors)
            load.sizes = tuple(t.nbytes for t in manifest.tensors)
            load.chunks = plan_chunks([t.nbytes for t in manifest.tensors], self.settings.chunk_bytes)
            self._check_shared(load, self._target, holdings)
            load.needed = {c.index for c in load.chunks if not all(load.names[t] in load.checksums for t in c.tensors)}
            load.total = sum(c.nbytes for c in load.chunks)
            load.done = sum(c.nbytes for c in load.chunks if c.index not in load.needed)
            for h in load.holders.values():
                if h.view is not None:
                    h.chunks = chunks_held(load.chunks, h.view.held)
        elif tuple(t.name for t in manifest.tensors) != load.names or manifest.digest != self._target.digest:
            raise ManifestMismatchError(f"{cand.label} serves another manifest than the first holder")
        return self._target
