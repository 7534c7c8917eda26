"""Pipelined fan-out through the real parts: agents as processes, the operator, SeaweedFS, NIXL over UCX.

The agents reach SeaweedFS through a relay that paces it (4 MB/s) and can hold it. The first loader (by name)
streams the version from S3 one tensor at a time (`--s3-download-workers 1`) and serves what it has checked while
it loads. S3 holds once it has sent that loader every header probe and 16 of its 32 MiB, however slowly the test
polls, and stays held once that replica serves a chunk: from then on every byte any other replica gets must come
from a replica that is still Loading. The test lets S3 go on only once every other replica holds a chunk.
Then: each reader's status names a holder it read from while that holder was loading, no source ever granted more
read leases at once than `maxReadersPerSource`, one S3 read in all, and every replica serves the published bytes
(sha256, read back over NIXL). Killing the S3 loader mid-pipeline: the next replica by name becomes the first
loader, fetching from S3 only the tensors its Peer load had not checked, and the last one finishes from it without
restarting its load."""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc
import pytest
import torch

from ferry_agent.strategies.fanout import chunks_held, plan_chunks
from ferry_agent.transport.worker_service import SourceIdentity, get_holdings
from tests.support.agents import content_sha256, node, pull, read_back, reader_tokens, start_agent
from tests.support.objects import (
    apply,
    ml_body,
    ml_status,
    publish_delta,
    publish_full,
    tensors,
    wait_for,
    wait_reason,
    wv_body,
)
from tests.support.slow_s3 import SlowRelay, SlowS3

pytestmark = pytest.mark.e2e

TENSORS = 32  # of 1 MiB, one S3 GET each (its own shard): seconds through the relay
TENSOR_BYTES = 1 << 20
CHUNK_TENSORS = 2  # chunkMiB 2
HELD_AFTER = 16 << 20  # data bytes S3 sends before it holds: whole chunks of each rank, far from the whole load
S3_RATE = 4e6  # bytes/s the relay lets S3 send on a connection
GRANTED = re.compile(r"tensor read lease \S+ granted to \S+ \([^)]*\): (\d+) of (\S+) readers")
PEAK = re.compile(r"stops serving its load: at most (\d+) readers at once")
KEPT = re.compile(rf"(\d+) of {TENSORS} tensors \((\d+) bytes\) kept from the failed load, (\d+) bytes downloaded")


def replicas(cluster, namespace) -> dict[str, dict]:
    items = json.loads(cluster.kubectl("get", "wr", "-n", namespace, "-o", "json").stdout)["items"]
    return {r["metadata"]["name"]: r for r in items}


def held(cluster, namespace: str, wr: dict, known: int = 0, wait_s: float = 0.0) -> frozenset[int]:
    """The tensors (manifest indexes) a loading replica's rank 0 holds, checked, asked of its worker service as a
    reader of the version does (once it holds more than `known`, waiting up to `wait_s`)."""
    entry = ((wr.get("status") or {}).get("loadingRanks") or [None])[0]
    if entry is None:
        return frozenset()
    node_name = wr["spec"]["nodeName"]  # a reader there is assigned the version, so admitted
    tokens = reader_tokens(cluster, node_name)
    view = get_holdings(
        entry["grpcEndpoint"],
        SourceIdentity(entry["agentName"]),
        entry["tensorCount"],
        known=known,
        wait_s=wait_s,
        credentials=lambda: tokens(node_name),
    )
    return view.held


def held_now(cluster, namespace: str, name: str, known: int = 0, wait_s: float = 0.0) -> frozenset[int]:
    """`held` of replica `name` as its status names its service now (none when that service is gone: a load that
    restarted, on another strategy's target, closed the one its status still named)."""
    try:
        return held(cluster, namespace, replicas(cluster, namespace)[name], known=known, wait_s=wait_s)
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.UNAVAILABLE:
            raise
        return frozenset()


@pytest.fixture
def slow_s3(s3) -> Iterator[SlowS3]:
    relay = SlowRelay(s3.endpoint, S3_RATE)
    try:
        yield SlowS3(relay, s3)
    finally:
        relay.close()


def setup(cluster, s3, slow_s3, namespace, tmp_path, count: int):
    weights = tensors(7, n=TENSORS, shape=(256, 1024))
    publish_full(s3, namespace, "v1", weights)
    apply(cluster, namespace, wv_body(namespace, "v1"))
    wait_reason(cluster, namespace, "v1", "Ready", "True", "Verified", timeout=60)
    slow_s3.relay.hold_after(HELD_AFTER)
    names = [f"{namespace}-n{i}" for i in range(count)]
    agents = {}
    for n in names:
        node(cluster, n, {"ferry.dev/pool": namespace})
        agents[n] = start_agent(cluster, tmp_path, n, s3=slow_s3, args=["--s3-download-workers", "1"])
    expected = content_sha256({k: torch.from_numpy(v) for k, v in weights.items()})
    return agents, expected


@contextmanager
def first_holding(cluster, slow_s3, namespace, count: int, describe) -> Iterator[tuple[str, dict[str, dict]]]:
    """S3 held (if `hold_after` has not held it already) as soon as the first loader's rank 0 serves a whole chunk
    as readers plan them (long polls of its worker service); yields (its replica name, every replica), and lets S3
    go on after. The stream's order is not the chunks': a rank's tensors are every other one by name."""
    wait_for(lambda: len(replicas(cluster, namespace)) == count, 30, f"{count} replicas", describe)
    first = min(replicas(cluster, namespace))
    wait_for(
        lambda: (replicas(cluster, namespace)[first].get("status") or {}).get("loadingRanks"),
        60,
        f"{first} serving its load",
        describe,
    )
    tensor_count = replicas(cluster, namespace)[first]["status"]["loadingRanks"][0]["tensorCount"]
    chunks = plan_chunks([TENSOR_BYTES] * tensor_count, CHUNK_TENSORS * TENSOR_BYTES)
    holding: frozenset[int] = frozenset()
    deadline = time.monotonic() + 60
    while not chunks_held(chunks, holding):
        assert time.monotonic() < deadline, f"{first} served no whole chunk within 60s\n{describe()}"
        holding = held_now(cluster, namespace, first, known=len(holding), wait_s=2.0)
    slow_s3.relay.hold()
    try:
        assert len(holding) < tensor_count, "the S3 load was over before S3 could be held"
        yield first, replicas(cluster, namespace)
    finally:
        slow_s3.relay.release()


def test_replicas_read_from_loading_holders_within_the_reader_limit(
    cluster, s3, slow_s3, namespace, operator, tmp_path
):
    agents, expected = setup(cluster, s3, slow_s3, namespace, tmp_path, 4)

    def describe() -> str:
        statuses = {k: v.get("status") for k, v in replicas(cluster, namespace).items()}
        return json.dumps(statuses, indent=1) + "".join(a.log_tail(15) for a in agents.values())

    try:
        transfer = {"timeoutSeconds": 60, "maxReadersPerSource": 1, "chunkMiB": 2}
        apply(cluster, namespace, ml_body(namespace, "v1", 4, transfer=transfer))
        with first_holding(cluster, slow_s3, namespace, 4, describe) as (first, _):
            # S3 gives nothing more: whatever the others hold now came from a replica that is still loading.
            assert replicas(cluster, namespace)[first]["status"]["phase"] == "Loading"
            # Its worker service admits readers as a Serving one does: no token, no holdings.
            entry = replicas(cluster, namespace)[first]["status"]["loadingRanks"][0]
            with pytest.raises(grpc.RpcError) as refused:
                get_holdings(entry["grpcEndpoint"], SourceIdentity(entry["agentName"]), TENSORS)
            assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
            others = [n for n in replicas(cluster, namespace) if n != first]
            wait_for(
                lambda: all(len(held_now(cluster, namespace, n)) >= CHUNK_TENSORS for n in others),
                60,
                "every other replica holding a chunk read from loading holders",
                describe,
            )
            assert replicas(cluster, namespace)[first]["status"]["phase"] == "Loading"
        wait_for(lambda: ml_status(cluster, namespace).get("ready") == "4/4", 120, "4/4 Ready", describe)

        final = replicas(cluster, namespace)
        assert [n for n, r in final.items() if r["status"]["source"] == "s3"] == [first]
        for name in others:
            status = final[name]["status"]
            assert status["source"].startswith("peer/"), json.dumps(status["attempts"], indent=1)
            assert not status.get("loadingRanks"), status
            loaded = [a for a in status["attempts"] if a["source"].startswith("peer/") and a["outcome"] == "Loaded"]
            assert any("while it was loading" in a["message"] for a in loaded), status["attempts"]
        # No source granted more than one lease at once, loading or serving.
        for agent in agents.values():
            text = agent.log_path.read_text()
            grants = [(int(n), limit) for n, limit in GRANTED.findall(text)]
            assert all(n <= 1 and limit == "1" for n, limit in grants), grants
            assert all(int(p) <= 1 for p in PEAK.findall(text))
        assert sum(len(GRANTED.findall(a.log_path.read_text())) for a in agents.values()) >= 3
        for name, r in final.items():
            assert read_back(r["status"]["ranks"][0], name) == expected, f"{name} serves other bytes"
    finally:
        for a in agents.values():
            a.stop()


def test_a_dead_s3_loader_mid_pipeline_is_replaced_without_restarting_the_others(
    cluster, s3, slow_s3, namespace, operator, tmp_path
):
    agents, expected = setup(cluster, s3, slow_s3, namespace, tmp_path, 3)

    def describe() -> str:
        statuses = {k: v.get("status") for k, v in replicas(cluster, namespace).items()}
        return json.dumps(statuses, indent=1) + "".join(a.log_tail(15) for a in agents.values())

    try:
        transfer = {"timeoutSeconds": 60, "maxReadersPerSource": 2, "chunkMiB": 2}
        apply(cluster, namespace, ml_body(namespace, "v1", 3, transfer=transfer))
        with first_holding(cluster, slow_s3, namespace, 3, describe) as (first, listed):
            second, last = sorted(n for n in listed if n != first)
            wait_for(
                lambda: all(len(held_now(cluster, namespace, n)) >= CHUNK_TENSORS for n in (second, last)),
                60,
                "both others holding a chunk of the S3 loader's",
                describe,
            )
            killed = agents[listed[first]["spec"]["nodeName"]]
            os.killpg(killed.proc.pid, signal.SIGKILL)
            killed.proc.wait(10)
        # The next by name reads S3 now; the last one goes on from it, keeping what it holds.
        for name in (second, last):
            wait_for(
                lambda name=name: replicas(cluster, namespace)[name]["status"].get("phase") == "Serving",
                120,
                f"{name} Serving",
                describe,
            )
        final = replicas(cluster, namespace)
        assert final[second]["status"]["source"] == "s3", final[second]["status"]
        # It went on from what its Peer load had checked: S3 sent it only the other tensors (and every header).
        (s3_load,) = [a for a in final[second]["status"]["attempts"] if a["source"] == "ObjectStorage"]
        resumed = KEPT.fullmatch(s3_load["message"])
        assert resumed, final[second]["status"]["attempts"]
        kept, kept_bytes, downloaded = (int(g) for g in resumed.groups())
        assert kept >= CHUNK_TENSORS and kept_bytes == kept << 20, s3_load
        assert (TENSORS - kept) << 20 < downloaded < (TENSORS - kept + 1) << 20, s3_load
        status = final[last]["status"]
        assert status["source"] == f"peer/{second}", status
        kinds = [(a["source"], a["outcome"]) for a in status["attempts"]]
        assert ("Peer", "Loaded") in kinds and not any(s == "ObjectStorage" for s, _ in kinds), kinds
        # One Peer load throughout: every byte read once, across the holders it used (what it held when the first
        # loader died was kept), part of it from a holder still loading.
        loaded = [a for a in status["attempts"] if a["source"].startswith("peer/") and a["outcome"] == "Loaded"]
        moved = sum(int(re.match(r"(\d+) bytes", a["message"]).group(1)) for a in loaded)
        assert moved == TENSORS << 20, status["attempts"]
        assert any("while it was loading" in a["message"] for a in loaded), status["attempts"]
        for name in (second, last):
            assert read_back(final[name]["status"]["ranks"][0], name) == expected, f"{name} serves other bytes"

        # The first loader's node gets a new agent: it loads from the others, and all three serve.
        agents["restarted"] = start_agent(cluster, tmp_path, listed[first]["spec"]["nodeName"], s3=slow_s3)
        wait_for(lambda: ml_status(cluster, namespace).get("ready") == "3/3", 120, "3/3 Ready", describe)
        restarted = replicas(cluster, namespace)[first]
        assert read_back(restarted["status"]["ranks"][0], first) == expected
    finally:
        for a in agents.values():
            a.stop()


def test_two_rank_replicas_read_each_rank_from_a_replica_still_loading(
    cluster, s3, slow_s3, namespace, operator, tmp_path
):
    """Each rank process serves what it has checked while it loads: the S3 loader's local leader its own share of
    what it streams, every other replica's ranks what they read from peers."""
    agents, _ = setup(cluster, s3, slow_s3, namespace, tmp_path, 3)
    weights = tensors(7, n=TENSORS, shape=(256, 1024))

    def describe() -> str:
        statuses = {k: v.get("status") for k, v in replicas(cluster, namespace).items()}
        return json.dumps(statuses, indent=1) + "".join(a.log_tail(15) for a in agents.values())

    try:
        transfer = {"timeoutSeconds": 120, "chunkMiB": 2}
        apply(cluster, namespace, ml_body(namespace, "v1", 3, ranksPerReplica=2, transfer=transfer))
        with first_holding(cluster, slow_s3, namespace, 3, describe) as (first, _):
            others = [n for n in replicas(cluster, namespace) if n != first]

            reader = wait_for(
                lambda: next((n for n in others if len(held_now(cluster, namespace, n)) >= CHUNK_TENSORS), None),
                90,
                "another replica's rank 0 holding a chunk read from the loading S3 loader",
                describe,
            )
            status = replicas(cluster, namespace)[first]["status"]
            assert status["phase"] == "Loading" and [e["rank"] for e in status["loadingRanks"]] == [0], status
            loading = replicas(cluster, namespace)[reader]["status"]["loadingRanks"]
            assert [e["state"] for e in loading] == ["Loading"] * len(loading) and loading[0]["rank"] == 0, loading
        wait_for(lambda: ml_status(cluster, namespace).get("ready") == "3/3", 180, "3/3 Ready", describe)

        final = replicas(cluster, namespace)
        assert final[first]["status"]["source"] == "s3", final[first]["status"]
        status = final[reader]["status"]
        assert "peer/" in status["source"] and not status.get("loadingRanks"), status
        loaded = [a for a in status["attempts"] if a["source"].startswith("peer/") and a["outcome"] == "Loaded"]
        assert any("while it was loading" in a["message"] for a in loaded), status["attempts"]
        for name, wr in final.items():  # each rank serves its share; together exactly v1, byte for byte
            union: dict[str, torch.Tensor] = {}
            for entry in wr["status"]["ranks"]:
                union.update(pull(entry, name))
            assert sorted(union) == sorted(weights), name
            for key, array in weights.items():
                assert torch.equal(
                    union[key].contiguous().view(torch.uint8).reshape(-1),
                    torch.from_numpy(array).view(torch.uint8).reshape(-1),
                ), (name, key)
    finally:
        for a in agents.values():
            a.stop()


def test_a_rollout_reads_only_the_tensors_the_delta_changed(cluster, s3, namespace, operator, tmp_path):
    """Every replica holds v1; v2 changes four of eight tensors, a delta too large for every replica to replay it
    from S3 (`replica_load.DELTAS_FIRST_SHARE`, which `test_rollout` covers). The first loader replays the delta on
    its held v1 (the four others are v1's very memory) and says so; the others share those four with their own v1
    and READ only the four changed tensors from peers, each checked, and all serve exactly v2."""
    v1 = tensors(11, n=8, shape=(256, 256))
    changed = ["layer1.weight", "layer3.weight", "layer4.weight", "layer6.weight"]
    v2 = {k: (a + 1 if k in changed else a) for k, a in v1.items()}
    publish_full(s3, namespace, "v1", v1)
    publish_delta(s3, namespace, "v2", "v1", v1, v2)
    apply(cluster, namespace, wv_body(namespace, "v1"), wv_body(namespace, "v2", base="v1"))
    wait_reason(cluster, namespace, "v2", "Ready", "True", "Verified", timeout=60)
    names = [f"{namespace}-n{i}" for i in range(3)]
    agents = {}
    for n in names:
        node(cluster, n, {"ferry.dev/pool": namespace})
        agents[n] = start_agent(cluster, tmp_path, n, s3=s3)

    def describe() -> str:
        statuses = {k: v.get("status") for k, v in replicas(cluster, namespace).items()}
        return json.dumps(statuses, indent=1) + "".join(a.log_tail(15) for a in agents.values())

    def serving(version: str) -> int:
        found = replicas(cluster, namespace).values()
        return sum((r.get("status") or {}).get("version") == version for r in found if r["status"].get("phase"))

    try:
        body = ml_body(
            namespace, "v1", 3, transfer={"timeoutSeconds": 30, "chunkMiB": 1}, rollout={"strategy": "Parallel"}
        )
        apply(cluster, namespace, body)
        wait_for(lambda: ml_status(cluster, namespace).get("ready") == "3/3", 90, "3/3 on v1", describe)
        cluster.kubectl(
            "patch", "ml", "serve", "-n", namespace, "--type=merge", "-p", '{"spec":{"desiredVersion":"v2"}}'
        )
        wait_for(
            lambda: (
                serving("v2") == 3
                and all(not r["status"].get("loadingVersion") for r in replicas(cluster, namespace).values())
            ),
            90,
            "3 serving v2",
            describe,
        )
        final = replicas(cluster, namespace)
        first = min(final)
        assert final[first]["status"]["source"] == "s3", final[first]["status"]
        changed_bytes = sum(v2[k].nbytes for k in changed)
        for name in sorted(final)[1:]:
            status = final[name]["status"]
            assert status["source"].startswith("peer/"), json.dumps(status["attempts"], indent=1)
            loaded = [a for a in status["attempts"] if a["source"].startswith("peer/") and a["outcome"] == "Loaded"]
            moved = sum(int(re.match(r"(\d+) bytes", a["message"]).group(1)) for a in loaded)
            assert moved == changed_bytes, status["attempts"]
        expected = content_sha256({k: torch.from_numpy(v) for k, v in v2.items()})
        for name, r in final.items():
            assert read_back(r["status"]["ranks"][0], name) == expected, f"{name} serves other bytes"
    finally:
        for a in agents.values():
            a.stop()
