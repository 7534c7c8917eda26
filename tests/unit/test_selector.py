"""Source selectors order candidates; unknown names are configuration errors."""

from __future__ import annotations

import hashlib
import itertools
import random
from collections import Counter

import pytest

from ferry_agent.strategies.candidate import SourceCandidate
from ferry_agent.strategies.peer import TransferSettings
from ferry_agent.strategies.selector import (
    LoadAwareSelector,
    RandomSelector,
    RendezvousHashSelector,
    make_selector,
    rendezvous_score,
)

pytestmark = pytest.mark.unit

KEY = {"model": "llama", "target_id": "replica-t", "target_rank": 0}


def cands(n: int, leases: list[int | None] | None = None) -> list[SourceCandidate]:
    return [
        SourceCandidate(
            replica=f"replica-{i}",
            rank=0,
            agent_name=f"agent-{i}",
            grpc_endpoint=f"127.0.0.1:{5000 + i}",
            active_leases=None if leases is None else leases[i],
        )
        for i in range(n)
    ]


@pytest.mark.parametrize("name", ["random", "rendezvousHash", "loadAware"])
def test_known_names(name: str) -> None:
    assert make_selector(name).name == name


@pytest.mark.parametrize("name", ["", "rendezvous_hash", "RendezvousHash", "topologyAware", "RANDOM"])
def test_unknown_names_are_rejected_at_config_time(name: str) -> None:
    with pytest.raises(ValueError, match="unknown source selector"):
        make_selector(name)
    with pytest.raises(ValueError, match="unknown source selector"):
        TransferSettings(selector=name)


def test_rendezvous_score_is_the_documented_blake2b_key() -> None:
    c = cands(1)[0]
    expected = int.from_bytes(hashlib.blake2b(b"llama|replica-t|0|replica-0|0", digest_size=8).digest(), "big")
    assert rendezvous_score("llama", "replica-t", 0, c) == expected


def test_rendezvous_sorts_by_score_descending_and_ignores_input_order() -> None:
    pool = cands(5)
    order = RendezvousHashSelector().order(pool, **KEY)
    scores = [rendezvous_score("llama", "replica-t", 0, c) for c in order]
    assert scores == sorted(scores, reverse=True)
    for perm in itertools.islice(itertools.permutations(pool), 20):
        assert RendezvousHashSelector().order(list(perm), **KEY) == order


def test_rendezvous_spreads_targets_and_is_stable_when_a_source_leaves() -> None:
    pool = cands(3)
    selector = RendezvousHashSelector()
    firsts = {}
    for t in range(300):
        firsts[t] = selector.order(pool, model="m", target_id=f"t{t}", target_rank=0)[0]
    share = Counter(c.replica for c in firsts.values())
    assert all(60 <= n <= 140 for n in share.values()), share  # ~100 each
    # Drop replica-0: only targets that preferred it move.
    rest = pool[1:]
    for t, first in firsts.items():
        new_first = selector.order(rest, model="m", target_id=f"t{t}", target_rank=0)[0]
        if first.replica != "replica-0":
            assert new_first == first


def test_rendezvous_key_ignores_agent_name_which_changes_on_restart() -> None:
    a = cands(1)[0]
    restarted = SourceCandidate(replica=a.replica, rank=a.rank, agent_name="agent-new", grpc_endpoint="x:1")
    assert rendezvous_score("m", "t", 0, a) == rendezvous_score("m", "t", 0, restarted)


def test_random_is_a_permutation_driven_by_its_own_rng() -> None:
    pool = cands(6)
    one = RandomSelector(random.Random(7)).order(pool, **KEY)
    two = RandomSelector(random.Random(7)).order(pool, **KEY)
    assert one == two
    assert sorted(one, key=lambda c: c.replica) == pool
    orders = {tuple(c.replica for c in RandomSelector(random.Random(s)).order(pool, **KEY)) for s in range(20)}
    assert len(orders) > 1


def test_load_aware_without_weight_is_rendezvous() -> None:
    pool = cands(5, [9, 0, 3, 1, 7])
    assert LoadAwareSelector(0.0).order(pool, **KEY) == RendezvousHashSelector().order(pool, **KEY)


def test_load_aware_puts_the_busiest_source_last() -> None:
    # Unit hash is in [0, 1) and the busiest source's normalised load is 1, so with weight 1 it scores < 0.
    for target in range(50):
        pool = cands(4, [0, 5, 0, 0])
        order = LoadAwareSelector(1.0).order(pool, model="m", target_id=f"t{target}", target_rank=0)
        assert order[-1].replica == "replica-1"


def test_load_aware_prefers_idle_and_treats_unknown_load_as_middling() -> None:
    pool = cands(3, [None, 4, 0])
    wins = Counter(
        LoadAwareSelector(1.0).order(pool, model="m", target_id=f"t{t}", target_rank=0)[0].replica for t in range(200)
    )
    assert wins["replica-1"] == 0
    assert wins["replica-2"] > wins["replica-0"] > 0


def test_load_aware_all_idle_is_rendezvous() -> None:
    pool = cands(4, [0, 0, 0, 0])
    assert make_selector("loadAware").order(pool, **KEY) == RendezvousHashSelector().order(pool, **KEY)
