"""Loading one rank of a WeightReplica: the strategies a rank uses, built from the API, and the cold start.

Used in the node agent's own process for one-rank replicas and in each rank process (`ferry_agent.rank_worker`)
of a multi-rank one, so both run exactly the same code: `load_rank` over a `RankGroup`.
"""

from __future__ import annotations

import argparse
import datetime as dt
import hashlib
import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from ferry.api.models import GROUP, LABEL_MODEL, VERSION, RankState, label_value
from ferry.storage import credentials_from_secret_data
from ferry_agent.apiretry import call_with_retry
from ferry_agent.checkpoint_store import CheckpointStore
from ferry_agent.cold_start import DEFAULT_SOURCE_ORDER, run_cold_start
from ferry_agent.nixl_transfer import NixlPeer
from ferry_agent.peer_strategy import PeerStrategy, Progress, TransferSettings
from ferry_agent.ranks import RankGroup
from ferry_agent.registry import first_loader, peer_version_problem, source_candidates
from ferry_agent.resident import ResidentWeights, spec_of
from ferry_agent.s3_strategy import ObjectStorageStrategy
from ferry_agent.sharding import rank_specs
from ferry_agent.strategy import LoadContext, StrategyFailed
from ferry_agent.worker_auth import ReadGuard, ServedVersion, WorkerAuth
from ferry_agent.worker_service import SourceCredentials, WorkerServer, serve_resident

log = logging.getLogger(__name__)
PLURAL = "weightreplicas"
# What a strategy allocates its target with: `(specs, device[, share]) -> ResidentWeights` (`share`:
# `memstore.Share`, the tensors a held version has the same bytes of).
Allocate = Callable[..., ResidentWeights]


@dataclass(frozen=True)
class SeedKey:
    """Which WeightVersion a seed file holds: a version name alone is not an identity (every tenant may have a
    `v1`), so a seed names its namespace and model too."""

    namespace: str
    model: str
    version: str

    def __str__(self) -> str:
        return f"{self.namespace}/{self.model}/{self.version}"


def parse_seed(text: str) -> tuple[SeedKey, Path]:
    """`NAMESPACE/MODEL/VERSION=PATH` (a model name may itself contain `/`) → its key and file; ValueError says
    what is wrong."""
    key, sep, path = text.rpartition("=")
    namespace, _, rest = key.partition("/")
    model, _, version = rest.rpartition("/")
    if not sep or not path or not namespace or not model or not version:
        raise ValueError(f"expected NAMESPACE/MODEL/VERSION=PATH, got {text!r}")
    return SeedKey(namespace, model, version), Path(path)


def seed_argument(text: str) -> tuple[SeedKey, Path]:
    """`parse_seed` for argparse: the file must exist."""
    try:
        key, path = parse_seed(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"seed checkpoint {path} does not exist")
    return key, path


@dataclass
class LocalLoad:
    resident: ResidentWeights
    bytes_moved: int
    source: str = "local"


class LocalFileStrategy:
    """Seeds a version from a safetensors file on this node (how the first replica of a PeerOnly version, or a
    node with a pre-staged checkpoint, starts): this rank's share of its tensors. Available only for the exact
    namespace/model/version the file was configured for, and used only while that WeightVersion exists, is Ready
    and (where the operator recorded them) has the file's tensor count and size."""

    name = "LocalFile"

    def __init__(
        self, seeds: Mapping[SeedKey, Path], namespace: str, fetch_version: Callable[[str], dict | None],
        allocate: Allocate = ResidentWeights.allocate,
    ) -> None:  # fmt: skip
        self._seeds = seeds
        self._namespace = namespace
        self._fetch_version = fetch_version
        self._allocate = allocate

    def _key(self, ctx: LoadContext) -> SeedKey:
        return SeedKey(self._namespace, ctx.model, ctx.version)

    def is_available(self, ctx: LoadContext) -> bool:
        return self._key(ctx) in self._seeds

    def load(self, ctx: LoadContext) -> LocalLoad:
        from safetensors.torch import load_file

        key = self._key(ctx)
        body = self._fetch_version(ctx.version)
        problem = peer_version_problem(body, name=ctx.version, model=ctx.model)
        if problem is not None:
            raise StrategyFailed(f"seed for {key} not used: {problem}", mutated=False)
        assert body is not None
        path = self._seeds[key]
        try:
            tensors = load_file(str(path), device=ctx.device)
        except (OSError, ValueError) as exc:
            raise StrategyFailed(f"cannot read {path}: {exc}", mutated=False) from exc
        status = body.get("status") or {}
        held = {"tensorCount": len(tensors), "totalBytes": sum(t.numel() * t.element_size() for t in tensors.values())}
        for field, value in held.items():
            if status.get(field) is not None and status[field] != value:
                raise StrategyFailed(
                    f"seed {path} does not hold {key}: {field} {value}, the WeightVersion has {status[field]}",
                    mutated=False,
                )
        ctx.version_uid = str(body["metadata"]["uid"])
        mine = rank_specs([spec_of(n, t) for n, t in sorted(tensors.items())], ctx.rank, ctx.world_size)
        try:
            resident = self._allocate(mine, ctx.device, same_bytes(tensors))
        except (RuntimeError, ValueError) as exc:  # out of memory, or beyond the host-memory budget
            raise StrategyFailed(f"cannot hold the seed {path}: {exc}", mutated=False) from exc
        for spec in mine:  # the file's tensors are a transient copy: the resident one is the allocated memory
            tensor = tensors.pop(spec.name)
            if spec.name not in resident.shared:
                resident.tensors[spec.name].copy_(tensor)
        return LocalLoad(resident, resident.total_bytes)

    def rollback(self, ctx: LoadContext) -> None:
        """Nothing is held before `load` returns."""


def same_bytes(tensors: Mapping[str, Any]) -> Callable[[Any], list[str]]:
    """A `share` for the host store: the names whose bytes in `tensors` are those of a held version's entries
    (by sha256, computed once a tensor and only when asked)."""
    digests: dict[str, str] = {}

    def digest(name: str) -> str:
        if name not in digests:
            flat = tensors[name].detach().contiguous().reshape(-1).view(torch.uint8)
            digests[name] = hashlib.sha256(flat.cpu().numpy()).hexdigest()
        return digests[name]

    def share(version: Any) -> list[str]:
        return [e.name for e in version.entries if e.name in tensors and e.nbytes and digest(e.name) == e.sha256]

    return share


def source_label(result: Any) -> str:
    """`peer/<replica>`, `s3` or `local`."""
    return result.source.label if hasattr(result.source, "label") else result.source


class ApiSources:
    """What a rank reads from the API while loading: peer sources, WeightVersions and S3 credentials. Each read
    is retried with backoff while the apiserver is unreachable or failing (`apiretry.call_with_retry`), so a
    short outage delays a load instead of failing it."""

    def __init__(self, api: client.ApiClient, namespace: str, stopping: threading.Event | None = None) -> None:
        self._api = api
        self._objects = client.CustomObjectsApi(api)
        self._leases = client.CoordinationV1Api(api)
        self.namespace = namespace
        self._stopping = stopping or threading.Event()

    def _read(self, what: str, fn: Callable[[], Any]) -> Any:
        return call_with_retry(fn, what=f"reading {what} in {self.namespace}", stop=self._stopping)

    def replica(self, name: str) -> dict[str, Any]:
        return self._read(
            f"WeightReplica {name}",
            lambda: self._objects.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name),
        )

    def candidates(
        self, version: str, self_name: str, wait_s: float, note: Callable[[str], None], progress: Progress | None = None
    ) -> Callable[[LoadContext], list]:
        """Peer sources for a rank: replicas serving the very WeightVersion object of that name, which must exist,
        be Ready and be of the replica's model (raises otherwise; `ctx.version_uid` says which object). When
        there are none yet but another replica is the first loader of the version, wait up to `wait_s` for it
        (`note` says so, and `progress` names it as the source waited on) and copy from it, instead of all
        reading S3."""

        def check(ctx: LoadContext) -> str:
            body = self.version(version)
            problem = peer_version_problem(body, name=version, model=ctx.model)
            if problem is not None:
                raise ValueError(problem)
            assert body is not None
            return str(body["metadata"]["uid"])

        def listed(ctx: LoadContext) -> tuple[list, dict]:
            # By model, not by the version label: that names spec.version, and a replica moving to a newer version
            # still serves this one until the newer one is resident (make-before-break).
            replicas = self._objects.list_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, label_selector=f"{LABEL_MODEL}={label_value(ctx.model)}"
            )["items"]
            leases = {
                lease.metadata.name: self._api.sanitize_for_serialization(lease)
                for lease in self._leases.list_namespaced_lease(self.namespace).items
            }
            return replicas, leases

        def once(ctx: LoadContext, uid: str) -> tuple[list, list]:
            replicas, leases = self._read(f"the sources of {version}", lambda: listed(ctx))
            found = source_candidates(
                replicas, leases, version=version, rank=ctx.rank, self_replica=self_name,
                now=dt.datetime.now(dt.UTC), world_size=ctx.world_size, version_uid=uid,
            )  # fmt: skip
            return found, replicas

        def listing(ctx: LoadContext) -> list:
            ctx.version_uid = uid = check(ctx)
            found, replicas = once(ctx, uid)
            deadline = time.monotonic() + wait_s
            waited_on = None
            while not found and time.monotonic() < deadline:
                leader = first_loader(replicas, version=version, self_replica=self_name)
                if leader == self_name or self._stopping.is_set():
                    break
                note(f"waiting for {leader} to load {version}")
                if progress is not None and leader != waited_on:  # once: progress reports reset stall detection
                    progress(0, 0, f"peer/{leader}")  # a stall names the peer waited on
                    waited_on = leader
                time.sleep(0.5)
                found, replicas = once(ctx, uid)
            return found

        return listing

    def version(self, name: str) -> dict | None:
        try:
            return self._read(
                f"WeightVersion {name}",
                lambda: self._objects.get_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, "weightversions", name
                ),
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def credentials(self, storage: Mapping) -> dict[str, str] | None:
        secret = storage.get("credentialsSecret")
        if not secret:
            return None  # the agent's own environment (instance role, env vars)
        data = self._read(
            f"Secret {secret}", lambda: client.CoreV1Api(self._api).read_namespaced_secret(secret, self.namespace).data
        )
        return credentials_from_secret_data(data)


def read_guard(auth: WorkerAuth | None, namespace: str, ctx: LoadContext) -> ReadGuard | None:
    """What a rank's worker service admits: readers whose node is assigned the namespace/model/version it loaded
    (`ctx` after the load, never a spec read before it: the version it names may have moved on since)."""
    if auth is None:
        return None
    return auth.guard(ServedVersion(namespace, ctx.model, ctx.version))


def serve_rank(
    resident: ResidentWeights,
    peer: NixlPeer,
    *,
    rank: int,
    host: str,
    spec: Mapping[str, Any],
    guard: ReadGuard | None,
) -> tuple[WorkerServer, dict[str, Any]]:
    """Publish a loaded rank as a P2P source: its worker service, and its `status.ranks[]` entry."""
    timeout_s = TransferSettings.from_spec(spec.get("transfer") or {}).timeout_s
    server = serve_resident(resident, peer, rank=rank, host=host, transfer_timeout_s=timeout_s, guard=guard)
    entry = {
        "rank": rank, "agentName": peer.name, "grpcEndpoint": server.endpoint,
        "tensorCount": resident.tensor_count, "manifestDigest": resident.digest, "state": RankState.READY,
    }  # fmt: skip
    return server, entry


def rank_device(device: str, rank: int) -> str:
    """The device of a rank: every rank of a replica runs on its own GPU of the node."""
    return f"cuda:{rank}" if device == "cuda" else device


def rank_context(group: RankGroup, replica: str, spec: Mapping[str, Any]) -> LoadContext:
    """The context of this rank's load; its `attempts` say what was tried, also when the load fails."""
    world = group.world_size
    if spec.get("ranks", 1) != world:
        raise ValueError(f"{replica} has {spec.get('ranks', 1)} ranks but the rank group has {world}")
    return LoadContext(
        model=spec["modelName"], version="", rank=group.rank, target_id=replica,
        device=rank_device(spec.get("device", "cpu"), group.rank), world_size=world,
    )  # fmt: skip


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
) -> Any:
    """Load this rank (`ctx` from `rank_context`) of a replica, agreeing on everything with the other ranks, and
    return the chain's result. Every strategy allocates its target with `allocate`."""
    settings = TransferSettings.from_spec(spec.get("transfer") or {})
    replica = ctx.target_id
    version = configured or ""
    strategies: dict[str, Any] = {
        "Peer": PeerStrategy(
            peer=peer, candidates=sources.candidates(version, replica, settings.timeout_s, note, progress),
            settings=settings, progress=progress, credentials=credentials, allocate=allocate,
        ),
    }  # fmt: skip
    if store is not None:
        strategies["ObjectStorage"] = ObjectStorageStrategy(
            namespace=sources.namespace, fetch_version=sources.version, credentials=sources.credentials,
            store=store, default_endpoint=s3_endpoint, progress=progress, timeout_s=settings.timeout_s,
            allocate=allocate,
        )  # fmt: skip
    local = LocalFileStrategy(seeds, sources.namespace, sources.version, allocate)
    return run_cold_start(
        group, ctx, configured=configured,
        source_order=spec.get("sourceOrder") or DEFAULT_SOURCE_ORDER,
        strategies=strategies, exact=[local],
        release=lambda r: peer.deregister(r.resident),
    )  # fmt: skip
