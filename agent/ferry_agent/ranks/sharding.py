"""Which tensors each rank of a replica holds.

A replica of `world_size` ranks splits the version's tensors between its ranks, one device each. The split is a
pure function of the manifest, so every rank (and every replica with the same number of ranks) computes the
same one without talking: rank r of one replica holds exactly what rank r of another holds, which is what lets
a rank copy from the same rank of a peer.

Greedy by size: tensors in descending size (name breaks ties) each go to the rank with the fewest bytes so far
(lowest rank breaks ties). That keeps the ranks within one tensor's size of each other.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from ferry_agent.store.resident import TensorSpec


def rank_of_tensors(specs: Iterable[TensorSpec], world_size: int) -> dict[str, int]:
    """tensor name → the rank that holds it."""
    if world_size < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size}")
    loads = [(0, rank) for rank in range(world_size)]  # (bytes so far, rank): a min-heap
    owner: dict[str, int] = {}
    for spec in sorted(specs, key=lambda s: (-s.nbytes, s.name)):
        held, rank = heapq.heappop(loads)
        owner[spec.name] = rank
        heapq.heappush(loads, (held + spec.nbytes, rank))
    return owner


def rank_specs(specs: Iterable[TensorSpec], rank: int, world_size: int) -> list[TensorSpec]:
    """The specs rank `rank` holds, in their original order."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a world of {world_size}")
    specs = list(specs)
    if world_size == 1:
        return specs
    owner = rank_of_tensors(specs, world_size)
    return [s for s in specs if owner[s.name] == rank]
