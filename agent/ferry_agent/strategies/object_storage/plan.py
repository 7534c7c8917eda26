"""Phases 1 and 2 of an object-storage load, which change nothing: resolve the replay chain from the API
(`Planner.resolve`), then validate every index and shard header, from the store where it holds a version of the
chain and from S3 otherwise, and decide what to read and apply (`Planner.plan`)."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import closing
from typing import Any

from botocore.exceptions import BotoCoreError, ClientError

from ferry import checkpoint_format as ckpt
from ferry.api.models import MAX_CHAIN_LENGTH, WeightFormat
from ferry.chain import VersionView, resolve_chain
from ferry.s3 import parse_s3_uri
from ferry.storage import HEADER_PROBE_BYTES, MAX_INDEX_BYTES, get_prefix, object_size
from ferry_agent.ranks.sharding import rank_specs
from ferry_agent.store.checkpoints import (
    ArtifactKind,
    ArtifactRef,
    CheckpointStore,
    VersionIdentity,
    index_digest,
    model_key,
)
from ferry_agent.store.resident import manifest_digest
from ferry_agent.strategies.chain import LoadContext
from ferry_agent.strategies.object_storage.checkpoint import (
    CHECKSUMS_FILE,
    Checkpoint,
    Link,
    LoadError,
    Plan,
    Shard,
    layout_specs,
    s3_error,
)
from ferry_agent.strategies.object_storage.files import run_tasks
from ferry_agent.strategies.progress import Progress

log = logging.getLogger(__name__)


class Planner:
    """Reads the API (`fetch_version`), the node's `store` and S3 (`client(link)`) for one replica's `namespace`;
    `progress` is told which S3 object a validation waits on."""

    def __init__(
        self,
        *,
        namespace: str,
        fetch_version: Callable[[str], Mapping[str, Any] | None],
        store: CheckpointStore,
        client: Callable[[Link], Any],
        progress: Progress | None = None,
    ) -> None:
        self._namespace = namespace
        self._fetch_version = fetch_version
        self._store = store
        self._client = client
        self._progress = progress

    def key(self, ctx: LoadContext) -> str:
        """The replica's model in the store: namespace-scoped, so two tenants' versions never share a path."""
        return model_key(self._namespace, ctx.model)

    def resolve(self, ctx: LoadContext) -> list[Link]:
        bodies: dict[str, Mapping[str, Any] | None] = {}

        def lookup(name: str) -> VersionView | None:
            if name not in bodies:
                try:
                    bodies[name] = self._fetch_version(name)
                except Exception as exc:
                    raise LoadError(f"reading WeightVersion {name} failed: {exc}") from exc
            body = bodies[name]
            return None if body is None else VersionView.from_body(body)

        result = resolve_chain(ctx.version, lookup, MAX_CHAIN_LENGTH)
        if not result.ok:
            raise LoadError(f"cannot replay {ctx.version}: {result.reason}: {result.message}")
        links: list[Link] = []
        for name in result.chain:
            body = bodies[name] or {}
            view = VersionView.from_body(body)
            where = "" if name == ctx.version else f" (in the replay chain of {ctx.version})"
            if view.format == WeightFormat.PEER_ONLY:
                raise LoadError(f"{name} is PeerOnly: it is served from memory only and has nothing stored")
            if view.model_name != ctx.model:
                raise LoadError(f"WeightVersion {name}{where} is for model {view.model_name!r}, not {ctx.model!r}")
            if not view.ready:  # resolve_chain checks only the direct base; replay needs every link
                raise LoadError(f"WeightVersion {name}{where} is not Ready")
            storage = (body.get("spec") or {}).get("storage") or {}
            try:
                bucket, key = parse_s3_uri(storage.get("uri", ""))
            except ValueError as exc:
                raise LoadError(f"WeightVersion {name}{where} has no usable spec.storage.uri: {exc}") from exc
            try:
                self._store.path(ArtifactRef(self.key(ctx), ArtifactKind.FULL, name))
            except ValueError as exc:  # e.g. a version named *.tmp, which the store reserves for debris
                raise LoadError(f"WeightVersion {name}{where}: {exc}") from exc
            metadata = body.get("metadata") or {}
            if metadata.get("namespace", self._namespace) != self._namespace:
                raise LoadError(f"WeightVersion {name}{where} is of namespace {metadata['namespace']!r}")
            digest = (body.get("status") or {}).get("indexDigest") or None
            links.append(
                Link(
                    name,
                    view.format,
                    view.base_version,
                    storage,
                    bucket,
                    key,
                    self._namespace,
                    str(metadata.get("uid") or ""),
                    digest,
                )
            )
        return links

    def plan(
        self,
        ctx: LoadContext,
        links: list[Link],
        pool: ThreadPoolExecutor,
        *,
        remote: bool = True,
        held: Sequence[Any] = (),
    ) -> Plan:
        """What to read and apply. With `remote=False` everything must already be in the store (a rank loading
        what its local leader prepared). `held`: the versions of the replica sealed in the agent's host memory
        (`memstore.SealedVersion`); the newest one of the chain is the base unless the store holds a newer one (the
        bytes of the very WeightVersion object, by uid, checked when it was loaded and sealed since)."""
        model = self.key(ctx)

        def fetch(ref: ArtifactRef, link: Link) -> Checkpoint:
            if not remote:
                raise LoadError(f"{ref} is not in this node's checkpoint store; the local leader did not prepare it")
            return self._remote(ref, link, pool)

        chain = tuple(link.name for link in links)
        base: Checkpoint | None = None
        start = 0
        for i in range(len(links) - 1, 0, -1):  # the newest materialized version of the chain
            ref = ArtifactRef(model, ArtifactKind.MATERIALIZED, links[i].name)
            base = self._stored(ref, links[i], [link.expected for link in links[: i + 1]])
            if base is not None:
                start = i
                break
        if base is None:
            ref = ArtifactRef(model, ArtifactKind.FULL, links[0].name)
            base = self._stored(ref, links[0])
        in_memory = self._held_base(links, held, than=start if base is not None else -1)
        if in_memory is not None:
            start, version = in_memory
            base = self._held_checkpoint(model, links, start, version, base, fetch)
        elif base is None:
            base = fetch(ArtifactRef(model, ArtifactKind.FULL, links[0].name), links[0])
        reused = None if base.path is None else f"{base.ref.kind}/{base.ref.version}"
        if in_memory is not None:
            reused = f"held/{links[start].name}"  # in host memory
        deltas = []
        for link in links[start + 1 :]:
            ref = ArtifactRef(model, ArtifactKind.DELTA, link.name)
            deltas.append(self._stored(ref, link) or fetch(ref, link))

        # Every shard's dtypes and, in a delta, its zstd frames are checked with its header (`ckpt.check_shard`).
        layout = {name: (shard, info) for shard in base.shards.values() for name, info in shard.layout.infos.items()}
        for delta in deltas:
            for shard in delta.shards.values():
                for name in shard.layout.infos:
                    if name not in layout:
                        raise LoadError(
                            f"delta shard {delta.where(shard.name)} changes tensor {name!r}, which {chain[0]} does "
                            "not have; a layout change needs a new FullCheckpoint"
                        )
        specs = rank_specs(layout_specs(layout), ctx.rank, ctx.world_size)
        expected = ctx.expected_manifest_digest
        if expected and manifest_digest(specs) != expected:
            raise LoadError(
                f"the manifest of {ctx.version} in object storage has digest {manifest_digest(specs)}, "
                f"but the replica expects {expected}"
            )
        return Plan(model, chain, base, deltas, layout, specs, reused, in_memory[1] if in_memory else None)

    @staticmethod
    def _held_base(links: list[Link], held: Sequence[Any], *, than: int) -> tuple[int, Any] | None:
        """The newest version of the chain held in host memory, and its index, unless the store's base is newer
        (`than`: its index, -1 if none; the same version is read from memory) or it is the target itself
        (something must be replayed on it)."""
        uids = {(link.name, link.uid): i for i, link in enumerate(links[:-1]) if link.uid}
        found = [(uids[(v.version, v.uid)], v) for v in held if (v.version, v.uid) in uids]
        best = max(found, key=lambda pair: pair[0], default=None)
        return best if best is not None and best[0] >= than else None

    @staticmethod
    def _held_checkpoint(
        model: str,
        links: list[Link],
        at: int,
        version: Any,
        root: Checkpoint | None,
        fetch: Callable[[ArtifactRef, Link], Checkpoint],
    ) -> Checkpoint:
        """The base of a replay on a version held in host memory: the root's layout (index and shard headers,
        from the store or S3; every version of a chain has it), the held bytes' adler32 as checksums."""
        if root is None:
            root = fetch(ArtifactRef(model, ArtifactKind.FULL, links[0].name), links[0])
        entries = {e.name: e for e in version.entries}
        if set(entries) != {n for shard in root.shards.values() for n in shard.layout.infos}:
            raise LoadError(f"{links[at].name} held in host memory has other tensors than {links[0].name}'s checkpoint")
        link = links[at]
        return Checkpoint(
            link,
            ArtifactRef(model, ArtifactKind.MATERIALIZED, link.name),
            root.index_raw,
            root.index,
            root.shards,
            {name: f"{e.adler32:08x}" for name, e in entries.items()},
            None,
            tuple(k.expected for k in links[: at + 1]),
        )

    @staticmethod
    def _parse_index(raw: bytes, link: Link, delta: bool, where: str) -> ckpt.CheckpointIndex:
        try:
            index = ckpt.parse_index(raw)
            if delta:
                ckpt.check_delta_identity(index, version=link.name, base_version=link.base)
            elif index.is_delta:
                raise ckpt.InvalidIndex(
                    f"it is an XorDelta index (of {index.metadata['version']} on {index.metadata['base_version']}) "
                    f"but {link.name} is a FullCheckpoint"
                )
        except ckpt.InvalidIndex as exc:
            raise LoadError(f"index {where} is invalid: {exc}") from exc
        return index

    def _stored(
        self, ref: ArtifactRef, link: Link, expected: Sequence[VersionIdentity] | None = None
    ) -> Checkpoint | None:
        """A stored artifact written from exactly the `expected` versions (by default `link`'s alone),
        re-validated (headers only; tensor checksums are checked when read). One of another identity, or broken,
        is discarded and the caller falls back to S3."""
        path = self._store.artifact(ref, [link.expected] if expected is None else expected)
        if path is None:
            return None
        try:
            raw = (path / ckpt.INDEX_NAME).read_bytes()
            if ref.kind != ArtifactKind.MATERIALIZED and link.index_digest not in (None, index_digest(raw)):
                raise ValueError(f"its index does not have the digest {link.index_digest} of {link.uri}")
            index = self._parse_index(raw, link, ref.kind == ArtifactKind.DELTA, str(path))
            shards: dict[str, Shard] = {}
            for name in index.shards:
                with open(path / name, "rb") as f:
                    prefix = f.read(ckpt.HEADER_PREFIX_BYTES)
                    header = prefix + f.read(ckpt.header_length(prefix))
                layout = ckpt.check_shard(
                    header, (path / name).stat().st_size, index.tensors_in(name), delta=index.is_delta
                )
                shards[name] = Shard(name, layout, header)
            checksums = {k: v for s in shards.values() for k, v in s.layout.checksums.items()}
            if ref.kind == ArtifactKind.MATERIALIZED:
                checksums = json.loads((path / CHECKSUMS_FILE).read_text())
                if set(checksums) != set(index.weight_map):
                    raise ValueError(f"{CHECKSUMS_FILE} does not cover exactly the tensors of the index")
        except (OSError, ValueError, LoadError) as exc:  # InvalidIndex/InvalidShard are ValueErrors
            log.warning("discarding stored %s, it is unreadable: %s", ref, exc)
            self._store.discard(ref)
            return None
        return Checkpoint(link, ref, raw, index, shards, checksums, path, self._store.identity(ref))

    def _remote(self, ref: ArtifactRef, link: Link, pool: ThreadPoolExecutor) -> Checkpoint:
        """Fetch and validate a checkpoint's index and every shard header from S3 (a ranged GET each)."""
        client = self._client(link)
        if self._progress is not None:
            self._progress(0, 0, link.uri)  # what the load waits on, before the first request (stall diagnosis)
        try:
            response = client.get_object(Bucket=link.bucket, Key=link.key)
            if response["ContentLength"] > MAX_INDEX_BYTES:
                response["Body"].close()
                raise LoadError(f"index {link.uri} is {response['ContentLength']} bytes, too big to be an index")
            raw = response["Body"].read()
        except (ClientError, BotoCoreError) as exc:
            raise s3_error(exc, link.uri) from exc
        digest = index_digest(raw)
        if link.index_digest is not None and digest != link.index_digest:
            raise LoadError(
                f"index {link.uri} has sha256 {digest}, but WeightVersion {link.name} was verified with "
                f"{link.index_digest} (status.indexDigest): the object changed after it was published"
            )
        index = self._parse_index(raw, link, ref.kind == ArtifactKind.DELTA, link.uri)
        probed = run_tasks(pool, [lambda s=s: self._probe(client, link, index, s) for s in index.shards])
        shards = {s.name: s for s in probed}
        checksums = {k: v for s in shards.values() for k, v in s.layout.checksums.items()}
        identity = (VersionIdentity(link.namespace, link.uid, link.uri, digest),)
        return Checkpoint(link, ref, raw, index, shards, checksums, None, identity, client)

    @staticmethod
    def _probe(client: Any, link: Link, index: ckpt.CheckpointIndex, shard: str) -> Shard:
        uri, key = link.shard_uri(shard), link.shard_key(shard)

        def get(first: int, last: int) -> bytes:
            response = client.get_object(Bucket=link.bucket, Key=key, Range=f"bytes={first}-{last}")
            return response["Body"].read()

        try:
            # One ranged GET: its Content-Range gives the size, so no HEAD (a round trip fewer before the download).
            probe = get_prefix(client, link.bucket, key, HEADER_PROBE_BYTES)
            head, size = b"", 0
            if probe is not None:  # else an empty object (no byte 0)
                size = object_size(probe)
                with closing(probe["Body"]):  # a server that ignores the Range sends the whole shard: read the probe
                    head = probe["Body"].read(HEADER_PROBE_BYTES)
            if size < ckpt.HEADER_PREFIX_BYTES:
                raise LoadError(f"shard {uri} is only {size} bytes; it is truncated")
            header_end = ckpt.HEADER_PREFIX_BYTES + ckpt.header_length(head)
            if header_end > size:
                raise LoadError(f"shard {uri} is {size} bytes but its header alone needs {header_end}; truncated")
            if header_end > len(head):
                head += get(len(head), header_end - 1)
            layout = ckpt.check_shard(head, size, index.tensors_in(shard), delta=index.is_delta)
        except (ClientError, BotoCoreError) as exc:
            raise s3_error(exc, uri) from exc
        except ckpt.InvalidShard as exc:
            raise LoadError(exc.describe(uri)) from exc
        except ValueError as exc:  # its size unknown (`object_size`)
            raise LoadError(f"shard {uri}: {exc}") from exc
        return Shard(shard, layout, head[: layout.data_start])
