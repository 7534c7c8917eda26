"""bench/sim_fanout.py's invariants (bytes and counts, never this machine's timing)."""

from __future__ import annotations

import pytest

from bench.sim_fanout import MODES, PIPELINED, S3_ONLY, WHOLE, Fleet, simulate

pytestmark = pytest.mark.unit

MIB = 1 << 20


def fleet(n: int, **kw) -> Fleet:
    base = {
        "replicas": n,
        "model_bytes": 64 * MIB,
        "nic_gbps": 8.0,
        "s3_client_gbps": 4.0,
        "s3_latency_s": 0.0,
        "peer_latency_s": 0.0,
        "tensor_bytes": MIB,
        "chunk_bytes": 4 * MIB,  # 16 chunks
    }
    return Fleet(**{**base, **kw})


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("n", [1, 3, 17])
def test_every_replica_receives_exactly_the_model(mode: str, n: int) -> None:
    result = simulate(fleet(n, max_readers=2 if mode == PIPELINED else None), mode)
    assert result.received == [64 * MIB] * n
    expected_s3 = n if mode == S3_ONLY else 1
    assert result.s3_bytes == expected_s3 * 64 * MIB


@pytest.mark.parametrize("limit", [1, 2, 3])
def test_no_source_exceeds_its_reader_limit(limit: int) -> None:
    for mode in (WHOLE, PIPELINED):
        result = simulate(fleet(20, max_readers=limit), mode)
        assert 1 <= result.max_readers_seen <= limit
        assert result.received == [64 * MIB] * 20


def test_one_replica_takes_the_s3_time() -> None:
    s3_time = 64 * MIB / (4.0 * 1e9 / 8)
    for mode in MODES:
        assert simulate(fleet(1, max_readers=2), mode).all_serving_s == pytest.approx(s3_time)


@pytest.mark.parametrize("n", [2, 4, 16, 40])
def test_pipelined_is_no_slower_than_whole_copy(n: int) -> None:
    assert simulate(fleet(n, max_readers=4), PIPELINED).all_serving_s <= simulate(fleet(n), WHOLE).all_serving_s


@pytest.mark.parametrize("mode", MODES)
def test_monotonic_in_replicas(mode: str) -> None:
    times = [simulate(fleet(n, max_readers=3), mode).all_serving_s for n in (1, 2, 4, 8, 16, 32)]
    assert times == sorted(times)


def test_a_copy_past_the_timeout_falls_back_to_s3() -> None:
    """Today's agents: 30 readers on the one source take longer than the transfer timeout, so they drop their
    copies and read S3 (the listing had only that one candidate)."""
    result = simulate(fleet(30, timeout_s=0.5), WHOLE)
    assert result.abandoned_bytes > 0
    assert result.received == [64 * MIB] * 30
    assert result.s3_bytes > 64 * MIB


def test_the_pipelined_mode_decides_with_the_agents_own_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every lease the simulation starts is what `strategies.fanout.choose` returned, and the sources come from the
    registry's functions: replacing them changes the outcome."""
    import bench.sim_fanout as sim
    from ferry_agent.strategies import fanout

    picks: list[tuple[str, list[int]]] = []

    def recording(needed, ranked, max_chunks=None):  # type: ignore[no-untyped-def]
        pick = fanout.choose(needed, ranked, max_chunks)
        if pick is not None:
            picks.append(pick)
        return pick

    monkeypatch.setattr(sim, "choose", recording)
    result = simulate(fleet(6, max_readers=2), PIPELINED)
    assert picks and result.received == [64 * MIB] * 6
    monkeypatch.setattr(sim, "holder_candidates", lambda *a, **k: [])  # no loading holders: only Serving sources
    assert simulate(fleet(6, max_readers=2), PIPELINED).all_serving_s > result.all_serving_s
