"""`ferry.trainer`: a trainer publishes a weight version from its own memory (docs/publish.md, "From a trainer").

Needs only the standard library and torch, like `ferry.client`. `Publisher.publish(state_dict, version=...)` sends
the tensor layout over this pod's attach socket (`FERRY_SOCKET_DIR`, default `/run/ferry/pods/$POD_UID`); the
node's agent checks that the pod's ServiceAccount may create WeightVersions in its namespace, then hands back
writable memfd chunks. The trainer copies each tensor (CPU or CUDA) straight into them, unmaps them, and commits:
the agent seals the chunks (from then on nobody can change those bytes), checksums them, and writes the canonical
S3 objects, the very bytes `ferry publish` writes for the same tensors, and the WeightVersion behind the publish.
`publish` returns once the agent holds the sealed version; `PublishHandle.wait_durable` once S3 holds it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ferry.client import protocol as p
from ferry.client._attach import socket_path

__all__ = ["PublishError", "PublishHandle", "Publisher"]

# Ops of the publish exchange (agent/ferry_agent/attach/publish.py is the other end).
OP_PUBLISH = "publish"
OP_COMMIT = "publish-commit"
OP_WAIT = "publish-wait"
# The agent's reply to a publish that cannot become durable.
PUBLISH_FAILED = "PublishFailed"
CONFLICT = "Conflict"

_REPLY_SLACK_S = 30.0  # beyond a wait's own timeout: how long the agent may take to answer it


class PublishError(Exception):
    """The agent refused the publish (`code`: `Forbidden`, `BadRequest`, `Conflict`, ...), the version failed
    before it was durable (`PublishFailed`), or the agent could not be reached (`Unreachable`)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code


@dataclass
class PublishHandle:
    """A version the node's agent holds sealed; `wait_durable` until S3 holds it too."""

    publisher: Publisher
    version: str
    sha256: dict[str, str] = field(default_factory=dict)  # per tensor, of the sealed bytes the agent holds
    uri: str | None = None  # the index in S3, once durable

    def wait_durable(self, timeout: float = 600.0) -> str:
        """The S3 URI of the version's index once every object is written and its WeightVersion exists; raises
        PublishError with the agent's reason if it failed, or `Timeout` after `timeout` seconds."""
        reply = self.publisher._call({"op": OP_WAIT, "version": self.version, "timeout": timeout}, timeout)
        if not reply.get("durable"):
            raise PublishError("Timeout", f"{self.version} is not durable after {timeout:.0f}s ({reply.get('stage')})")
        self.uri = str(reply["uri"])
        return self.uri


class Publisher:
    """Publishes versions of one model into this pod's namespace. Arguments as `ferry publish`'s flags: the
    objects go to `<uri_prefix>/<version>/`; `credentials_secret` names the Secret (in `namespace`) whose keys the
    agent writes with and readers read with; `shard_bytes` as `--shard-size`."""

    def __init__(
        self,
        model: str,
        uri_prefix: str,
        *,
        namespace: str | None = None,
        endpoint: str | None = None,
        region: str | None = None,
        credentials_secret: str | None = None,
        layout_signature: str | None = None,
        shard_bytes: int | None = None,
        socket_dir: str | os.PathLike[str] | None = None,
        timeout: float = 120.0,
    ) -> None:
        self.model = model
        self._request = {
            "model": model,
            "namespace": namespace,
            "uriPrefix": uri_prefix,
            "endpoint": endpoint,
            "region": region,
            "credentialsSecret": credentials_secret,
            "layoutSignature": layout_signature,
            "shardBytes": shard_bytes,
        }
        self._path = socket_path(socket_dir)
        self._timeout = timeout
        self._lock = threading.Lock()
        self._sock: socket.socket | None = None

    def publish(
        self, state_dict: Mapping[str, torch.Tensor], *, version: str, base: str | None = None
    ) -> PublishHandle:
        """Copy `state_dict` into the agent's memory as `version` (an XOR delta of `base` in S3); returns once the
        agent holds it sealed. The tensors are read once, during this call, and never changed."""
        tensors = _checked(state_dict)
        layout = [{"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)} for n, t in tensors]
        request = {"op": OP_PUBLISH, **{k: v for k, v in self._request.items() if v is not None}}
        request.update(version=version, tensors=layout, **({"base": base} if base else {}))
        with self._lock:
            reply, fds = self._exchange(request, self._timeout)
            try:
                _copy_in(tensors, reply, fds)
            finally:
                p.close_all(fds)  # the agent seals them: a descriptor kept here could not write any more
            done, _ = self._exchange({"op": OP_COMMIT, "publish": reply["publish"]}, self._timeout)
        return PublishHandle(self, version, dict(done.get("sha256") or {}))

    def close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None

    def __enter__(self) -> Publisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        with self._lock:
            reply, fds = self._exchange(request, timeout + _REPLY_SLACK_S)
        p.close_all(fds)
        return reply

    def _exchange(self, request: dict[str, Any], timeout: float) -> tuple[dict[str, Any], list[int]]:
        """One request, one reply (with the descriptors it carried); an error reply raises PublishError."""
        try:
            if self._sock is None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.connect(str(self._path))
                except BaseException:
                    sock.close()
                    raise
                self._sock = sock
            self._sock.settimeout(timeout)
            p.send_frame(self._sock, request)
            reply, fds = p.recv_frame(self._sock, max_bytes=p.MAX_REPLY_BYTES, max_fds=p.MAX_FDS)
        except (OSError, p.ProtocolError) as exc:
            # The agent went away (or never answered): what it held of an unfinished publish is gone with it.
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            raise PublishError("Unreachable", f"the agent at {self._path}: {exc}") from exc
        if not reply.get("ok"):
            p.close_all(fds)
            error = reply.get("error") or {}
            raise PublishError(str(error.get("code", "Unknown")), str(error.get("message", reply)))
        return reply, fds


def _checked(state_dict: Mapping[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    if not state_dict:
        raise ValueError("a version needs at least one tensor")
    out = []
    for name, tensor in sorted(state_dict.items()):
        if not isinstance(name, str) or not name or not isinstance(tensor, torch.Tensor):
            raise ValueError(f"entry {name!r} is not a named tensor")
        out.append((name, tensor.detach()))
    return out


def _copy_in(tensors: list[tuple[str, torch.Tensor]], reply: dict[str, Any], fds: list[int]) -> None:
    """Each tensor into its place in the agent's chunks; every mapping is gone when this returns (the agent cannot
    seal a chunk that a writable mapping still reaches)."""
    chunks = reply["chunks"]
    if len(fds) != len(chunks):
        raise PublishError("BadReply", f"{len(fds)} descriptors for {len(chunks)} chunks")
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    maps = [mmap.mmap(fd, int(c["nbytes"]), mmap.MAP_SHARED, prot) for fd, c in zip(fds, chunks, strict=True)]
    try:
        _fill(tensors, {t["name"]: t for t in reply["tensors"]}, maps)
    finally:
        for m in maps:
            with contextlib.suppress(BufferError):  # only after a failed copy; the publish is not committed then
                m.close()


def _fill(tensors: list[tuple[str, torch.Tensor]], places: Mapping[str, Any], maps: list[mmap.mmap]) -> None:
    pools = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
    for name, tensor in tensors:
        place = places.get(name)
        nbytes = tensor.numel() * tensor.element_size()
        if place is None or int(place["nbytes"]) != nbytes:
            raise PublishError("BadReply", f"tensor {name!r}: the agent placed {place}, {nbytes} bytes to write")
        if nbytes:
            start = int(place["offset"])
            target = pools[int(place["chunk"])][start : start + nbytes]
            # One copy, from wherever the tensor lives (a CUDA tensor is read by a device-to-host copy).
            target.view(tensor.dtype).view(tensor.shape).copy_(tensor)
