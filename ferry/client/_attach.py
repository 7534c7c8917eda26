"""`attach`: lease a version this node's agent serves and map its sealed memory, read-only and zero-copy."""

from __future__ import annotations

import contextlib
import fcntl
import math
import mmap
import os
import select
import socket
import threading
import time
import warnings
import weakref
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from ferry.client import protocol as p

DEFAULT_ROOT = "/run/ferry/pods"
_RETRY_S = 0.5
_POLL_S = 0.5  # how often an attachment's keeper looks again whether it is still wanted
_ANNOUNCE_TIMEOUT_S = 5.0  # the most an announcement waits on the agent's reply before it is tried again
# madvise(2) MADV_POPULATE_READ (Linux 5.14; Python 3.11 lacks the name): maps a range's pages in one call instead
# of one page fault per 4 KiB on first touch, which otherwise dominates a copy out of the mapping.
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
# module -> the version uid `load_into` last loaded into it, whole: what `only_changed` may build on.
_LOADED: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
# A refit writes a tensor whole, not element by element, where more than this share of its elements changed: past
# about half, the positions (8 bytes each) plus the values cost more than the whole tensor.
_SPARSE_MAX_SHARE = 0.5
# Element widths with an integer dtype: the diff compares bit patterns (NaN payloads, -0.0) in these units.
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class AttachError(Exception):
    """The agent refused (`code` says why: `NotServed`, `Forbidden`, `BadRequest`, ...) or cannot be reached."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


def socket_path(socket_dir: str | os.PathLike[str] | None = None) -> Path:
    """`socket_dir`, else `FERRY_SOCKET_DIR`, else `/run/ferry/pods/$POD_UID`; the socket in it."""
    directory = socket_dir or os.environ.get("FERRY_SOCKET_DIR")
    if not directory:
        uid = os.environ.get("POD_UID")
        if not uid:
            raise AttachError("NoSocket", "set FERRY_SOCKET_DIR (or POD_UID) to this pod's attach directory")
        directory = f"{DEFAULT_ROOT}/{uid}"
    return Path(directory) / p.SOCKET_NAME


@dataclass(frozen=True)
class TensorEntry:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    chunk: int
    offset: int
    nbytes: int
    adler32: int
    changed: bool | None  # against the version `base_uid`; None: no base


@dataclass
class LoadResult:
    loaded: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # unchanged, with only_changed
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    sparse: list[str] = field(default_factory=list)  # of `loaded`: written element by element (a staged refit)
    elements_changed: int = 0  # a staged refit: elements written (all of a tensor written whole)
    bytes_applied: int = 0  # a staged refit: bytes written into the module
    pause_s: float = 0.0  # a staged refit: how long `apply` took, the engine's pause


@dataclass
class _Step:
    """One tensor of a staged refit: `values` at the flat positions `index` of `target`, or, `index` None, the
    whole of `target`. Shape, dtype and address as staged: `apply` writes only into that very tensor."""

    name: str
    target: torch.Tensor
    index: torch.Tensor | None
    values: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    data_ptr: int


class StagedRefit:
    """A refit prepared by `Attachment.stage_refit`: what changes, computed while the engine still serves.
    `apply()` writes it, all or nothing. Keep the attachment open until then; apply at most once."""

    def __init__(
        self, module: torch.nn.Module, steps: list[_Step], result: LoadResult, held: str | None, uid: str | None
    ) -> None:
        self._module = module
        self._steps = steps
        self._result = result
        self._held = held  # the version `_LOADED` said the module held when staged
        self._uid = uid
        self._applied = False
        self.elements = sum(math.prod(s.shape) if s.index is None else s.index.numel() for s in steps)

    @property
    def names(self) -> list[str]:
        """The tensors `apply` writes."""
        return [s.name for s in self._steps]

    def apply(self, *, before_tensor: Callable[[str], None] | None = None) -> LoadResult:
        """The pause: per tensor, keep the old values at the staged positions (the old tensor, for one written
        whole), then write the new ones in place. When anything fails, every tensor already written is restored,
        the module still holds the version it held, and `AttachError("RefitFailed")` names the tensor and why.
        `before_tensor(name)` is called before each tensor is written (a test's way to make one fail)."""
        if self._applied:
            raise AttachError("RefitFailed", "this staged refit was applied already")
        if _LOADED.get(self._module) != self._held:
            raise AttachError("RefitStale", "the module was loaded again since this refit was staged")
        self._applied = True
        targets = dict(self._module.named_parameters(remove_duplicate=False))
        targets.update(self._module.named_buffers(remove_duplicate=False))
        done: list[tuple[_Step, torch.Tensor]] = []
        result = self._result
        start = time.monotonic()
        with torch.no_grad():
            for step in self._steps:
                try:
                    if before_tensor is not None:
                        before_tensor(step.name)
                    current = targets.get(step.name)
                    if (
                        current is not step.target
                        or tuple(current.shape) != step.shape
                        or current.dtype != step.dtype
                        or current.data_ptr() != step.data_ptr
                    ):
                        shape = None if current is None else tuple(current.shape)
                        raise AttachError("Changed", f"not the tensor staged ({step.shape}): now {shape}")
                    if step.index is None:
                        old = step.target.clone()
                        step.target.copy_(step.values)
                    else:
                        flat = step.target.view(-1)
                        old = flat[step.index]  # indexing copies
                        flat.index_put_((step.index,), step.values)
                    done.append((step, old))
                except Exception as exc:
                    self._restore(done, step.name, exc)
            _synchronize(s.target for s in self._steps)
        result.pause_s = time.monotonic() - start
        for step in self._steps:
            result.loaded.append(step.name)
            if step.index is not None:
                result.sparse.append(step.name)
        result.loaded.sort()
        result.sparse.sort()
        result.elements_changed = self.elements
        result.bytes_applied = sum(
            (s.target.numel() if s.index is None else s.index.numel()) * s.dtype.itemsize for s in self._steps
        )
        if not result.missing and self._uid is not None:
            _LOADED[self._module] = self._uid
        return result

    def _restore(self, done: list[tuple[_Step, torch.Tensor]], name: str, exc: Exception) -> None:
        try:
            for step, old in reversed(done):
                if step.index is None:
                    step.target.copy_(old)
                else:
                    step.target.view(-1).index_put_((step.index,), old)
            _synchronize(s.target for s, _ in done)
        except Exception as again:  # nothing left to trust: the module holds no whole version
            _LOADED.pop(self._module, None)
            raise AttachError(
                "RefitFailed", f"tensor {name!r}: {exc}; restoring the tensors written before failed: {again}"
            ) from exc
        raise AttachError(
            "RefitFailed", f"tensor {name!r}: {exc}; the {len(done)} tensors written before it were restored"
        ) from exc


class Attachment:
    """A leased version, mapped read-only. Valid until `close()` (or the end of the `with`); the tensors of
    `tensors()` must not be used after it.

    The mapping outlives the agent: when the agent restarts (the lease's connection closes), a thread of the
    attachment connects to `path` again, once the new agent serves it, and announces the version it still maps,
    so that the agent lists this pod in the replica's status again and retention keeps the version; and again
    after every further restart, until `close()`. `path`: the socket to announce on (None: never announce);
    `requested_rank`: the rank `attach` asked for."""

    def __init__(
        self,
        sock: socket.socket,
        reply: dict[str, Any],
        fds: list[int],
        path: Path | None = None,
        requested_rank: int | None = None,
    ) -> None:
        self._sock = sock
        self.lease: str = reply["lease"]
        self.namespace: str = reply["namespace"]
        self.model_load: str = reply["modelLoad"]
        self.model: str = reply["model"]
        self.version: str = reply["version"]
        self.version_uid: str | None = reply.get("versionUid")
        self.rank: int = reply["rank"]
        self.base_uid: str | None = reply.get("baseUid")  # the version `changed` is relative to
        self._maps: list[mmap.mmap] = []
        self._views: dict[str, torch.Tensor] | None = None
        try:
            self.entries = _entries(reply, len(fds))
            for chunk, fd in zip(reply["chunks"], fds, strict=True):
                self._maps.append(_map_sealed(fd, int(chunk["nbytes"])))
        except BaseException:
            self._unmap()
            raise
        finally:
            p.close_all(fds)  # a mapping outlives its descriptor
        self._keeper: _Keeper | None = None
        if path is not None:
            announcement: dict[str, Any] = {
                "op": "announce",
                "namespace": self.namespace,
                "modelLoad": self.model_load,
                "version": self.version,
            }
            if requested_rank is not None:  # one rank's share, as attached
                announcement["rank"] = requested_rank
            self._keeper = _Keeper(sock, path, announcement)
            # Not a reference to the attachment: one dropped unclosed stops its keeper and closes its lease.
            weakref.finalize(self, self._keeper.stop)

    def tensors(self) -> Mapping[str, torch.Tensor]:
        """{name: CPU tensor}, views of the agent's sealed memory: no copy. The pages are mapped read-only, so a
        write to one of these tensors kills the process (SIGSEGV); copy what you need to change."""
        if self._views is None:
            views: dict[str, torch.Tensor] = {}
            with warnings.catch_warnings():
                # torch warns that the buffer is not writable: that is the point, the memory is sealed.
                warnings.simplefilter("ignore", UserWarning)
                for e in self.entries.values():
                    if e.nbytes == 0:
                        views[e.name] = torch.empty(e.shape, dtype=e.dtype)
                        continue
                    raw = torch.frombuffer(self._maps[e.chunk], dtype=torch.uint8, count=e.nbytes, offset=e.offset)
                    views[e.name] = raw.view(e.dtype).reshape(e.shape)
            self._views = views
        return MappingProxyType(self._views)

    def verify(self) -> None:
        """Check every tensor's adler32 against the manifest (reads all the bytes once)."""
        for e in self.entries.values():
            view = memoryview(self._maps[e.chunk])
            try:
                if zlib.adler32(view[e.offset : e.offset + e.nbytes]) != e.adler32:
                    raise AttachError("Corrupt", f"tensor {e.name!r} does not match its adler32")
            finally:
                view.release()

    def load_into(self, module: torch.nn.Module, strict: bool = True, only_changed: bool = False) -> LoadResult:
        """`copy_` into `module`'s parameters and buffers (non-persistent ones too, where the version has them), in
        place: storage addresses do not change. Strict: every entry of `module.state_dict()` must be in the
        version and every tensor of the version must be a parameter or buffer of `module`, with equal shapes.

        `only_changed` (refit): when `module` holds, from an earlier `load_into`, exactly the version this one was
        compared with (`base_uid`), write only the elements whose bits differ from it (`stage_refit` then `apply`:
        all or nothing); otherwise copy all."""
        if only_changed and self._holds_base(module):
            return self.stage_refit(module, strict=strict).apply()
        targets, source, result = self._check(module, strict)
        _LOADED.pop(module, None)  # until this load is complete, the module holds no whole version
        with torch.no_grad():
            for name in sorted(set(source) & set(targets)):
                self._populate(self.entries[name])
                targets[name].copy_(source[name])
                result.loaded.append(name)
        if not result.missing and self.version_uid is not None:
            _LOADED[module] = self.version_uid
        return result

    def stage_refit(self, module: torch.nn.Module, strict: bool = True) -> StagedRefit:
        """Prepare a refit of `module` to this version while the engine still serves; `apply()` it in the pause.
        Checks names and shapes as `load_into` does and casts to the module's dtypes now. When `module` holds the
        base version (`base_uid`, per its last complete `load_into`), each changed tensor is compared with the
        module's, bit for bit, and only the differing elements' positions and new values are kept (the whole
        tensor where more than half differ); otherwise every tensor is staged whole. For a CUDA tensor the new
        version goes through pinned host memory onto its device and is compared there. Changes nothing in
        `module`."""
        targets, source, result = self._check(module, strict)
        held = _LOADED.get(module)
        refit = self._holds_base(module)
        steps: list[_Step] = []
        with torch.no_grad():
            for name in sorted(set(source) & set(targets)):
                if refit and self.entries[name].changed is False:
                    result.skipped.append(name)
                    continue
                self._populate(self.entries[name])
                try:
                    steps.append(_stage(name, targets[name], source[name], diff=refit))
                except (RuntimeError, TypeError) as exc:
                    cast = f"{source[name].dtype} into {targets[name].dtype}"
                    raise AttachError("DtypeMismatch", f"tensor {name!r}: {cast}: {exc}") from exc
        return StagedRefit(module, steps, result, held, self.version_uid)

    def _holds_base(self, module: torch.nn.Module) -> bool:
        return self.base_uid is not None and _LOADED.get(module) == self.base_uid

    def _check(
        self, module: torch.nn.Module, strict: bool
    ) -> tuple[dict[str, torch.Tensor], Mapping[str, torch.Tensor], LoadResult]:
        """The module's tensors, the version's, and a result naming what is missing and unexpected; raises when
        shapes differ or, `strict`, when names do."""
        targets = dict(module.named_parameters(remove_duplicate=False))
        targets.update(module.named_buffers(remove_duplicate=False))
        source = self.tensors()
        result = LoadResult(
            missing=sorted(set(module.state_dict()) - set(source)),
            unexpected=sorted(set(source) - set(targets)),
        )
        shapes = [n for n in source if n in targets and tuple(targets[n].shape) != tuple(source[n].shape)]
        if shapes:
            raise AttachError(
                "ShapeMismatch",
                ", ".join(
                    f"{n}: module {tuple(targets[n].shape)} vs version {tuple(source[n].shape)}" for n in sorted(shapes)
                ),
            )
        if strict and (result.missing or result.unexpected):
            raise AttachError(
                "Mismatch", f"missing from the version: {result.missing}; not in the module: {result.unexpected}"
            )
        return targets, source, result

    def _populate(self, e: TensorEntry) -> None:
        if e.nbytes == 0:
            return
        start = e.offset - e.offset % mmap.PAGESIZE
        with contextlib.suppress(OSError):  # an older kernel: the copy faults the pages in itself
            self._maps[e.chunk].madvise(_MADV_POPULATE_READ, start, e.offset + e.nbytes - start)

    def release(self) -> None:
        """Give the lease back; the mapping goes too."""
        self.close()

    def close(self) -> None:
        if self._sock.fileno() < 0:
            return
        if self._keeper is not None:
            self._keeper.stop()  # it closes its own connection (an announcement) as it ends
        self._views = None
        with contextlib.suppress(OSError, p.ProtocolError):
            p.send_frame(self._sock, {"op": "release", "lease": self.lease})
            p.recv_frame(self._sock, max_bytes=p.MAX_REPLY_BYTES)
        self._sock.close()
        self._unmap()

    def _unmap(self) -> None:
        for mapped in self._maps:
            with contextlib.suppress(BufferError):  # a tensor the caller kept pins its mapping: freed with it
                mapped.close()
        self._maps = []

    def __enter__(self) -> Attachment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Keeper:
    """An attachment's thread: waits for the lease's connection to close (the agent went away), then connects to
    `path` again and announces the version still mapped (`announcement`), and so on after each restart, until
    `stop()`. It only waits for the hang up, never reads the lease's connection: its replies stay for `close()`."""

    def __init__(self, sock: socket.socket, path: Path, announcement: dict[str, Any]) -> None:
        self._sock = sock
        self._path = path
        self._announcement = announcement
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)
        self._thread = threading.Thread(target=self._run, name="ferry-attach-keeper", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._stopping.is_set():
            return
        self._stopping.set()
        os.write(self._wake_w, b"x")
        if self._thread is not threading.current_thread():
            self._thread.join()
        os.close(self._wake_r)
        os.close(self._wake_w)

    def _run(self) -> None:
        conn: socket.socket | None = self._sock
        while conn is not None and self._hung_up(conn):
            if conn is not self._sock:
                conn.close()
            conn = None
            while conn is None and not self._stopping.is_set():
                conn = self._announce()
                if conn is None:
                    self._stopping.wait(_RETRY_S)
        if conn is not None and conn is not self._sock:
            conn.close()

    def _hung_up(self, conn: socket.socket) -> bool:
        """Block until the peer closes `conn` (True), or `stop()` or `conn` closed on this side (False). A sleeping
        poll holds a reference to the socket, so it wakes every `_POLL_S`: a lease socket closed by hand then goes
        (the agent sees the close) that soon."""
        fd = conn.fileno()
        poller = select.poll()
        poller.register(fd, select.POLLRDHUP)
        poller.register(self._wake_r, select.POLLIN)
        while not self._stopping.is_set() and conn.fileno() == fd:
            for ready, events in poller.poll(_POLL_S * 1000):
                if ready == self._wake_r:
                    return False
                if events & (select.POLLRDHUP | select.POLLHUP | select.POLLERR):
                    return conn.fileno() == fd
        return False

    def _announce(self) -> socket.socket | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.settimeout(_ANNOUNCE_TIMEOUT_S)
            sock.connect(str(self._path))
            _request(sock, self._announcement)
            sock.settimeout(None)
            return sock
        except (OSError, p.ProtocolError, AttachError):  # not back yet, or not serving this pod yet
            sock.close()
            return None


def _stage(name: str, target: torch.Tensor, source: torch.Tensor, diff: bool) -> _Step:
    """`source` (a CPU view of the mapping) staged for `target`: on `target`'s device, in its dtype; with `diff`,
    as the flat positions where its bits differ from `target`'s and the values there, when at most about half do."""
    if target.is_cuda:
        # Through pinned memory: the host-to-device copy runs at full speed, on a stream beside the engine's.
        pinned = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
        pinned.copy_(source)
        engine = torch.cuda.current_stream(target.device)
        stream = torch.cuda.Stream(device=target.device)
        stream.wait_stream(engine)  # the diff reads `target` after the engine's queued writes into it
        with torch.cuda.stream(stream):
            new = pinned.to(target.device, non_blocking=True).to(target.dtype)
            step = _diff(name, target, new, diff)
        stream.synchronize()  # before `pinned` goes, and so that `apply` (on the engine's stream) sees the result
        for staged in (step.index, step.values):
            if staged is not None:
                staged.record_stream(engine)  # made on `stream`, used and freed on the engine's
        return step
    new = source if source.dtype == target.dtype else source.to(target.dtype)
    return _diff(name, target, new, diff)


def _diff(name: str, target: torch.Tensor, new: torch.Tensor, diff: bool) -> _Step:
    step = _Step(name, target, None, new, tuple(target.shape), target.dtype, target.data_ptr())
    itemsize = target.dtype.itemsize
    width = itemsize if itemsize in _INT_OF_WIDTH else 8 if itemsize % 8 == 0 else 0
    if not diff or target.numel() == 0 or not target.is_contiguous() or not width:
        return step
    try:
        old_bits = target.view(-1).view(_INT_OF_WIDTH[width]).view(target.numel(), itemsize // width)
        new_bits = new.contiguous().view(-1).view(_INT_OF_WIDTH[width]).view(target.numel(), itemsize // width)
    except RuntimeError:  # a dtype without a plain bit view (quantized): written whole
        return step
    index = (old_bits != new_bits).any(dim=1).nonzero().view(-1)
    if index.numel() > _SPARSE_MAX_SHARE * target.numel():
        return step
    step.index = index
    step.values = new.contiguous().view(-1)[index]
    return step


def _synchronize(tensors: Iterable[torch.Tensor]) -> None:
    """Wait for the writes into these tensors: a CUDA write is queued, and it is only done when it ran."""
    for device in {t.device for t in tensors if t.is_cuda}:
        torch.cuda.synchronize(device)


def _entries(reply: dict[str, Any], nfds: int) -> dict[str, TensorEntry]:
    chunks = reply["chunks"]
    if len(chunks) != nfds:
        raise AttachError("BadReply", f"{len(chunks)} chunks but {nfds} descriptors")
    entries = {}
    for t in reply["tensors"]:
        dtype = getattr(torch, t["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise AttachError("BadReply", f"unknown dtype {t['dtype']!r}")
        e = TensorEntry(
            t["name"], dtype, tuple(t["shape"]), t["chunk"], t["offset"], t["nbytes"], t["adler32"], t.get("changed")
        )
        numel = 1
        for d in e.shape:
            numel *= d
        if not 0 <= e.chunk < len(chunks) or e.offset < 0 or e.offset + e.nbytes > chunks[e.chunk]["nbytes"]:
            raise AttachError("BadReply", f"tensor {e.name!r} lies outside its chunk")
        if numel * dtype.itemsize != e.nbytes:
            raise AttachError("BadReply", f"tensor {e.name!r}: {e.nbytes} bytes for shape {e.shape} {dtype}")
        entries[e.name] = e
    return entries


def _map_sealed(fd: int, nbytes: int) -> mmap.mmap:
    seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    if seals & p.REQUIRED_SEALS != p.REQUIRED_SEALS:
        raise AttachError("NotSealed", f"chunk is not sealed (seals {seals:#x}); refusing memory that may change")
    size = os.fstat(fd).st_size
    if size < nbytes:
        raise AttachError("BadReply", f"chunk of {size} bytes, manifest says {nbytes}")
    return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)


def _request(sock: socket.socket, message: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
    p.send_frame(sock, message)
    reply, fds = p.recv_frame(sock, max_bytes=p.MAX_REPLY_BYTES, max_fds=p.MAX_FDS)
    if not reply.get("ok"):
        p.close_all(fds)
        err = reply.get("error") or {}
        raise AttachError(str(err.get("code", "Error")), str(err.get("message", reply)))
    return reply, fds


def _connect(path: Path, deadline: float) -> socket.socket:
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(path))
            return sock
        except OSError as exc:  # the agent has not made this pod's socket yet, or restarts
            sock.close()
            if time.monotonic() >= deadline:
                raise AttachError("NoSocket", f"cannot reach the node agent at {path}: {exc}") from None
            time.sleep(_RETRY_S)


def request(
    message: dict[str, Any], *, socket_dir: str | os.PathLike[str] | None = None, timeout: float = 0
) -> dict[str, Any]:
    """One request on a fresh connection (`hello`, `list`): the agent's reply."""
    with _connect(socket_path(socket_dir), time.monotonic() + timeout) as sock:
        reply, fds = _request(sock, message)
        p.close_all(fds)
        return reply


def attach(
    name: str,
    namespace: str | None = None,
    *,
    timeout: float = 600,
    version: str | None = None,
    rank: int | None = None,
    socket_dir: str | os.PathLike[str] | None = None,
    verify: bool = False,
) -> Attachment:
    """Lease `name` (a ModelLoad, or a model) as this node serves it: its current version, or `version`; waits up
    to `timeout` seconds for the agent to serve it. `namespace` defaults to the pod's own (the only one allowed).
    A context manager; the lease is also released when this process exits, however it exits."""
    deadline = time.monotonic() + timeout
    message: dict[str, Any] = {"op": "attach", "name": name}
    if namespace is not None:
        message["namespace"] = namespace
    if version is not None:
        message["version"] = version
    if rank is not None:
        message["rank"] = rank
    path = socket_path(socket_dir)
    while True:
        sock = _connect(path, deadline)
        try:
            reply, fds = _request(sock, message)
        except AttachError as exc:
            sock.close()
            if exc.code != p.NOT_SERVED or time.monotonic() >= deadline:
                raise
            time.sleep(_RETRY_S)
            continue
        except (OSError, p.ProtocolError) as exc:
            sock.close()
            if time.monotonic() >= deadline:
                raise AttachError("NoSocket", f"the agent at {path} did not answer: {exc}") from None
            time.sleep(_RETRY_S)
            continue
        try:
            attachment = Attachment(sock, reply, fds, path, rank)
        except BaseException:
            sock.close()
            raise
        if verify:
            try:
                attachment.verify()
            except BaseException:
                attachment.close()
                raise
        return attachment


def watch(
    name: str,
    namespace: str | None = None,
    *,
    socket_dir: str | os.PathLike[str] | None = None,
    timeout: float | None = None,
) -> Iterator[str]:
    """Yield each version this node serves for `name` (the ModelLoad, or the model): the current one first, then
    every change. Survives agent restarts (it reconnects). `timeout`: stop after that many seconds without a new
    version (None: never)."""
    path = socket_path(socket_dir)
    message: dict[str, Any] = {"op": "watch", "name": name}
    if namespace is not None:
        message["namespace"] = namespace
    last: str | None = None
    deadline = None if timeout is None else time.monotonic() + timeout
    while deadline is None or time.monotonic() < deadline:
        try:
            sock = _connect(path, deadline if deadline is not None else time.monotonic() + 3600)
        except AttachError:
            if deadline is not None and time.monotonic() >= deadline:
                return
            continue
        with sock:
            try:
                p.send_frame(sock, message)
                while True:
                    if deadline is not None:
                        sock.settimeout(max(0.01, deadline - time.monotonic()))
                    event, fds = p.recv_frame(sock, max_bytes=p.MAX_REPLY_BYTES)
                    p.close_all(fds)
                    if not event.get("ok"):
                        err = event.get("error") or {}
                        raise AttachError(str(err.get("code", "Error")), str(err.get("message", event)))
                    version = event.get("version")
                    if version is not None and version != last:
                        last = version
                        yield version
                        if timeout is not None:
                            deadline = time.monotonic() + timeout
            except TimeoutError:
                return
            except (OSError, p.ProtocolError):  # the agent went away: connect again
                time.sleep(_RETRY_S)
