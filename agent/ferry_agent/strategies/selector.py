"""Source selectors: they only order candidates; the attempt budget is the strategy's.

- `random`: a local RNG shuffle.
- `rendezvousHash` (HRW): score = int(blake2b("|".join(model, target_id, target_rank, replica, rank),
  digest_size=8)), highest first. Stable for a given target, and losing a source moves only ~1/M targets.
- `loadAware`: the rendezvous score scaled to [0, 1) minus `load_weight` times the candidate's active lease
  count normalised by the busiest candidate's, so fan-out spreads over idle sources.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence
from typing import Protocol

from ferry.api.models import SelectorKind
from ferry_agent.strategies.candidate import SourceCandidate

_UNKNOWN_LOAD = 0.5  # prior for a candidate that reports no lease count (ModelExpress uses the same)


class Selector(Protocol):
    name: str

    def order(
        self, candidates: Sequence[SourceCandidate], *, model: str, target_id: str, target_rank: int
    ) -> list[SourceCandidate]: ...


def rendezvous_score(model: str, target_id: str, target_rank: int, candidate: SourceCandidate) -> int:
    # The candidate is keyed by replica and rank, which survive a source restart (its agent name does not).
    key = "|".join((model, target_id, str(target_rank), candidate.replica, str(candidate.rank)))
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class RandomSelector:
    name = SelectorKind.RANDOM

    def __init__(self, rng: random.Random | None = None) -> None:
        self._rng = rng or random.Random()

    def order(
        self, candidates: Sequence[SourceCandidate], *, model: str, target_id: str, target_rank: int
    ) -> list[SourceCandidate]:
        ordered = list(candidates)
        self._rng.shuffle(ordered)
        return ordered


class RendezvousHashSelector:
    name = SelectorKind.RENDEZVOUS_HASH

    def order(
        self, candidates: Sequence[SourceCandidate], *, model: str, target_id: str, target_rank: int
    ) -> list[SourceCandidate]:
        return sorted(
            candidates,
            key=lambda c: (rendezvous_score(model, target_id, target_rank, c), c.replica),
            reverse=True,
        )


class LoadAwareSelector:
    name = SelectorKind.LOAD_AWARE

    def __init__(self, load_weight: float = 1.0) -> None:
        self.load_weight = load_weight

    def order(
        self, candidates: Sequence[SourceCandidate], *, model: str, target_id: str, target_rank: int
    ) -> list[SourceCandidate]:
        busiest = max((c.active_leases or 0 for c in candidates), default=0)

        def load(c: SourceCandidate) -> float:
            if c.active_leases is None:
                return _UNKNOWN_LOAD
            return c.active_leases / busiest if busiest else 0.0

        def score(c: SourceCandidate) -> tuple[float, str]:
            unit = rendezvous_score(model, target_id, target_rank, c) / 2**64
            return (unit - self.load_weight * load(c), c.replica)

        return sorted(candidates, key=score, reverse=True)


def make_selector(name: str, *, load_weight: float = 1.0, rng: random.Random | None = None) -> Selector:
    """Build a selector by its ModelLoad `spec.transfer.selector` name; unknown names are a config error."""
    if name == SelectorKind.RANDOM:
        return RandomSelector(rng)
    if name == SelectorKind.RENDEZVOUS_HASH:
        return RendezvousHashSelector()
    if name == SelectorKind.LOAD_AWARE:
        return LoadAwareSelector(load_weight)
    raise ValueError(f"unknown source selector {name!r}; expected one of {', '.join(SelectorKind)}")
