"""Which tensors of a rank a source holds, verified: what a loading replica serves while it loads (pipelined
fan-out). A tensor is marked only once its bytes passed their adler32 check, and its bytes never change after that,
so a reader may READ any tensor a lease's holdings list while the rest are still arriving. A Serving source holds
every tensor (`Holdings.full`).

The wire form (`worker_pb2.Holdings`) is a bitmap over the manifest's tensors plus each held tensor's adler32, which
the reader checks every byte against as it lands. A load that shares tensors with the version it replaces (a delta
replayed on the held base: unchanged tensors are the base's very memory) says so (`base_uid`, `unchanged`): a
reader that holds that very base shares them too, and reads only the rest.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from ferry_agent.transport.proto import worker_pb2


def encode_bitmap(held: Iterable[int], n: int) -> bytes:
    out = bytearray((n + 7) // 8)
    for i in held:
        out[i >> 3] |= 1 << (i & 7)
    return bytes(out)


def decode_bitmap(raw: bytes, n: int) -> frozenset[int]:
    return frozenset(i for i in range(min(n, len(raw) * 8)) if raw[i >> 3] >> (i & 7) & 1)


@dataclass(frozen=True)
class HoldingsView:
    """A snapshot of a source's holdings as the reader sees it: tensor indexes (manifest order) and checksums."""

    held: frozenset[int]
    checksums: tuple[str, ...]
    complete: bool
    readers: int = 0
    max_readers: int = 0  # 0: no limit
    base_uid: str = ""  # the WeightVersion uid whose bytes the `unchanged` tensors have
    unchanged: frozenset[int] = frozenset()

    @classmethod
    def from_proto(cls, msg: worker_pb2.Holdings, n: int) -> HoldingsView:
        checksums = tuple(msg.checksums) if len(msg.checksums) == n else ("",) * n
        held = frozenset(range(n)) if msg.complete else decode_bitmap(msg.held, n)
        # A tensor without its checksum cannot be checked, so it does not count as held.
        held = frozenset(i for i in held if checksums[i])
        unchanged = decode_bitmap(msg.unchanged, n) & held if msg.base_uid else frozenset()
        return cls(held, checksums, msg.complete, msg.readers, msg.max_readers, msg.base_uid, unchanged)

    @property
    def full(self) -> bool:
        return self.complete or len(self.held) == len(self.checksums)


class Holdings:
    """The tensors of a manifest (`names`, manifest order) one loading rank holds, verified. Thread-safe; `wait`
    blocks a long-polling reader until more arrive."""

    def __init__(self, names: Sequence[str], checksums: Mapping[str, str] | None = None) -> None:
        self.names = tuple(names)
        self._index = {name: i for i, name in enumerate(self.names)}
        self._checksums = [""] * len(self.names)
        self._held: set[int] = set()
        self._cond = threading.Condition()
        self._base: tuple[str, frozenset[int]] = ("", frozenset())
        if checksums is not None:  # a whole version, all of it checked: a Serving source
            self.mark(checksums)

    def set_base(self, base_uid: str, names: Iterable[str]) -> None:
        """These tensors are, byte for byte, the WeightVersion `base_uid`'s: a reader holding that version shares
        them instead of reading them (once they are held here)."""
        with self._cond:
            self._base = (base_uid, frozenset(self._index[n] for n in names))

    @classmethod
    def full(cls, names: Sequence[str], checksums: Mapping[str, str]) -> Holdings:
        missing = [n for n in names if not checksums.get(n)]
        if missing:
            raise ValueError(f"no checksum for {missing[:5]}")
        return cls(names, checksums)

    def mark(self, checksums: Mapping[str, str]) -> None:
        """These tensors' bytes are final and passed their checks (`name -> adler32 hex`)."""
        with self._cond:
            for name, checksum in checksums.items():
                i = self._index[name]
                if not checksum:
                    raise ValueError(f"{name}: an empty checksum")
                if self._checksums[i] and self._checksums[i] != checksum:
                    raise ValueError(f"{name} held with checksum {self._checksums[i]}, marked again with {checksum}")
                self._checksums[i] = checksum
                self._held.add(i)
            self._cond.notify_all()

    @property
    def count(self) -> int:
        with self._cond:
            return len(self._held)

    @property
    def complete(self) -> bool:
        with self._cond:
            return len(self._held) == len(self.names)

    def wait(self, known: int, timeout_s: float) -> None:
        """Until more than `known` tensors are held (or every one), at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while len(self._held) <= known and len(self._held) < len(self.names):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                self._cond.wait(remaining)

    def to_proto(self, *, readers: int = 0, max_readers: int | None = None) -> worker_pb2.Holdings:
        with self._cond:
            complete = len(self._held) == len(self.names)
            base_uid, unchanged = self._base
            return worker_pb2.Holdings(
                held=b"" if complete else encode_bitmap(self._held, len(self.names)),
                checksums=list(self._checksums),
                complete=complete,
                readers=readers,
                max_readers=max_readers or 0,
                base_uid=base_uid,
                unchanged=encode_bitmap(unchanged, len(self.names)) if base_uid else b"",
            )
