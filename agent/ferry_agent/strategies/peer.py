"""The Peer load strategy: READ a rank's weights from another replica that serves the exact version.

Per candidate (so that a failed READ never leaves a half-open connection on the source):
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
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import torch

from ferry.api.models import AttemptOutcome, AttemptReason, SelectorKind, SourceKind
from ferry_agent.store.resident import ResidentWeights, TensorSpec
from ferry_agent.strategies.candidate import SourceCandidate
from ferry_agent.strategies.chain import LoadContext, SourceTransferError, StrategyFailed
from ferry_agent.strategies.progress import Progress, ProgressThrottle
from ferry_agent.strategies.selector import Selector, make_selector
from ferry_agent.transport.nixl import ManifestMismatchError, RemoteTensor
from ferry_agent.transport.worker_auth import TokenUnavailable
from ferry_agent.transport.worker_service import (
    DEFAULT_RPC_TIMEOUT_S,
    DEFAULT_TRANSFER_TIMEOUT_S,
    RetryPolicy,
    SourceCredentials,
    SourceIdentity,
    SourceManifest,
    prepare_tensor_read,
)

log = logging.getLogger(__name__)

DEFAULT_MAX_SOURCE_ATTEMPTS = 3
DEFAULT_RPC_RETRIES = 3
DEFAULT_RPC_BACKOFF_S = 0.5


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

    def __post_init__(self) -> None:
        object.__setattr__(self, "timeout_s", transfer_timeout_seconds(self.timeout_s))
        if not isinstance(self.max_source_attempts, int) or self.max_source_attempts < 1:
            raise ValueError(f"maxSourceAttempts must be a positive integer, got {self.max_source_attempts!r}")
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
            **overrides,
        )


class ReadLease(Protocol):
    manifest: SourceManifest

    def close(self) -> None: ...


class SourceClient(Protocol):
    def prepare(self, candidate: SourceCandidate, *, reader: str, timeout_s: float) -> ReadLease: ...


class TransferPeer(Protocol):
    """The part of `NixlPeer` the strategy uses."""

    name: str

    def register(self, resident: ResidentWeights) -> None: ...

    def deregister(self, resident: ResidentWeights) -> None: ...

    def add_remote(self, blob: bytes) -> str: ...

    def remove_remote(self, name: str) -> bool: ...

    def read(
        self,
        remote_name: str,
        remote_tensors: Sequence[RemoteTensor],
        local: ResidentWeights,
        timeout_s: float,
        *,
        on_start: Callable[[int], None] | None = None,
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

    def prepare(self, candidate: SourceCandidate, *, reader: str, timeout_s: float) -> ReadLease:
        return prepare_tensor_read(
            candidate.grpc_endpoint,
            SourceIdentity(candidate.agent_name, candidate.instance_id),
            reader=reader,
            timeout_s=timeout_s,
            release_timeout_s=self._release_timeout_s,
            credentials=None if self._credentials is None else functools.partial(self._credentials, candidate.node),
            retry=self._retry,
        )


@dataclass(frozen=True)
class PeerLoadResult:
    source: SourceCandidate
    resident: ResidentWeights
    bytes_moved: int
    seconds: float

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
        return (
            AttemptReason.TRANSFER_TIMEOUT if isinstance(exc.__cause__, TimeoutError) else AttemptReason.TRANSFER_FAILED
        )
    if isinstance(exc, TimeoutError):
        return AttemptReason.TIMEOUT
    return AttemptReason.FAILED


class PeerStrategy:
    """Loads one rank from peers. The target tensors are allocated from the first source manifest
    (or supplied by `allocate`), registered once, and handed over in the result."""

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
    ) -> None:
        self.settings = settings or TransferSettings()
        self._peer = peer
        self._candidates = candidates
        self._client = client or GrpcSourceClient(
            self.settings.rpc_timeout_s, credentials=credentials, retry=self.settings.retry
        )
        self._allocate = allocate
        self._progress = ProgressThrottle(progress, self.settings.progress_interval_s, clock)
        self._selector = selector or make_selector(self.settings.selector)
        self._enabled = enabled
        self._clock = clock
        self._target: ResidentWeights | None = None
        self._landed = False

    def is_available(self, ctx: LoadContext) -> bool:
        return self._enabled

    def load(self, ctx: LoadContext) -> PeerLoadResult:
        self._landed = False
        try:
            listed = list(self._candidates(ctx))
        except Exception as exc:
            raise StrategyFailed(f"listing peer sources failed: {exc}", mutated=False) from exc
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
        if not usable:
            raise StrategyFailed(f"no peer source for rank {ctx.rank} ({len(listed)} listed)", mutated=False)

        ordered = self._selector.order(usable, model=ctx.model, target_id=ctx.target_id, target_rank=ctx.rank)
        failures: list[str] = []
        for cand in ordered[: self.settings.max_source_attempts]:
            started = self._clock()
            try:
                moved = self._load_from(cand, ctx)
            except Exception as exc:
                message = _describe(exc)
                ctx.record(cand.label, AttemptOutcome.FAILED, _reason(exc), message)
                failures.append(f"{cand.label}: {message}")
                log.warning("peer load of rank %d from %s failed: %s", ctx.rank, cand.label, message)
                continue
            seconds = self._clock() - started
            assert self._target is not None
            result = PeerLoadResult(source=cand, resident=self._target, bytes_moved=moved, seconds=seconds)
            self._target = None  # ownership moves to the caller with the result
            ctx.record(cand.label, AttemptOutcome.LOADED, AttemptReason.LOADED, f"{moved} bytes in {seconds:.3f}s")
            return result
        raise StrategyFailed(
            f"no peer source succeeded for rank {ctx.rank}: " + "; ".join(failures), mutated=self._landed
        )

    def rollback(self, ctx: LoadContext) -> None:
        """Drop the target we allocated (its registration first). Peers were already removed per attempt."""
        target, self._target = self._target, None
        if target is not None:
            self._peer.deregister(target)

    # -- one candidate --------------------------------------------------------------------------------

    def _load_from(self, cand: SourceCandidate, ctx: LoadContext) -> int:
        deadline = self._clock() + self.settings.timeout_s
        self._progress(0, 0, cand.label)  # which peer we wait on shows before the dial (stall diagnosis)
        lease = self._client.prepare(cand, reader=ctx.target_id, timeout_s=self._rpc_budget(deadline))
        remote_name: str | None = None
        try:
            manifest = lease.manifest
            target = self._prepare_target(manifest, cand, ctx)
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
                    self._progress(0, total, cand.label)

                try:
                    moved = self._peer.read(remote_name, manifest.tensors, target, remaining, on_start=on_start)
                except Exception as exc:
                    raise SourceTransferError(f"NIXL read from {cand.label} failed: {exc}") from exc
                self._peer.synchronize(target.device)
            finally:
                if remote_name is not None:
                    self._peer.remove_remote(remote_name)
        finally:
            self._release(lease, cand)
        self._progress(moved, moved, cand.label)
        return moved

    def _rpc_budget(self, deadline: float) -> float:
        return max(0.001, min(self.settings.rpc_timeout_s, deadline - self._clock()))

    def _release(self, lease: ReadLease, cand: SourceCandidate) -> None:
        try:
            lease.close()
        except Exception as exc:  # never mask the load's own outcome; the lease expires by its TTL
            log.warning("releasing the read lease at %s failed: %s", cand.label, _describe(exc))

    def _prepare_target(self, manifest: SourceManifest, cand: SourceCandidate, ctx: LoadContext) -> ResidentWeights:
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
            self._target = self._allocate(manifest.specs, ctx.device)
            self._peer.register(self._target)
        return self._target
