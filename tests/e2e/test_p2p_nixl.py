"""Real peer-to-peer loads: source agents are subprocesses (`python -m ferry_dev.source_main`), the target
is this process, bytes move by NIXL READ over UCX (cma + tcp on loopback) and are checked by sha256.

NIXL/UCX must not touch a real network, so this module only runs in a loopback-only network namespace:

    unshare -n bash -c 'ip link set lo up; UCX_NET_DEVICES=lo \
        ~/.cache/ferry/venv/bin/pytest -p no:cacheprovider tests/e2e/test_p2p_nixl.py'
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest

from ferry.api.models import AttemptOutcome
from ferry_agent.strategies.candidate import SourceCandidate
from ferry_agent.strategies.chain import LoadContext, StrategyFailed, run_strategy_chain
from ferry_agent.strategies.peer import PeerLoadResult, PeerStrategy, TransferSettings
from ferry_agent.transport.nixl import NixlPeer
from ferry_agent.transport.worker_service import (
    SourceIdentity,
    WorkerServer,
    get_tensor_manifest,
    prepare_tensor_read,
    serve_resident,
)
from ferry_dev.source_main import READY_MARKER, REPLY_MARKER

pytestmark = pytest.mark.e2e

RUN_HINT = (
    "unshare -n bash -c 'ip link set lo up; UCX_NET_DEVICES=lo "
    "~/.cache/ferry/venv/bin/pytest -p no:cacheprovider tests/e2e/test_p2p_nixl.py'"
)
TENSORS, TENSOR_BYTES, SEED = 6, 512 << 10, 7  # ~3 MiB per source


@pytest.fixture(scope="module", autouse=True)
def loopback_only_netns() -> Iterator[None]:
    # socket.if_nameindex() sees this process's network namespace; /sys/class/net shows the namespace sysfs
    # was mounted in, which `unshare -n` does not change.
    interfaces = sorted(name for _, name in socket.if_nameindex())
    if interfaces != ["lo"]:
        pytest.fail(
            f"NIXL tests must run in a loopback-only network namespace (this one has {interfaces}); run:\n  {RUN_HINT}",
            pytrace=False,
        )
    try:
        with socket.create_server(("127.0.0.1", 0)) as srv:
            socket.create_connection(srv.getsockname(), timeout=2).close()
    except OSError as exc:
        pytest.fail(
            f"loopback is down in this namespace ({exc}); bring it up with `ip link set lo up`:\n  {RUN_HINT}",
            pytrace=False,
        )
    previous = os.environ.get("UCX_NET_DEVICES")
    os.environ["UCX_NET_DEVICES"] = "lo"  # our own NIXL agent, created below, reads it
    yield
    if previous is None:
        os.environ.pop("UCX_NET_DEVICES", None)
    else:
        os.environ["UCX_NET_DEVICES"] = previous


class Source:
    """One source agent subprocess, driven through its stdin command protocol."""

    def __init__(self, name: str, logdir: Path, *, lease_ttl: float | None = None) -> None:
        self.name = name
        self.log_path = logdir / f"{name}.log"
        cmd = [
            sys.executable,
            "-m",
            "ferry_dev.source_main",
            "--agent-name",
            name,
            "--tensors",
            str(TENSORS),
            "--tensor-bytes",
            str(TENSOR_BYTES),
            "--seed",
            str(SEED),
        ]
        if lease_ttl is not None:
            cmd += ["--lease-ttl", str(lease_ttl)]
        env = {**os.environ, "UCX_NET_DEVICES": "lo", "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, text=True, env=env
            )
        self._ready: queue.Queue[dict[str, Any]] = queue.Queue()
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.info: dict[str, Any] = {}

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:  # other lines are NIXL's own logging
            if line.startswith(READY_MARKER):
                self._ready.put(json.loads(line[len(READY_MARKER) :]))
            elif line.startswith(REPLY_MARKER):
                self._replies.put(json.loads(line[len(REPLY_MARKER) :]))

    def wait_ready(self, timeout: float = 90) -> dict[str, Any]:
        try:
            self.info = self._ready.get(timeout=timeout)
        except queue.Empty:
            pytest.fail(f"source {self.name} not ready in {timeout}s:\n{self.log_path.read_text()[-3000:]}")
        return self.info

    def command(self, line: str, timeout: float = 15) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        return self._replies.get(timeout=timeout)

    def active_leases(self) -> int:
        return int(self.command("leases")["active_leases"])

    def candidate(self, replica: str | None = None, **overrides: Any) -> SourceCandidate:
        fields = {
            "replica": replica or f"replica-{self.name}",
            "rank": 0,
            "agent_name": self.info["agent_name"],
            "grpc_endpoint": self.info["endpoint"],
            "tensor_count": self.info["tensor_count"],
            "manifest_digest": self.info["manifest_digest"],
            "instance_id": self.info["instance_id"],
        }
        return SourceCandidate(**{**fields, **overrides})

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        if not self.alive:
            return
        self.signal(signal.SIGCONT)
        assert self.proc.stdin is not None
        self.proc.stdin.close()  # EOF: the source shuts down cleanly
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Source]]:
    logdir = tmp_path_factory.mktemp("p2p-sources")
    started: dict[str, Source] = {}
    try:
        # Started together: each one's torch + NIXL start-up takes seconds.
        for name, ttl in (("src-a", None), ("src-dead", None), ("src-wedged", 3.0)):
            started[name] = Source(name, logdir, lease_ttl=ttl)
        for src in started.values():
            src.wait_ready()
        digests = {(s.info["manifest_digest"], s.info["content_sha256"]) for s in started.values()}
        assert len(digests) == 1, "sources seeded alike must serve identical weights"
        yield started
    finally:
        for src in started.values():
            src.stop()


@pytest.fixture(scope="module")
def peer() -> Iterator[NixlPeer]:
    target = NixlPeer(f"target-{uuid.uuid4().hex[:8]}")
    yield target
    target.shutdown()


class InOrder:
    """Keeps the given candidate order, so a test decides which source is tried first."""

    name = "inOrder"

    def order(self, candidates: Sequence[SourceCandidate], **_: Any) -> list[SourceCandidate]:
        return list(candidates)


def load(
    peer: NixlPeer,
    candidates: Sequence[SourceCandidate],
    *,
    timeout_s: float = 20,
    rpc_timeout_s: float = 5,
    stall_s: float = 60,
    progress: Callable[[int, int, str], None] | None = None,
) -> tuple[PeerLoadResult, LoadContext]:
    settings = TransferSettings(
        timeout_s=timeout_s, rpc_timeout_s=rpc_timeout_s, progress_interval_s=0, stall_s=stall_s
    )
    strategy = PeerStrategy(
        peer=peer,
        candidates=lambda _: candidates,
        settings=settings,
        selector=InOrder(),
        progress=progress,
    )
    ctx = LoadContext(model="m", version="v1", rank=0, target_id="replica-target")
    published: list[PeerLoadResult] = []
    result = run_strategy_chain([strategy], ctx, reinit=lambda _: None, publish=lambda r, _: published.append(r))
    assert published == [result]
    return result, ctx


def verify_and_drop(peer: NixlPeer, result: PeerLoadResult, source: Source) -> None:
    assert result.resident.content_sha256() == source.info["content_sha256"]
    assert result.resident.digest == source.info["manifest_digest"]
    assert peer.remote_names == frozenset()  # the pair was closed during the load
    peer.deregister(result.resident)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


def test_peer_load_moves_verified_bytes_and_releases_everything(sources: dict[str, Source], peer: NixlPeer) -> None:
    a = sources["src-a"]
    seen: list[tuple[int, int, str]] = []
    result, ctx = load(peer, [a.candidate("replica-a")], progress=lambda *p: seen.append(p))
    assert result.bytes_moved == a.info["total_bytes"] > 3 << 20
    verify_and_drop(peer, result, a)
    assert a.active_leases() == 0
    assert [(x.source, x.outcome) for x in ctx.attempts] == [
        ("peer/replica-a", AttemptOutcome.LOADED),
        ("Peer", AttemptOutcome.LOADED),
    ]
    assert seen[0][0] == 0 and seen[-1][0] == seen[-1][1] == result.bytes_moved
    # The pair was closed by the target, so the same source serves the next reader from a fresh connection.
    again, _ = load(peer, [a.candidate("replica-a")])
    verify_and_drop(peer, again, a)
    assert a.active_leases() == 0


def test_a_loaded_replica_publishes_itself_and_serves_the_next(sources: dict[str, Source], peer: NixlPeer) -> None:
    a = sources["src-a"]
    servers: list[WorkerServer] = []
    strategy = PeerStrategy(
        peer=peer, candidates=lambda _: [a.candidate("replica-a")], settings=TransferSettings(timeout_s=20)
    )
    ctx = LoadContext(model="m", version="v1", rank=0, target_id="replica-target")
    result = run_strategy_chain(
        [strategy],
        ctx,
        reinit=lambda _: None,
        publish=lambda r, c: servers.append(serve_resident(r.resident, peer, rank=c.rank)),
    )
    (server,) = servers
    downstream = NixlPeer(f"downstream-{uuid.uuid4().hex[:8]}")
    try:
        published = SourceCandidate(
            replica="replica-target",
            rank=0,
            agent_name=peer.name,
            grpc_endpoint=server.endpoint,
            tensor_count=result.resident.tensor_count,
            manifest_digest=result.resident.digest,
        )
        second, _ = load(downstream, [published])
        assert second.resident.content_sha256() == a.info["content_sha256"]
        assert server.leases.active_count() == 0 and downstream.remote_names == frozenset()
    finally:
        downstream.shutdown()
        server.stop(0)
        peer.stop_progress()
        peer.deregister(result.resident)
    assert a.active_leases() == 0


def test_killed_source_mid_transfer_falls_over_to_the_next(sources: dict[str, Source], peer: NixlPeer) -> None:
    dead, a = sources["src-dead"], sources["src-a"]

    def kill_at_start(done: int, total: int, source: str) -> None:
        if source == "peer/replica-dead" and done == 0 and total > 0:  # the READ is about to start
            dead.signal(signal.SIGKILL)
            dead.proc.wait(10)

    result, ctx = load(
        peer,
        [dead.candidate("replica-dead"), a.candidate("replica-a")],
        timeout_s=5,
        rpc_timeout_s=2,
        progress=kill_at_start,
    )
    assert not dead.alive
    first = ctx.attempts[0]
    assert (first.source, first.outcome) == ("peer/replica-dead", AttemptOutcome.FAILED)
    assert first.reason in ("TransferFailed", "TransferTimeout"), first
    assert result.source.replica == "replica-a"
    verify_and_drop(peer, result, a)
    assert a.active_leases() == 0


def test_wedged_source_times_out_then_the_next_loads(sources: dict[str, Source], peer: NixlPeer) -> None:
    wedged, a = sources["src-wedged"], sources["src-a"]

    def stop_at_start(done: int, total: int, source: str) -> None:
        if source == "peer/replica-wedged" and done == 0 and total > 0:
            wedged.signal(signal.SIGSTOP)  # the source can no longer answer the connection handshake

    started = time.monotonic()
    try:
        result, ctx = load(
            peer,
            [wedged.candidate("replica-wedged"), a.candidate("replica-a")],
            timeout_s=4,
            rpc_timeout_s=2,
            progress=stop_at_start,
        )
    finally:
        wedged.signal(signal.SIGCONT)
    assert time.monotonic() - started < 15
    assert (ctx.attempts[0].source, ctx.attempts[0].reason) == ("peer/replica-wedged", "TransferTimeout")
    assert result.source.replica == "replica-a"
    verify_and_drop(peer, result, a)
    assert a.active_leases() == 0
    # The stopped source could not hear the release; its lease lapses by TTL (3 s here) instead.
    wait_for(lambda: wedged.active_leases() == 0, 10, "the wedged source's lease to be released or expire")
    # The target removed its half-open pair, so the resumed source serves a new reader.
    again, _ = load(peer, [wedged.candidate("replica-wedged")], timeout_s=10)
    verify_and_drop(peer, again, wedged)
    assert wedged.active_leases() == 0


def test_a_source_wedged_mid_load_is_left_at_the_stall_limit_not_the_timeout(
    sources: dict[str, Source], peer: NixlPeer
) -> None:
    wedged, a = sources["src-wedged"], sources["src-a"]

    def stop_at_start(done: int, total: int, source: str) -> None:
        if source == "peer/replica-wedged" and done == 0 and total > 0:
            wedged.signal(signal.SIGSTOP)  # lease granted, READ posted: nothing moves from here on

    started = time.monotonic()
    try:
        result, ctx = load(
            peer,
            [wedged.candidate("replica-wedged"), a.candidate("replica-a")],
            timeout_s=600,
            rpc_timeout_s=2,
            stall_s=2,
            progress=stop_at_start,
        )
    finally:
        wedged.signal(signal.SIGCONT)
    # Left after 2 s without a chunk (plus the release RPC it cannot answer), not after the 600 s budget.
    assert time.monotonic() - started < 60
    assert (ctx.attempts[0].source, ctx.attempts[0].reason) == ("peer/replica-wedged", "TransferStalled")
    assert "no transfer completed for 2s" in ctx.attempts[0].message
    assert result.source.replica == "replica-a"
    verify_and_drop(peer, result, a)
    assert a.active_leases() == 0
    wait_for(lambda: wedged.active_leases() == 0, 10, "the wedged source's lease to be released or expire")


def test_draining_source_refuses_new_reads(sources: dict[str, Source], peer: NixlPeer) -> None:
    a = sources["src-a"]
    identity = SourceIdentity(a.info["agent_name"], a.info["instance_id"])
    # A drain cannot finish while a reader holds a lease: it times out and the source re-opens.
    held = prepare_tensor_read(a.info["endpoint"], identity)
    assert a.command("drain 0.2")["drained"] is False
    assert a.command("leases")["accepting"] is True
    held.close()

    assert a.command("drain 5") == {"drained": True}
    try:
        with pytest.raises(grpc.RpcError) as info:
            get_tensor_manifest(a.info["endpoint"], identity)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        with pytest.raises(RuntimeError, match="No load strategy succeeded"):
            load(peer, [a.candidate("replica-a")])
    finally:
        a.command("resume")
    result, _ = load(peer, [a.candidate("replica-a")])
    verify_and_drop(peer, result, a)
    assert a.active_leases() == 0


def test_refusals_are_recorded_and_unmutated(sources: dict[str, Source], peer: NixlPeer) -> None:
    a = sources["src-a"]
    a.command("drain 5")
    try:
        strategy = PeerStrategy(
            peer=peer,
            candidates=lambda _: [a.candidate("replica-a"), a.candidate("replica-impostor", agent_name="impostor")],
            settings=TransferSettings(timeout_s=5),
            selector=InOrder(),
        )
        ctx = LoadContext(model="m", version="v1", rank=0, target_id="replica-target")
        with pytest.raises(StrategyFailed) as info:
            strategy.load(ctx)
    finally:
        a.command("resume")
    assert info.value.mutated is False  # nothing was read, so no reinit is needed
    assert [(x.source, x.reason) for x in ctx.attempts] == [
        ("peer/replica-a", "SourceUnavailable"),
        ("peer/replica-impostor", "SourceIdentityMismatch"),
    ]
    strategy.rollback(ctx)
    assert a.active_leases() == 0 and peer.remote_names == frozenset()
