"""Loading one rank of a WeightReplica: the strategies a rank uses, built from the API, and the cold start.

Used in the node agent's own process for one-rank replicas and in each rank process (`ferry_agent.ranks.worker`)
of a multi-rank one, so both run exactly the same code: `load_rank` over a `RankGroup`.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from ferry.api.models import RankState, SourceKind
from ferry_agent.kube.sources import ApiSources
from ferry_agent.ranks.agreement import RankGroup
from ferry_agent.ranks.cold_start import DEFAULT_SOURCE_ORDER, run_cold_start
from ferry_agent.ranks.landing import MapSealed, unaccounted
from ferry_agent.store.checkpoints import CheckpointStore
from ferry_agent.store.resident import Allocate, ResidentWeights
from ferry_agent.strategies.chain import LoadContext, LoadResult, LoadStrategy
from ferry_agent.strategies.local_file import LocalFileStrategy, SeedKey
from ferry_agent.strategies.object_storage.strategy import ObjectStorageStrategy
from ferry_agent.strategies.peer import PeerStrategy, TransferSettings
from ferry_agent.strategies.progress import Progress
from ferry_agent.transport.loading_source import LoadingSource, Publish
from ferry_agent.transport.nixl import NixlPeer
from ferry_agent.transport.worker_auth import ReadGuard, ServedVersion, WorkerAuth
from ferry_agent.transport.worker_service import SourceCredentials, WorkerServer, serve_resident

log = logging.getLogger(__name__)


def read_guard(auth: WorkerAuth | None, namespace: str, ctx: LoadContext) -> ReadGuard | None:
    """What a rank's worker service admits: readers whose node is assigned the namespace/model/version it loaded
    (`ctx` after the load, never a spec read before it: the version it names may have moved on since)."""
    if auth is None:
        return None
    return auth.guard(ServedVersion(namespace, ctx.model, ctx.version))


def loading_source(
    peer: NixlPeer,
    ctx: LoadContext,
    *,
    auth: WorkerAuth | None,
    namespace: str,
    version: str,
    spec: Mapping[str, Any],
    sources: ApiSources,
    host: str,
    publish: Publish,
) -> LoadingSource:
    """What serves this rank's load while it runs (pipelined fan-out) to readers assigned `version`, publishing
    its `status.loadingRanks` entry with `publish`."""
    settings = TransferSettings.from_spec(spec.get("transfer") or {})

    def version_uid() -> str | None:  # of the object this load reads (set by the Peer strategy's check)
        if ctx.version_uid is None:
            body = sources.version(version)
            return None if body is None else str(body["metadata"]["uid"])
        return ctx.version_uid

    return LoadingSource(
        peer,
        rank=ctx.rank,
        host=host,
        guard=read_guard(auth, namespace, dataclasses.replace(ctx, version=version)),
        max_readers=settings.max_readers,
        transfer_timeout_s=settings.timeout_s,
        version_uid=version_uid,
        publish=publish,
    )


def serve_rank(
    resident: ResidentWeights,
    peer: NixlPeer,
    *,
    rank: int,
    host: str,
    spec: Mapping[str, Any],
    guard: ReadGuard | None,
    base: tuple[str, Collection[str]] | None = None,
) -> tuple[WorkerServer, dict[str, Any]]:
    """Publish a loaded rank as a P2P source: its worker service, and its `status.ranks[]` entry (`base`: the
    tensors it shares with that WeightVersion uid, which readers holding it share too)."""
    settings = TransferSettings.from_spec(spec.get("transfer") or {})
    server = serve_resident(
        resident,
        peer,
        rank=rank,
        host=host,
        transfer_timeout_s=settings.timeout_s,
        guard=guard,
        max_readers=settings.max_readers,
        base=base,
    )
    entry = {
        "rank": rank,
        "agentName": peer.name,
        "grpcEndpoint": server.endpoint,
        "tensorCount": resident.tensor_count,
        "manifestDigest": resident.digest,
        "state": RankState.READY,
    }
    return server, entry


# A replica holding a version of the target's chain reads the deltas after it from S3 before trying peers when they
# are at most this share of the model: each replica then reads a small delta instead of all of them copying the
# whole version from the first to load it (a rollout's fan-out through one source).
DELTAS_FIRST_SHARE = 0.25


def deltas_first(
    target: str, lookup: Callable[[str], Mapping[str, Any] | None], held: Sequence[Any]
) -> tuple[str, int, int] | None:
    """Whether to load `target` from object storage first: the newest version of its chain (`status.chain`) held in
    host memory (`memstore.SealedVersion`, matched by name and uid), the stored bytes of the deltas after it
    (`status.totalBytes`) and the model's bytes, when those deltas are small enough; else None."""
    ours = {(v.version, v.uid): v for v in held}
    body = lookup(target)
    chain = ((body or {}).get("status") or {}).get("chain") or []
    if not ours or not chain or chain[-1] != target:
        return None
    deltas = 0
    link = body
    for i in range(len(chain) - 1, 0, -1):
        size = ((link or {}).get("status") or {}).get("totalBytes")
        base = lookup(chain[i - 1])
        if not isinstance(size, int) or base is None:
            return None
        deltas += size
        version = ours.get((chain[i - 1], (base.get("metadata") or {}).get("uid")))
        if version is not None:
            small = deltas <= version.total_bytes * DELTAS_FIRST_SHARE
            return (version.version, deltas, version.total_bytes) if small else None
        link = base  # the next delta back
    return None


def rank_device(device: str, rank: int) -> str:
    """The device of a rank: every rank of a replica runs on its own GPU of the node."""
    return f"cuda:{rank}" if device == "cuda" else device


def rank_context(group: RankGroup, replica: str, spec: Mapping[str, Any]) -> LoadContext:
    """The context of this rank's load; its `attempts` say what was tried, also when the load fails."""
    world = group.world_size
    if spec.get("ranks", 1) != world:
        raise ValueError(f"{replica} has {spec.get('ranks', 1)} ranks but the rank group has {world}")
    return LoadContext(
        model=spec["modelName"],
        version="",
        rank=group.rank,
        target_id=replica,
        device=rank_device(spec.get("device", "cpu"), group.rank),
        world_size=world,
    )


def load_rank(
    group: RankGroup,
    ctx: LoadContext,
    *,
    sources: ApiSources,
    spec: Mapping[str, Any],
    configured: str | None,
    peer: NixlPeer,
    store: CheckpointStore | None,
    s3_endpoint: str | None,
    seeds: Mapping[SeedKey, Path],
    progress: Progress,
    note: Callable[[str], None],
    credentials: SourceCredentials | None = None,
    allocate: Allocate = ResidentWeights.allocate,
    map_sealed: MapSealed = unaccounted,
    held: Callable[[], Sequence[Any]] = tuple,
    serving: LoadingSource | None = None,
    download_workers: int = 8,
) -> LoadResult:
    """Load this rank (`ctx` from `rank_context`) of a replica, agreeing on everything with the other ranks, and
    return the chain's result. Every strategy allocates its target with `allocate`; a follower's share of its
    leader's landing is taken over by `map_sealed`; `held()` lists the replica's versions sealed in the agent's
    host memory, which an S3 replay may start from. With `serving`, the load serves peers what it holds while it
    loads (pipelined fan-out)."""
    settings = TransferSettings.from_spec(spec.get("transfer") or {})
    replica = ctx.target_id
    version = configured or ""
    if serving is not None:
        allocate = serving.allocator(allocate)
    strategies: dict[str, LoadStrategy] = {
        SourceKind.PEER: PeerStrategy(
            peer=peer,
            candidates=sources.candidates(version, replica, settings.timeout_s, note, progress),
            settings=settings,
            progress=progress,
            credentials=credentials,
            allocate=allocate,
            on_verified=serving.verified if serving is not None else None,
            first_loader=sources.first_loader(version, replica),
        ),
    }
    if store is not None:
        strategies[SourceKind.OBJECT_STORAGE] = ObjectStorageStrategy(
            namespace=sources.namespace,
            fetch_version=sources.version,
            credentials=sources.credentials,
            store=store,
            default_endpoint=s3_endpoint,
            progress=progress,
            timeout_s=settings.timeout_s,
            download_workers=download_workers,
            allocate=allocate,
            held=held,
            on_checked=serving.verified_one if serving is not None else None,
        )
    local = LocalFileStrategy(seeds, sources.namespace, sources.version, allocate)
    return run_cold_start(
        group,
        ctx,
        configured=configured,
        source_order=spec.get("sourceOrder") or DEFAULT_SOURCE_ORDER,
        strategies=strategies,
        exact=[local],
        release=lambda r: peer.deregister(r.resident),
        map_sealed=map_sealed,
    )
