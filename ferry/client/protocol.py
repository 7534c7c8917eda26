"""The attach wire format, shared by the node agent and `ferry.client` (standard library only).

A frame is a 4-byte big-endian length and that many bytes of UTF-8 JSON (an object); never pickle, so a frame
from a hostile peer is data, not code. File descriptors travel with a frame as `SCM_RIGHTS` ancillary data, sent
in the same `sendmsg` as the frame's first byte, so the receiver gets them with the length prefix.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import json
import os
import socket
import struct
from typing import Any

PROTOCOL = 1
SOCKET_NAME = "ferry.sock"
# unix(7): SCM_MAX_FD, the most descriptors one message may carry.
MAX_FDS = 253
# A request is a few names; a reply carries a manifest (about 200 bytes a tensor).
MAX_REQUEST_BYTES = 64 << 10
MAX_REPLY_BYTES = 64 << 20
# How deep a frame's JSON may nest: a request is an object of names and lists, a manifest three levels deep.
MAX_DEPTH = 32

_HEADER = struct.Struct(">I")

# Seals a resident chunk carries: nobody, the agent included, can change, grow, shrink or unseal it.
REQUIRED_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL

# Error codes of a reply `{"ok": false, "error": {"code", "message"}}`. NOT_SERVED is worth waiting on (the node
# may still be loading); the others are final.
NOT_SERVED = "NotServed"
BAD_REQUEST = "BadRequest"
FORBIDDEN = "Forbidden"
TOO_MANY_LEASES = "TooManyLeases"
UNKNOWN_LEASE = "UnknownLease"


class ProtocolError(Exception):
    """The peer broke the framing (or closed mid-frame): the connection is unusable."""


class Closed(ProtocolError):
    """The peer closed the connection between frames."""


def send_frame(sock: socket.socket, message: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
    if len(fds) > MAX_FDS:
        raise ValueError(f"{len(fds)} descriptors in one frame; at most {MAX_FDS}")
    payload = json.dumps(message, separators=(",", ":")).encode()
    data = _HEADER.pack(len(payload)) + payload
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = sock.sendmsg([data], ancillary)
    if sent < len(data):
        sock.sendall(data[sent:])


def recv_frame(sock: socket.socket, *, max_bytes: int, max_fds: int = 0) -> tuple[dict[str, Any], list[int]]:
    """One frame and the descriptors that came with it (the caller owns them). Raises `Closed` on a clean EOF
    before a frame, `ProtocolError` on anything else that is not a frame this side accepts; descriptors
    received with a broken frame are closed."""
    fds: list[int] = []
    try:
        header = _recv_exact(sock, _HEADER.size, fds, max_fds, eof_ok=True)
        (length,) = _HEADER.unpack(header)
        if length > max_bytes:
            raise ProtocolError(f"frame of {length} bytes; at most {max_bytes}")
        payload = _recv_exact(sock, length, fds, max_fds, eof_ok=False)
        try:
            message = json.loads(payload)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ProtocolError(f"frame is not JSON: {exc}") from None
        except RecursionError:  # the parser's own limit, far past MAX_DEPTH
            raise ProtocolError(f"frame nests deeper than {MAX_DEPTH} levels") from None
        if not isinstance(message, dict):
            raise ProtocolError("frame is not a JSON object")
        if _too_deep(message, MAX_DEPTH):
            raise ProtocolError(f"frame nests deeper than {MAX_DEPTH} levels")
        return message, fds
    except BaseException:
        close_all(fds)
        raise


def _too_deep(value: Any, levels: int) -> bool:
    """Whether `value` nests more than `levels` lists and objects deep; stops at that depth, so its own recursion
    is bounded whatever a peer sent (what handles a frame may recurse into it too: printing, encoding)."""
    if isinstance(value, dict):
        value = value.values()
    elif not isinstance(value, list):
        return False
    return levels <= 0 or any(_too_deep(item, levels - 1) for item in value)


def _recv_exact(sock: socket.socket, n: int, fds: list[int], max_fds: int, *, eof_ok: bool) -> bytes:
    chunks: list[bytes] = []
    got = 0
    # Room for one more than allowed: a peer that sends more is caught by the count, not by a silent truncation.
    space = socket.CMSG_SPACE((max_fds + 1) * 4)
    while got < n:
        data, ancillary, flags, _ = sock.recvmsg(n - got, space)
        for level, kind, body in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                received = array.array("i")
                received.frombytes(body[: len(body) - len(body) % 4])
                fds.extend(received)
        if flags & socket.MSG_CTRUNC or len(fds) > max_fds:
            raise ProtocolError(f"peer sent descriptors beyond the {max_fds} this side accepts")
        if not data:
            if eof_ok and got == 0:
                raise Closed("peer closed the connection")
            raise ProtocolError("peer closed the connection mid-frame")
        chunks.append(data)
        got += len(data)
    return b"".join(chunks)


def close_all(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


def error(code: str, message: str) -> dict[str, Any]:
    return {"ok": False, "error": {"code": code, "message": message}}
