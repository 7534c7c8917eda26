"""The pipelined fan-out's policy: how a version is cut into chunks, and which holder a reader reads which chunks
from. Pure functions over plain values, so that the agents (`strategies.peer`) and the fleet simulation
(`bench/sim_fanout.py`) run exactly the same decisions.

- Chunks: consecutive tensors of the manifest (name order, which every replica of a version shares) until a chunk
  holds at least `chunk_bytes`. A chunk is the unit a reader requests, checks and then serves on; a holder serves a
  chunk once it holds every tensor of it, checked.
- Choice: the lowest chunk the reader still needs that some usable holder has (so every reader moves forward through
  the version as the holders do, and a chunk that just arrived anywhere is read next), from the first such holder in
  the reader's selector order (the ModelLoad's `selector`, keyed by the reader, so readers spread over the holders);
  a holder is usable when it is not known dead and has a free reader slot (`maxReadersPerSource`). The reader then
  takes every chunk it still needs that this holder has, in one lease, up to `LEASE_BYTES` of chunks: against a
  Serving source that is a version of up to 1 GiB in one lease, as before pipelining; a bigger one takes several,
  so that a holder's reader slots turn over and the fan-out tree grows while a big version moves (what
  `bench/sim_fanout.py` found for 1 TB).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

DEFAULT_CHUNK_BYTES = 16 << 20
DEFAULT_MAX_READERS = 4  # spec.transfer.maxReadersPerSource's default
LEASE_BYTES = 1 << 30  # at most this much of chunks (at least one chunk) in one lease


def lease_chunks(chunk_bytes: int) -> int:
    """How many chunks one lease takes at most (see `lease_batch` for the one exception)."""
    return max(1, LEASE_BYTES // chunk_bytes)


def lease_batch(wanted: Sequence[Chunk], chunk_bytes: int) -> list[Chunk]:
    """What one lease takes of the chunks a reader wants from a holder (ascending): at most `lease_chunks`, and the
    version's short last chunk too when it is all that would be left (the few tensors after the last full chunk, such
    as a version of exactly 1 GiB plus a scalar, are not worth a lease and a connection of their own)."""
    most = lease_chunks(chunk_bytes)
    if len(wanted) == most + 1 and wanted[-1].nbytes < chunk_bytes:
        return list(wanted)
    return list(wanted[:most])


@dataclass(frozen=True)
class Chunk:
    index: int
    tensors: tuple[int, ...]  # manifest indexes, consecutive
    nbytes: int


def plan_chunks(sizes: Sequence[int], chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list[Chunk]:
    """Chunks of the manifest whose tensors have `sizes` (manifest order)."""
    if chunk_bytes < 1:
        raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
    chunks: list[Chunk] = []
    members: list[int] = []
    nbytes = 0
    for i, size in enumerate(sizes):
        members.append(i)
        nbytes += size
        if nbytes >= chunk_bytes:
            chunks.append(Chunk(len(chunks), tuple(members), nbytes))
            members, nbytes = [], 0
    if members:
        chunks.append(Chunk(len(chunks), tuple(members), nbytes))
    return chunks


def chunks_held(chunks: Sequence[Chunk], tensors: Collection[int]) -> frozenset[int]:
    """The chunks all of whose tensors are in `tensors` (a holder's checked tensors)."""
    return frozenset(c.index for c in chunks if all(t in tensors for t in c.tensors))


@dataclass(frozen=True)
class HolderView:
    """What a reader knows of one holder when it chooses."""

    key: str
    held: frozenset[int] | None  # chunk indexes; None: not asked yet (a lease tells)
    usable: bool = True  # not known dead, and not at its reader limit as last seen


def choose(
    needed: Sequence[int], ranked: Sequence[HolderView], max_chunks: int | None = None
) -> tuple[str, list[int]] | None:
    """(holder key, the chunks to read from it in one lease, at most `max_chunks`), or None when no usable holder
    has a needed chunk. `needed`: ascending; `ranked`: the holders in the reader's selector order. A holder not asked
    yet may hold anything, so it is tried (its lease says what it has)."""
    for chunk in needed:
        for h in ranked:
            if h.usable and (h.held is None or chunk in h.held):
                batch = [c for c in needed if c >= chunk and (h.held is None or c in h.held)]
                return h.key, batch[:max_chunks]
    return None
