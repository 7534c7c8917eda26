"""The node-local checkpoint store (after ModelExpress's, simplified): what the ObjectStorage strategy downloaded
and derived, kept so that the next load of the same model only fetches what is missing.

Layout under `<root>/<namespace>/<quoted model name>/` (a model's store key is `<namespace>/<model>`, see
`model_key`: two tenants' versions of the same name never share a path):

- `full/<v>/`          a FullCheckpoint as published (index + shards), immutable;
- `deltas/<v>/`        an XorDelta as published (index + shards), immutable;
- `materialized/<v>/`  a derived full checkpoint of delta version v (the root's index and shard layout with the
                       deltas applied), plus `checksums.json` (v's adler32 per tensor) and `chain.json`;
- `state.json`         `{status: READY|UPDATING, version, chain, target, target_chain}`: `version` is the last
                       activated version and `chain` its replay chain; `target` is the one being prepared
                       (UPDATING) or prepared and waiting for every rank to load it before activation (READY).

Every artifact is written into `<kind>/<v>.tmp/`, its files and the folder are fsynced, and then it is renamed
into place, its marker `source.json` (source URI, identity, file sizes) written last. So a folder without the `.tmp`
suffix is complete, and a crash at any point leaves only `*.tmp` debris, which `recover()` removes on start.
`state.json` is replaced atomically the same way and says UPDATING before any artifact of an update is written;
`recover()` turns an interrupted update back into READY at the last activated version.

Identity: every artifact's marker records the `VersionIdentity` of each version its bytes derive from (one for
a full or a delta, the whole replay chain for a materialized version): namespace, WeightVersion uid, storage URI
and the sha256 of the index object. `artifact(ref, identity)` hands out a stored copy only when that identity
matches the version being loaded; a copy of another identity (a deleted and republished name, an index that
changed) is discarded, so the load fetches the version again instead of serving or mixing in other bytes.

Quota: `reserve()` evicts materialized → deltas → full, least recently used first, and never an artifact of
an active chain (the last activated chain of every model, and the chains of updates in progress). If it still
cannot fit it raises `CheckpointCacheCapacityError` before evicting anything. The store is a cache: a load that
streams into memory and would write the store behind serves the version all the same and skips the store
(its attempt says `StoreSkipped`); only a load built from the store itself fails.

One lock (a thread lock plus `flock` on `<root>/.lock`, so two processes on one root also serialize) guards all
mutations; callers hold `lock()` across a whole load.

Write-behind: `write_behind(job)` queues a job (e.g. storing what a load already streamed into memory) on the
store's one writer thread, off the load's critical path. A job writes through `write()` and `update()` like any
caller, so a crash mid-job leaves only tmp debris and an UPDATING state, which `recover()` undoes. Every other
thread's `lock()` and read of the store (`state`, `artifacts`, `usage`) first waits for the queued jobs, so what
a finished load stored is seen by whatever comes next; `flush()` waits explicitly, `close()` too.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import threading
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

STATE_FILE = "state.json"
MARKER = "source.json"
TMP_SUFFIX = ".tmp"
LOCK_FILE = ".lock"
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # a Kubernetes namespace: a DNS label


class ArtifactKind(StrEnum):
    FULL = "full"
    DELTA = "deltas"
    MATERIALIZED = "materialized"


EVICTION_ORDER = (ArtifactKind.MATERIALIZED, ArtifactKind.DELTA, ArtifactKind.FULL)  # cheapest to rebuild first


class StoreStatus(StrEnum):
    READY = "READY"
    UPDATING = "UPDATING"


class CheckpointCacheCapacityError(RuntimeError):
    """The store cannot make room without evicting an active chain."""


def model_key(namespace: str, model: str) -> str:
    """The store key of a model of one namespace: what `ArtifactRef.model` and the per-model methods take."""
    return f"{namespace}/{model}"


def index_digest(raw: bytes) -> str:
    """The digest a WeightVersion records as `status.indexDigest`: sha256 (hex) of its index object."""
    return hashlib.sha256(raw).hexdigest()


@dataclass(frozen=True)
class VersionIdentity:
    """What determines the bytes of one stored version: the WeightVersion object (namespace and uid; a deleted
    and republished name is another version), where it is stored, and the digest of its index."""

    namespace: str
    uid: str
    uri: str
    index_digest: str | None = None  # expected: None when the WeightVersion records none (then not compared)

    def to_json(self) -> dict[str, Any]:
        return {"namespace": self.namespace, "uid": self.uid, "uri": self.uri, "indexDigest": self.index_digest}

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> VersionIdentity:
        return cls(str(doc["namespace"]), str(doc["uid"]), str(doc["uri"]), doc.get("indexDigest"))

    def matches(self, stored: VersionIdentity) -> bool:
        """`self` is what a load expects, `stored` what a marker recorded (always with the actual digest)."""
        return (self.namespace, self.uid, self.uri) == (stored.namespace, stored.uid, stored.uri) and (
            self.index_digest is None or self.index_digest == stored.index_digest
        )


def identities_match(expected: Sequence[VersionIdentity], stored: Sequence[VersionIdentity]) -> bool:
    return len(expected) == len(stored) and all(e.matches(s) for e, s in zip(expected, stored, strict=True))


@dataclass(frozen=True)
class ArtifactRef:
    model: str  # the store key, `model_key(namespace, model name)`
    kind: ArtifactKind
    version: str

    def __str__(self) -> str:
        return f"{self.model}:{self.kind}/{self.version}"


@dataclass(frozen=True)
class StoredArtifact:
    ref: ArtifactRef
    path: Path
    size: int
    mtime: float


@dataclass(frozen=True)
class StoreState:
    status: StoreStatus = StoreStatus.READY
    version: str | None = None
    chain: tuple[str, ...] = ()
    target: str | None = None
    target_chain: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {
            "status": str(self.status),
            "version": self.version,
            "chain": list(self.chain),
            "target": self.target,
            "target_chain": list(self.target_chain),
        }

    @classmethod
    def from_json(cls, doc: Mapping[str, Any]) -> StoreState:
        """Strict: anything unexpected raises ValueError, and `recover()` then rebuilds the state."""
        status = StoreStatus(doc["status"])
        chain = tuple(doc.get("chain") or ())
        version = doc.get("version")
        if (version is None) != (not chain) or (chain and chain[-1] != version):
            raise ValueError(f"version {version!r} does not end its chain {list(chain)}")
        if not all(isinstance(v, str) and v for v in chain):
            raise ValueError(f"chain {list(chain)} is not a list of version names")
        return cls(status, version, chain, doc.get("target"), tuple(doc.get("target_chain") or ()))


def head_ref(model: str, chain: tuple[str, ...]) -> ArtifactRef:
    """The artifact holding the weights of the last version of `chain`."""
    if len(chain) == 1:
        return ArtifactRef(model, ArtifactKind.FULL, chain[0])
    return ArtifactRef(model, ArtifactKind.MATERIALIZED, chain[-1])


def chain_refs(model: str, chain: Iterable[str]) -> set[ArtifactRef]:
    """What a chain needs to be served and rebuilt: its root full, its deltas and its head. Intermediate
    materialized versions are left evictable: a long chain would otherwise pin one full copy per link."""
    chain = tuple(chain)
    if not chain:
        return set()
    refs = {ArtifactRef(model, ArtifactKind.FULL, chain[0]), head_ref(model, chain)}
    refs.update(ArtifactRef(model, ArtifactKind.DELTA, v) for v in chain[1:])
    return refs


def _check_name(what: str, name: str) -> None:
    # Versions are Kubernetes names; the checks keep every path inside the store and apart from tmp debris.
    if not name or name in (".", "..") or "/" in name or "\0" in name or name.endswith(TMP_SUFFIX):
        raise ValueError(f"{what} {name!r} cannot be stored (empty, a path, or ending in {TMP_SUFFIX!r})")


def _is_legacy_model_dir(path: Path) -> bool:
    """`<root>/<model>/` of the layout before namespaces: its state file or artifacts sit one level higher than
    in `<root>/<namespace>/<model>/`."""
    return (path / STATE_FILE).is_file() or any(any((path / kind).glob(f"*/{MARKER}")) for kind in ArtifactKind)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json_atomic(path: Path, doc: Any) -> None:
    """tmp + fsync + rename + fsync of the folder: the file is either the old or the new document."""
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _mkdirs(path: Path) -> None:
    """mkdir -p that makes each new folder's entry durable too (a crash must not lose a committed artifact's
    folder chain)."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        folder.mkdir(exist_ok=True)
        _fsync_dir(folder.parent)


def _files(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def _tree_size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@dataclass
class Update:
    """An update in progress (see `CheckpointStore.update`). `commit()` activates the target; with
    `activate=False` it only marks it prepared, for `CheckpointStore.activate` once every rank has loaded it."""

    store: CheckpointStore
    model: str
    target: str
    chain: tuple[str, ...]
    previous: StoreState
    committed: bool = field(default=False, init=False)

    def commit(self, *, activate: bool = True) -> None:
        head = head_ref(self.model, self.chain)
        if self.store.artifact(head) is None:
            raise RuntimeError(f"cannot activate {self.target}: its artifact {head} is not in the store")
        if activate:
            state = StoreState(StoreStatus.READY, self.target, self.chain)
        else:
            state = StoreState(StoreStatus.READY, self.previous.version, self.previous.chain, self.target, self.chain)
        self.store._write_state(self.model, state)
        self.committed = True


class CheckpointStore:
    def __init__(self, root: Path, quota_bytes: int) -> None:
        if quota_bytes <= 0:
            raise ValueError(f"quota_bytes must be positive, got {quota_bytes}")
        self.root = Path(root)
        self.quota_bytes = quota_bytes
        self.root.mkdir(parents=True, exist_ok=True)
        self._mutex = threading.RLock()
        self._depth = 0
        self._lock_fd = os.open(self.root / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        self._pins: list[set[ArtifactRef]] = []  # chains of updates in progress
        self._owner: int | None = None  # the thread holding `lock()`
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="ferry-store-writer")
        self._writer_thread: int | None = None
        self._queued: list[Future[None]] = []
        self._queued_lock = threading.Lock()

    def close(self) -> None:
        self.flush()
        self._writer.shutdown(wait=True)
        with self._mutex:
            if self._lock_fd >= 0:
                os.close(self._lock_fd)
                self._lock_fd = -1

    # ------------------------------------------------------------------ write-behind

    def write_behind(self, job: Callable[[], None], what: str) -> None:
        """Run `job` on the writer thread after the jobs queued before it. A failed job is logged (what it
        stores is a cache: the next load fetches it again), never raised into a load."""

        def run() -> None:
            self._writer_thread = threading.get_ident()
            try:
                job()
            except CheckpointCacheCapacityError as exc:  # the store filled meanwhile: a cache miss, not a bug
                log.warning("write-behind of %s skipped: %s; the next load fetches it again", what, exc)
            except Exception:
                log.exception("write-behind of %s failed; the next load fetches it again", what)

        with self._queued_lock:
            self._queued = [f for f in self._queued if not f.done()]
            self._queued.append(self._writer.submit(run))

    def flush(self) -> None:
        """Wait for every queued write-behind job. A no-op on the writer thread and in the thread holding the
        lock (a job waits for that lock: waiting for it there would never end)."""
        if threading.get_ident() in (self._writer_thread, self._owner):
            return
        with self._queued_lock:
            queued, self._queued = self._queued, []
        for future in queued:
            future.result()  # `run` logs failures: nothing raises here

    @contextlib.contextmanager
    def lock(self) -> Iterator[None]:
        """Reentrant within this process; `flock` excludes other processes sharing the root. Waits for the
        queued write-behind jobs first, so a load sees what the loads before it stored."""
        self.flush()
        with self._mutex:
            if self._depth == 0:
                fcntl.flock(self._lock_fd, fcntl.LOCK_EX)
                self._owner = threading.get_ident()
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
                if self._depth == 0:
                    self._owner = None
                    fcntl.flock(self._lock_fd, fcntl.LOCK_UN)

    # ------------------------------------------------------------------ paths and reads

    def model_dir(self, model: str) -> Path:
        """The folder of a store key (`model_key`): `<root>/<namespace>/<quoted model name>`."""
        namespace, _, name = model.partition("/")
        if not _NAMESPACE.fullmatch(namespace) or not name or name in (".", ".."):
            raise ValueError(f"model {model!r} cannot be stored (expected a key <namespace>/<model name>)")
        return self.root / namespace / urllib.parse.quote(name, safe="")

    def _model_dirs(self) -> list[tuple[str, Path]]:
        """(store key, folder) of every model in the store."""
        found = []
        for ns_dir in sorted(p for p in self.root.iterdir() if p.is_dir() and _NAMESPACE.fullmatch(p.name)):
            for model_dir in sorted(p for p in ns_dir.iterdir() if p.is_dir()):
                found.append((model_key(ns_dir.name, urllib.parse.unquote(model_dir.name)), model_dir))
        return found

    def path(self, ref: ArtifactRef) -> Path:
        _check_name("version", ref.version)
        return self.model_dir(ref.model) / ref.kind / ref.version

    def state(self, model: str) -> StoreState:
        self.flush()
        path = self.model_dir(model) / STATE_FILE
        try:
            return StoreState.from_json(json.loads(path.read_text()))
        except FileNotFoundError:
            return StoreState()

    def artifact(self, ref: ArtifactRef, identity: Sequence[VersionIdentity] | None = None) -> Path | None:
        """The folder of a complete artifact, or None. One whose files no longer match its marker (sizes), or
        (when `identity` is given) whose recorded identity is not the expected one, is discarded: a copy of
        other bytes is never handed out, and the load that asked overwrites it. Marks the artifact recently
        used, for eviction."""
        with self.lock():
            path = self.path(ref)
            if not path.is_dir():
                return None
            if not self._intact(path):
                self.discard(ref)
                return None
            if identity is not None and not identities_match(identity, self.identity(ref)):
                self.discard(ref)
                return None
            os.utime(path)
            return path

    def identity(self, ref: ArtifactRef) -> tuple[VersionIdentity, ...]:
        """The identities an artifact was written with (root first for a materialized one); () if unreadable."""
        try:
            docs = json.loads((self.path(ref) / MARKER).read_text()).get("identity") or []
            return tuple(VersionIdentity.from_json(d) for d in docs)
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return ()

    def source(self, ref: ArtifactRef) -> dict[str, Any]:
        """The `source` document an artifact was written with (for example the S3 URI of its index)."""
        return json.loads((self.path(ref) / MARKER).read_text())["source"]

    @staticmethod
    def _intact(path: Path) -> bool:
        try:
            files = json.loads((path / MARKER).read_text())["files"]
            return all((path / name).stat().st_size == size for name, size in files.items())
        except (OSError, ValueError, KeyError, TypeError):
            return False

    def artifacts(self) -> list[StoredArtifact]:
        """Every complete-looking artifact (no tmp debris), across models."""
        self.flush()
        found: list[StoredArtifact] = []
        for model, model_dir in self._model_dirs():
            for kind in ArtifactKind:
                kind_dir = model_dir / kind
                if not kind_dir.is_dir():
                    continue
                for path in sorted(kind_dir.iterdir()):
                    if path.is_dir() and not path.name.endswith(TMP_SUFFIX):
                        ref = ArtifactRef(model, kind, path.name)
                        found.append(StoredArtifact(ref, path, _tree_size(path), path.stat().st_mtime))
        return found

    def usage(self) -> int:
        """Bytes of everything under the root, debris included."""
        self.flush()
        return _tree_size(self.root)

    # ------------------------------------------------------------------ writes

    def _write_state(self, model: str, state: StoreState) -> None:
        folder = self.model_dir(model)
        _mkdirs(folder)
        write_json_atomic(folder / STATE_FILE, {"model": model, **state.to_json()})

    @contextlib.contextmanager
    def write(
        self, ref: ArtifactRef, source: Mapping[str, Any], identity: Sequence[VersionIdentity] = ()
    ) -> Iterator[Path]:
        """Yield an empty `<v>.tmp` folder to fill; on a clean exit fsync everything, write the marker (with
        `identity`, what `artifact()` checks) and rename it into place. On an exception the tmp folder is
        removed and nothing changes."""
        with self.lock():
            final = self.path(ref)
            if final.exists():
                raise FileExistsError(f"artifact {ref} already exists; artifacts are immutable")
            tmp = final.with_name(final.name + TMP_SUFFIX)
            _remove(tmp)  # debris of a crashed writer
            _mkdirs(tmp.parent)
            tmp.mkdir()
            try:
                yield tmp
                files = _files(tmp)
                for name in files:
                    _fsync_file(tmp / name)
                # Written last; this also fsyncs the folder, making every entry in it durable.
                marker = {"source": dict(source), "identity": [i.to_json() for i in identity], "files": files}
                write_json_atomic(tmp / MARKER, marker)
                os.rename(tmp, final)
                _fsync_dir(final.parent)
            except BaseException:
                _remove(tmp)
                raise

    def discard(self, ref: ArtifactRef) -> None:
        """Remove an artifact: renamed to tmp debris first, so a crash mid-delete leaves nothing half-valid."""
        with self.lock():
            path = self.path(ref)
            if not path.exists():
                return
            doomed = path.with_name(f"{path.name}.deleting{TMP_SUFFIX}")
            _remove(doomed)
            os.rename(path, doomed)
            _fsync_dir(path.parent)
            _remove(doomed)

    @contextlib.contextmanager
    def update(
        self, model: str, target: str, chain: Iterable[str], protect: Iterable[ArtifactRef] = ()
    ) -> Iterator[Update]:
        """Prepare `target` (replayed through `chain`) under the lock: persist UPDATING first, pin the chain's
        artifacts (and `protect`) against eviction, and on exit without `commit()` go back to READY at the
        previously activated version."""
        chain = tuple(chain)
        if not chain or chain[-1] != target:
            raise ValueError(f"chain {list(chain)} does not end at {target!r}")
        with self.lock():
            previous = self.state(model)
            pins = chain_refs(model, chain) | set(protect)
            self._pins.append(pins)
            handle = Update(self, model, target, chain, previous)
            try:
                self._write_state(
                    model, StoreState(StoreStatus.UPDATING, previous.version, previous.chain, target, chain)
                )
                yield handle
            finally:
                self._pins.remove(pins)
                if not handle.committed:
                    self._write_state(model, StoreState(StoreStatus.READY, previous.version, previous.chain))

    def prepared_head(self, model: str, chain: Iterable[str]) -> Path | None:
        """The folder holding the last version of `chain` when that version is prepared or active, else None:
        what the other ranks of a replica load from after their local leader prepared it."""
        chain = tuple(chain)
        with self.lock():
            state = self.state(model)
            if chain not in (state.chain, state.target_chain):
                return None
            return self.artifact(head_ref(model, chain))

    def activate(self, model: str, target: str, chain: Iterable[str]) -> None:
        """Activate a prepared `target` (see `Update.commit(activate=False)`); a no-op if it is already active."""
        chain = tuple(chain)
        with self.lock():
            state = self.state(model)
            if state.version == target and state.chain == chain:
                if state.target == target:  # prepared again while active: drop the duplicate mark
                    self._write_state(model, StoreState(StoreStatus.READY, target, chain))
                return
            if state.target != target or state.target_chain != chain:
                raise RuntimeError(
                    f"cannot activate {model}:{target}: it is not the prepared version (prepared: {state.target}, "
                    f"active: {state.version})"
                )
            if self.artifact(head_ref(model, chain)) is None:
                raise RuntimeError(f"cannot activate {model}:{target}: its artifact is no longer in the store")
            self._write_state(model, StoreState(StoreStatus.READY, target, chain))

    def release_prepared(self, model: str, target: str) -> None:
        """Forget a prepared, never activated `target`: its chain is no longer protected from eviction."""
        with self.lock():
            state = self.state(model)
            if state.status == StoreStatus.READY and state.target == target:
                self._write_state(model, StoreState(StoreStatus.READY, state.version, state.chain))

    # ------------------------------------------------------------------ quota

    def protected(self) -> set[ArtifactRef]:
        """Artifacts eviction must keep: every model's active chain, its prepared one, and the chains of updates
        in progress."""
        refs: set[ArtifactRef] = set().union(*self._pins) if self._pins else set()
        for model, model_dir in self._model_dirs():
            if (model_dir / STATE_FILE).is_file():
                with contextlib.suppress(ValueError, KeyError, TypeError):  # unreadable state protects nothing
                    state = self.state(model)
                    refs |= chain_refs(model, state.chain) | chain_refs(model, state.target_chain)
        return refs

    def reserve(self, nbytes: int, protect: Iterable[ArtifactRef] = ()) -> list[ArtifactRef]:
        """Make room for `nbytes` more within the quota and the filesystem's free space, evicting unprotected
        artifacts (materialized → deltas → full, least recently used first; never one of `protect`, e.g. what a
        load outside an `update` reads). Returns what was evicted."""
        with self.lock():
            usage = self.usage()
            free_disk = shutil.disk_usage(self.root).free
            over_quota = usage + nbytes - self.quota_bytes
            over_disk = nbytes - free_disk
            if over_quota <= 0 and over_disk <= 0:
                return []
            protected = self.protected() | set(protect)
            candidates = sorted(
                (a for a in self.artifacts() if a.ref not in protected),
                key=lambda a: (EVICTION_ORDER.index(a.ref.kind), a.mtime),
            )
            chosen: list[StoredArtifact] = []
            for artifact in candidates:
                if over_quota <= 0 and over_disk <= 0:
                    break
                chosen.append(artifact)
                over_quota -= artifact.size
                over_disk -= artifact.size
            if over_quota > 0 or over_disk > 0:
                # Decided before evicting anything: a reservation that cannot succeed must not empty the cache.
                pinned = sorted(str(r) for r in protected)
                limit = (
                    f"quota {self.quota_bytes} bytes with {usage} in use"
                    if over_quota > 0
                    else f"only {free_disk} bytes free on the filesystem"
                )
                raise CheckpointCacheCapacityError(
                    f"checkpoint store {self.root} cannot fit {nbytes} more bytes ({limit}); everything else "
                    f"belongs to active chains and is never evicted: {pinned}. Raise the quota or free space."
                )
            for artifact in chosen:
                self.discard(artifact.ref)
            return [a.ref for a in chosen]

    # ------------------------------------------------------------------ recovery

    def recover(self) -> list[str]:
        """Run on start: remove tmp debris and incomplete artifacts, and turn every interrupted update (or an
        unreadable state) back into a consistent READY state; remove model folders of the layout before namespaces
        (`<root>/<model>/`, no identity: never used). Returns what it did, for the log."""
        actions: list[str] = []
        with self.lock():
            for legacy in sorted(p for p in self.root.iterdir() if p.is_dir() and _is_legacy_model_dir(p)):
                _remove(legacy)
                actions.append(f"removed {legacy.name}: a model folder of the layout without namespaces")
            for model, model_dir in self._model_dirs():
                for kind in ArtifactKind:
                    kind_dir = model_dir / kind
                    for path in sorted(kind_dir.iterdir()) if kind_dir.is_dir() else ():
                        if path.name.endswith(TMP_SUFFIX):
                            _remove(path)
                            actions.append(f"removed debris {path.relative_to(self.root)}")
                        elif not self._intact(path):
                            _remove(path)
                            actions.append(f"removed incomplete artifact {path.relative_to(self.root)}")
                for debris in model_dir.glob(f"*{TMP_SUFFIX}"):
                    _remove(debris)
                    actions.append(f"removed debris {debris.relative_to(self.root)}")
                actions.extend(self._recover_state(model))
        return actions

    def _recover_state(self, model: str) -> list[str]:
        actions: list[str] = []
        try:
            state = self.state(model)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            state = StoreState()
            actions.append(f"{model}: state.json unreadable ({exc}); rebuilt as READY with no active version")
        if state.status == StoreStatus.UPDATING:
            actions.append(f"{model}: update to {state.target} was interrupted; back to READY at {state.version}")
        state = StoreState(StoreStatus.READY, state.version, state.chain)
        if state.chain and not (self.path(head_ref(model, state.chain)) / MARKER).is_file():
            actions.append(f"{model}: active version {state.version} is no longer stored; no active version")
            state = StoreState()
        self._write_state(model, state)
        return actions
