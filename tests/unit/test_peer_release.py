"""Peer-release rules (ModelExpress's peer-release rules, numbered as below) pinned against Ferry's API.

Every rule is checked with fakes that record call order. Mapping to the seed's rules:
  1-2. Ferry always takes a read lease (PrepareTensorRead/ReleaseTensorRead, docs/architecture.md): first, once per
       attempt, bounded by the RPC timeout and the candidate's budget, naming the target as reader.
  3.   A successful load removes the remote agent exactly once, during the load (never at exit).
  4.   The removed name is the one claimed before the add (and the one read from).
  5.   Order: transfer → device sync → remove_remote → lease release.
  6.   A transfer failure still removes once and raises SourceTransferError from the original error.
  7.   A failure after the lease and around the transfer still removes once and propagates unwrapped.
  8.   A failed add (half-finished handshake) removes the claimed name once; the error is not wrapped.
  9.   The peer is loaded once from the manifest's blob, its name passed to the read; never remove(None).
Plus NixlPeer.remove_remote never raising, the wedged-transfer timeout, name-matched descriptors and the
resident-weights rules the transfer relies on.
"""

from __future__ import annotations

import atexit
import math
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any

import pytest
import torch

from ferry.api.models import AttemptOutcome
from ferry_agent.store.resident import ResidentWeights, TensorSpec, manifest_digest
from ferry_agent.strategies.candidate import SourceCandidate
from ferry_agent.strategies.chain import LoadContext, SourceTransferError, StrategyFailed
from ferry_agent.strategies.peer import (
    PeerStrategy,
    ProgressThrottle,
    TransferSettings,
    transfer_timeout_seconds,
)
from ferry_agent.transport.holdings import HoldingsView
from ferry_agent.transport.nixl import ManifestMismatchError, NixlPeer, RemoteTensor, TransferStalled, describe
from ferry_agent.transport.worker_service import SourceIdentity, SourceManifest, adler32s, build_manifest

pytestmark = pytest.mark.unit

BLOB = b"nixl-metadata-of-src"


def source_weights() -> ResidentWeights:
    return ResidentWeights(
        {
            "layers.0.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
            "layers.0.bias": torch.ones(5, dtype=torch.bfloat16),
            "empty": torch.empty(0, 2),
        }
    )


SOURCE = source_weights()


def manifest_for(agent: str, rank: int = 0) -> SourceManifest:
    msg = build_manifest(SOURCE, identity=SourceIdentity(agent, "i"), rank=rank, nixl_metadata=BLOB + agent.encode())
    return SourceManifest.from_proto(msg)


def cand(replica: str, **kw: Any) -> SourceCandidate:
    return SourceCandidate(replica=replica, rank=0, agent_name=f"agent-{replica}", grpc_endpoint="127.0.0.1:1", **kw)


def full_holdings(manifest: SourceManifest) -> HoldingsView:
    """A Serving source's holdings: every tensor, with the checksums of SOURCE's bytes."""
    sums = adler32s(SOURCE)
    return HoldingsView(frozenset(range(len(manifest.tensors))), tuple(sums[t.name] for t in manifest.tensors), True)


class FakeLease:
    def __init__(self, log: list[tuple], manifest: SourceManifest, error: Exception | None) -> None:
        self.log, self.manifest, self.error = log, manifest, error
        self.holdings = full_holdings(manifest)

    def close(self) -> None:
        self.log.append(("lease_release", self.manifest.identity.agent_name))
        if self.error is not None:
            raise self.error


class FakeClient:
    def __init__(self, log: list[tuple], **per_replica: Any) -> None:
        self.log = log
        self.per_replica = per_replica  # replica -> {"prepare_error", "release_error", "manifest"}

    def prepare(self, candidate: SourceCandidate, *, reader: str, timeout_s: float) -> FakeLease:
        self.log.append(("lease", candidate.agent_name, reader, timeout_s))
        opts = self.per_replica.get(candidate.replica, {})
        if "prepare_error" in opts:
            raise opts["prepare_error"]
        manifest = opts.get("manifest") or manifest_for(candidate.agent_name)
        return FakeLease(self.log, manifest, opts.get("release_error"))

    def holdings(self, candidate: SourceCandidate, **_: Any) -> HoldingsView:
        return full_holdings(manifest_for(candidate.agent_name))


class FakePeer:
    """Records the TransferPeer calls; `read` copies the source's bytes like a real READ would."""

    name = "agent-target"

    def __init__(
        self,
        log: list[tuple],
        *,
        add_error: Exception | None = None,
        add_returns: str | None = None,
        read_error: Callable[[str], Exception | None] | None = None,
        sync_error: Exception | None = None,
        corrupt: Collection[str] = (),
    ) -> None:
        self.log = log
        self.corrupt = corrupt  # remotes whose READs land one flipped byte in each group
        self.add_error, self.add_returns = add_error, add_returns
        self.read_error, self.sync_error = read_error, sync_error
        self.loaded: set[str] = set()

    def register(self, resident: ResidentWeights) -> None:
        self.log.append(("register",))

    def deregister(self, resident: ResidentWeights) -> None:
        self.log.append(("deregister",))

    def add_remote(self, blob: bytes) -> str:
        self.log.append(("add", blob))
        if self.add_error is not None:
            raise self.add_error
        name = self.add_returns or blob.removeprefix(BLOB).decode()
        self.loaded.add(name)
        return name

    def remove_remote(self, name: str) -> bool:
        self.log.append(("remove", name))
        self.loaded.discard(name)
        return True

    def read_groups(
        self,
        remote_name: str,
        remote_tensors: Sequence[RemoteTensor],
        local: ResidentWeights,
        groups: Sequence[Sequence[str]],
        timeout_s: float,
        *,
        on_start: Callable[[int], None] | None = None,
        on_done: Callable[[int], None] = lambda _i: None,
        stall_s: float | None = None,
    ) -> int:
        self.log.append(("transfer", remote_name, timeout_s))
        self.stall_s = stall_s
        assert remote_name in self.loaded, "read from a peer that was not loaded"
        sizes = {t.name: t.nbytes for t in remote_tensors}
        total = sum(sizes[name] for group in groups for name in group)
        if on_start is not None:
            on_start(total)
        error = self.read_error(remote_name) if self.read_error else None
        if error is not None:
            raise error
        for i, group in enumerate(groups):
            for name in group:
                local.tensors[name].copy_(SOURCE.tensors[name])
            landed = [name for name in group if local.tensors[name].numel()]
            if remote_name in self.corrupt and landed:
                local.tensors[landed[0]].view(-1).view(torch.uint8)[0] ^= 1
            on_done(i)
        return total

    def synchronize(self, device: torch.device) -> None:
        self.log.append(("sync", str(device)))
        if self.sync_error is not None:
            raise self.sync_error


def ctx(**kw: Any) -> LoadContext:
    return LoadContext(model="m", version="v1", rank=0, target_id="replica-target", **kw)


class InOrder:
    name = "inOrder"

    def order(self, candidates, **_: Any):  # type: ignore[no-untyped-def]
        return list(candidates)


def strategy(
    peer: FakePeer,
    client: FakeClient,
    candidates: Sequence[SourceCandidate],
    settings: TransferSettings | None = None,
    **kw: Any,
) -> PeerStrategy:
    return PeerStrategy(
        peer=peer,
        candidates=lambda _: candidates,
        client=client,
        settings=settings or TransferSettings(timeout_s=30, rpc_timeout_s=2),
        selector=InOrder(),
        **kw,
    )


def kinds(log: list[tuple]) -> list[str]:
    return [entry[0] for entry in log]


# --------------------------------------------------------------------------------- rules 1-5


def test_rules_1_2_lease_is_taken_first_once_per_attempt_bounded_and_named() -> None:
    log: list[tuple] = []
    s = strategy(FakePeer(log), FakeClient(log), [cand("a")])
    s.load(ctx())
    leases = [e for e in log if e[0] == "lease"]
    assert log[0][0] == "lease" and len(leases) == 1
    assert leases[0][1:] == ("agent-a", "replica-target", 2)


def test_rules_3_4_5_success_releases_once_during_the_load_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    exit_hooks: list[Any] = []
    monkeypatch.setattr(atexit, "register", lambda *a, **k: exit_hooks.append(a))
    log: list[tuple] = []
    peer = FakePeer(log)
    c = ctx()
    result = strategy(peer, FakeClient(log), [cand("a")]).load(c)

    assert kinds(log) == ["lease", "register", "add", "transfer", "sync", "remove", "lease_release"]
    removes = [e for e in log if e[0] == "remove"]
    assert removes == [("remove", "agent-a")]  # exactly once, and already done when load() returns
    assert log[log.index(("add", BLOB + b"agent-a")) + 1][1] == "agent-a"  # read from the claimed name
    assert peer.loaded == set() and exit_hooks == []
    assert result.resident.content_sha256() == SOURCE.content_sha256()
    assert result.source.replica == "a" and result.bytes_moved == SOURCE.total_bytes
    assert [(a.source, a.outcome) for a in c.attempts] == [("peer/a", AttemptOutcome.LOADED)]


# ---------------------------------------------------------------------------------- rule 6


def test_rule_6_transfer_failure_releases_once_and_wraps_the_cause() -> None:
    log: list[tuple] = []
    wedged = TimeoutError("wedged QP")
    s = strategy(FakePeer(log, read_error=lambda _: wedged), FakeClient(log), [cand("a")])
    with pytest.raises(SourceTransferError) as info:
        s._load_from(cand("a"), ctx())
    assert info.value.__cause__ is wedged
    assert kinds(log)[-3:] == ["transfer", "remove", "lease_release"]  # no sync of a failed read
    assert [e for e in log if e[0] == "remove"] == [("remove", "agent-a")]


def test_rule_6_through_load_records_a_transfer_timeout_and_claims_mutation() -> None:
    log: list[tuple] = []
    c = ctx()
    s = strategy(FakePeer(log, read_error=lambda _: TimeoutError("late")), FakeClient(log), [cand("a")])
    with pytest.raises(StrategyFailed) as info:
        s.load(c)
    assert info.value.mutated is True  # the READ was posted: bytes may have landed
    assert (c.attempts[0].source, c.attempts[0].reason) == ("peer/a", "TransferTimeout")


# ---------------------------------------------------------------------------------- rule 7


def test_rule_7_sync_failure_propagates_unwrapped_after_ordered_release() -> None:
    log: list[tuple] = []
    s = strategy(FakePeer(log, sync_error=RuntimeError("device lost")), FakeClient(log), [cand("a")])
    with pytest.raises(RuntimeError, match="device lost") as info:
        s._load_from(cand("a"), ctx())
    assert not isinstance(info.value, SourceTransferError)
    assert kinds(log)[-4:] == ["transfer", "sync", "remove", "lease_release"]
    assert kinds(log).count("remove") == 1


def test_rule_7_budget_spent_before_the_transfer_releases_once_unwrapped() -> None:
    log: list[tuple] = []
    now = [0.0]

    class SlowPeer(FakePeer):
        def add_remote(self, blob: bytes) -> str:
            now[0] += 31  # the handshake used up the 30 s budget
            return super().add_remote(blob)

    s = strategy(SlowPeer(log), FakeClient(log), [cand("a")], clock=lambda: now[0])
    with pytest.raises(TimeoutError, match="budget"):
        s._load_from(cand("a"), ctx())
    assert "transfer" not in kinds(log)
    assert kinds(log)[-2:] == ["remove", "lease_release"] and kinds(log).count("remove") == 1


def test_rule_7_failure_before_the_claim_releases_the_lease_only() -> None:
    log: list[tuple] = []

    def allocate(specs: Sequence[TensorSpec], device: str) -> ResidentWeights:
        raise MemoryError("no room for the target")

    s = strategy(FakePeer(log), FakeClient(log), [cand("a")], allocate=allocate)
    with pytest.raises(MemoryError):
        s._load_from(cand("a"), ctx())
    assert kinds(log) == ["lease", "lease_release"]


# ---------------------------------------------------------------------------------- rule 8


def test_rule_8_failed_add_removes_the_claimed_name_once_and_is_not_wrapped() -> None:
    log: list[tuple] = []
    half_open = TimeoutError("handshake timed out")
    s = strategy(FakePeer(log, add_error=half_open), FakeClient(log), [cand("a")])
    with pytest.raises(TimeoutError) as info:
        s._load_from(cand("a"), ctx())
    assert info.value is half_open
    assert kinds(log) == ["lease", "register", "add", "remove", "lease_release"]
    assert ("remove", "agent-a") in log


# ---------------------------------------------------------------------------------- rule 9


def test_rule_9_loaded_once_from_the_manifest_blob_and_never_remove_none() -> None:
    log: list[tuple] = []
    s = strategy(FakePeer(log), FakeClient(log), [cand("a")])
    s.load(ctx())
    assert [e for e in log if e[0] == "add"] == [("add", BLOB + b"agent-a")]
    transfers = [e for e in log if e[0] == "transfer"]
    assert [t[1] for t in transfers] == ["agent-a"]
    assert all(e[1] is not None for e in log if e[0] == "remove")


def test_rule_9_blob_naming_another_agent_is_refused_and_both_names_dropped() -> None:
    log: list[tuple] = []
    s = strategy(FakePeer(log, add_returns="impostor"), FakeClient(log), [cand("a")])
    with pytest.raises(ManifestMismatchError):
        s._load_from(cand("a"), ctx())
    assert "transfer" not in kinds(log)
    assert [e for e in log if e[0] == "remove"] == [("remove", "impostor"), ("remove", "agent-a")]
    assert kinds(log)[-1] == "lease_release"


# ------------------------------------------------------------------------- candidates and retries


def test_lease_failure_releases_nothing_and_the_next_candidate_loads() -> None:
    log: list[tuple] = []
    c = ctx()
    client = FakeClient(log, a={"prepare_error": ConnectionError("refused")})
    result = strategy(FakePeer(log), client, [cand("a"), cand("b")]).load(c)
    assert result.source.replica == "b"
    a_entries = [e for e in log if len(e) > 1 and e[1] == "agent-a"]
    assert [e[0] for e in a_entries] == ["lease"]  # never loaded, so nothing removed or released
    assert [(a.source, a.outcome) for a in c.attempts] == [
        ("peer/a", AttemptOutcome.FAILED),
        ("peer/b", AttemptOutcome.LOADED),
    ]


def test_each_candidate_is_fully_released_before_the_next_lease() -> None:
    log: list[tuple] = []
    peer = FakePeer(log, read_error=lambda name: OSError("reset") if name == "agent-a" else None)
    strategy(peer, FakeClient(log), [cand("a"), cand("b")]).load(ctx())
    assert kinds(log) == [
        "lease",
        "register",
        "add",
        "transfer",
        "remove",
        "lease_release",
        "lease",
        "add",
        "transfer",
        "sync",
        "remove",
        "lease_release",
    ]
    assert [e[1] for e in log if e[0] == "remove"] == ["agent-a", "agent-b"]


def test_a_group_that_fails_its_check_fails_its_holder_and_the_next_lands_the_bytes() -> None:
    log: list[tuple] = []
    c = ctx()
    result = strategy(FakePeer(log, corrupt={"agent-a"}), FakeClient(log), [cand("a"), cand("b")]).load(c)
    assert result.resident.content_sha256() == SOURCE.content_sha256() and result.source.replica == "b"
    assert [(a.source, a.outcome) for a in c.attempts] == [("peer/a", "Failed"), ("peer/b", "Loaded")]
    assert c.attempts[0].reason == "TransferFailed" and "fails its adler32 check" in c.attempts[0].message
    assert kinds(log).count("lease_release") == 2  # the corrupt holder's lease went back too

    only = ctx()
    with pytest.raises(StrategyFailed, match="fails its adler32 check") as info:
        strategy(FakePeer([], corrupt={"agent-a"}), FakeClient([]), [cand("a")]).load(only)
    assert info.value.mutated is True


def test_the_lease_goes_back_while_the_checks_of_what_landed_still_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """The lease covers the READ: its release does not wait for the checks (each one here waits for the release)."""
    log: list[tuple] = []
    released = threading.Event()
    client = FakeClient(log)
    prepare = client.prepare

    def leasing(*args: Any, **kw: Any) -> FakeLease:
        lease = prepare(*args, **kw)
        close = lease.close
        lease.close = lambda: (close(), released.set())  # type: ignore[method-assign]
        return lease

    client.prepare = leasing  # type: ignore[method-assign]
    check = PeerStrategy._check

    def after_release(self: PeerStrategy, *args: Any) -> None:
        assert released.wait(10), "the lease was held until the checks were done"
        check(self, *args)

    monkeypatch.setattr(PeerStrategy, "_check", after_release)
    result = strategy(FakePeer(log), client, [cand("a")]).load(ctx())
    assert result.resident.content_sha256() == SOURCE.content_sha256()
    assert set(result.resident.checksums) == set(SOURCE.tensors)  # every tensor checked before the load returned


def test_lease_release_failure_masks_neither_success_nor_the_original_error() -> None:
    log: list[tuple] = []
    client = FakeClient(log, a={"release_error": ConnectionError("source gone")})
    assert strategy(FakePeer(log), client, [cand("a")]).load(ctx()).source.replica == "a"

    log2: list[tuple] = []
    c = ctx()
    client2 = FakeClient(log2, a={"release_error": ConnectionError("source gone")})
    s = strategy(FakePeer(log2, read_error=lambda _: OSError("reset")), client2, [cand("a")])
    with pytest.raises(StrategyFailed):
        s.load(c)
    assert c.attempts[0].reason == "TransferFailed"


def test_all_failures_before_any_transfer_are_not_a_mutation() -> None:
    log: list[tuple] = []
    client = FakeClient(log, a={"prepare_error": ConnectionError("x")}, b={"prepare_error": ConnectionError("y")})
    with pytest.raises(StrategyFailed, match="no peer source succeeded") as info:
        strategy(FakePeer(log), client, [cand("a"), cand("b")]).load(ctx())
    assert info.value.mutated is False
    assert "remove" not in kinds(log)


def test_no_candidates_is_an_unmutated_miss_without_any_call() -> None:
    log: list[tuple] = []
    with pytest.raises(StrategyFailed, match="no peer source for rank 0") as info:
        strategy(FakePeer(log), FakeClient(log), []).load(ctx())
    assert info.value.mutated is False and log == []


def test_listing_failure_is_an_unmutated_miss() -> None:
    log: list[tuple] = []

    def broken(_: LoadContext) -> list[SourceCandidate]:
        raise ConnectionError("apiserver down")

    s = PeerStrategy(peer=FakePeer(log), candidates=broken, client=FakeClient(log))
    with pytest.raises(StrategyFailed) as info:
        s.load(ctx())
    assert info.value.mutated is False and log == []


def test_wrong_rank_self_and_mismatched_digest_are_never_tried() -> None:
    log: list[tuple] = []
    c = ctx(expected_manifest_digest=SOURCE.digest)
    pool = [
        SourceCandidate("r1", 1, "agent-r1", "127.0.0.1:1"),
        SourceCandidate("me", 0, FakePeer.name, "127.0.0.1:1"),
        cand("stale", manifest_digest="0" * 64),
        cand("good", manifest_digest=SOURCE.digest, tensor_count=3),
    ]
    assert strategy(FakePeer(log), FakeClient(log), pool).load(c).source.replica == "good"
    assert [e[1] for e in log if e[0] == "lease"] == ["agent-good"]
    assert (c.attempts[0].source, c.attempts[0].outcome) == ("peer/stale", AttemptOutcome.SKIPPED)


def test_manifest_checks_run_before_the_claim() -> None:
    log: list[tuple] = []
    c = ctx()
    client = FakeClient(log, a={"manifest": manifest_for("agent-a", rank=3)}, b={"manifest": manifest_for("agent-x")})
    pool = [cand("a"), cand("b"), cand("c", manifest_digest="f" * 64)]
    with pytest.raises(StrategyFailed) as info:
        strategy(FakePeer(log), client, pool).load(c)
    assert info.value.mutated is False
    assert kinds(log) == ["lease", "lease_release"] * 3
    assert {a.reason for a in c.attempts} == {"ManifestMismatch"}


def test_attempts_are_capped_by_max_source_attempts() -> None:
    log: list[tuple] = []
    peer = FakePeer(log, read_error=lambda _: OSError("reset"))
    settings = TransferSettings(timeout_s=30, max_source_attempts=2)
    with pytest.raises(StrategyFailed):
        strategy(peer, FakeClient(log), [cand("a"), cand("b"), cand("c")], settings).load(ctx())
    assert [e[1] for e in log if e[0] == "lease"] == ["agent-a", "agent-b"]


def test_the_read_gets_the_remaining_per_candidate_budget() -> None:
    log: list[tuple] = []
    strategy(FakePeer(log), FakeClient(log), [cand("a")], TransferSettings(timeout_s=7)).load(ctx())
    (transfer,) = [e for e in log if e[0] == "transfer"]
    assert 0 < transfer[2] <= 7


def test_rollback_deregisters_the_target_it_allocated() -> None:
    log: list[tuple] = []
    s = strategy(FakePeer(log, read_error=lambda _: OSError("x")), FakeClient(log), [cand("a")])
    with pytest.raises(StrategyFailed):
        s.load(ctx())
    s.rollback(ctx())
    s.rollback(ctx())  # nothing left the second time
    assert kinds(log).count("deregister") == 1


class DiesAfterTheFirstGroup(FakePeer):
    """A holder that goes away mid-READ: the first chunk lands (and is checked), then the link fails."""

    def read_groups(
        self,
        remote_name: str,
        remote_tensors: Sequence[RemoteTensor],
        local: ResidentWeights,
        groups: Sequence[Sequence[str]],
        timeout_s: float,
        **kw: Any,
    ) -> int:
        super().read_groups(remote_name, remote_tensors, local, groups[:1], timeout_s, **kw)
        raise OSError("link down")


@pytest.mark.parametrize("world_size", [1, 2])
def test_a_failed_load_leaves_its_checked_tensors_for_the_next_strategy_on_a_one_rank_replica(world_size: int) -> None:
    log: list[tuple] = []
    s = strategy(
        DiesAfterTheFirstGroup(log), FakeClient(log), [cand("a")], TransferSettings(timeout_s=30, chunk_bytes=1)
    )
    c = ctx(world_size=world_size)
    with pytest.raises(StrategyFailed, match="link down") as info:
        s.load(c)
    assert info.value.mutated is True
    s.rollback(c)
    if world_size > 1:  # ranks agree on every outcome: nothing is carried over, the target is dropped
        assert c.leftover is None and kinds(log).count("deregister") == 1
        return
    # The first chunk (manifest order: "empty", "layers.0.bias") was checked; the weight's chunk never landed.
    leftover = c.leftover
    assert leftover is not None and sorted(leftover.checked) == ["empty", "layers.0.bias"]
    assert leftover.checked == {n: adler32s(SOURCE)[n] for n in leftover.checked}
    assert torch.equal(leftover.resident.tensors["layers.0.bias"], SOURCE.tensors["layers.0.bias"])
    assert "deregister" not in kinds(log)  # still registered: a load serving while it loads serves them on
    leftover.release()
    assert kinds(log).count("deregister") == 1


def test_progress_reports_start_and_completion_per_source() -> None:
    seen: list[tuple[int, int, str]] = []
    log: list[tuple] = []
    strategy(FakePeer(log), FakeClient(log), [cand("a")], progress=lambda *a: seen.append(a)).load(ctx())
    total = SOURCE.total_bytes
    assert seen == [(0, 0, "peer/a"), (0, total, "peer/a"), (total, total, "peer/a")]


def test_progress_throttle() -> None:
    now = [0.0]
    seen: list[tuple[int, int, str]] = []
    throttle = ProgressThrottle(lambda *a: seen.append(a), 1.0, clock=lambda: now[0])
    for done in (0, 10, 20):
        throttle(done, 100, "s")
        now[0] += 0.3
    now[0] += 1
    throttle(30, 100, "s")
    throttle(100, 100, "s")  # completion always goes through
    throttle(100, 100, "s")  # the same report again is no news
    assert [s[0] for s in seen] == [0, 30, 100]


@pytest.mark.parametrize(("source_is_news", "forwarded"), [(True, ["a", "b", "b"]), (False, ["a", "a"])])
def test_progress_throttle_another_source_is_news_only_when_sources_are_tried_one_by_one(
    source_is_news: bool, forwarded: list[str]
) -> None:
    """A strategy that tries sources in turn shows the one it now waits on at once; a load that reads chunks from
    many holders at once must not write a status per chunk because the holder changed."""
    now = [0.0]
    seen: list[tuple[int, int, str]] = []
    throttle = ProgressThrottle(lambda *a: seen.append(a), 1.0, clock=lambda: now[0], source_is_news=source_is_news)
    throttle(0, 100, "a")
    now[0] += 0.1
    throttle(10, 100, "b")
    now[0] += 0.1
    throttle(100, 100, "b" if source_is_news else "a")
    assert [s[2] for s in seen] == forwarded


# ----------------------------------------------------------------------------------- timeouts


@pytest.mark.parametrize("raw", [None, "", "abc", "-1", 0, -5, math.inf, -math.inf, math.nan, "nan", True, [], {}])
def test_invalid_timeouts_mean_the_default_never_no_timeout(raw: object) -> None:
    assert transfer_timeout_seconds(raw) == 300.0
    assert TransferSettings(timeout_s=raw).timeout_s == 300.0  # type: ignore[arg-type]


@pytest.mark.parametrize(("raw", "seconds"), [(7, 7.0), ("12.5", 12.5), (0.25, 0.25)])
def test_valid_timeouts(raw: object, seconds: float) -> None:
    assert transfer_timeout_seconds(raw) == seconds


def test_settings_from_the_modelload_spec() -> None:
    s = TransferSettings.from_spec(
        {"timeoutSeconds": 45, "maxSourceAttempts": 2, "selector": "loadAware", "stallSeconds": 7}
    )
    assert (s.timeout_s, s.max_source_attempts, s.selector, s.stall_s) == (45.0, 2, "loadAware", 7)
    assert (TransferSettings.from_spec({}).timeout_s, TransferSettings.from_spec({}).stall_s) == (300.0, 60.0)
    with pytest.raises(ValueError):
        TransferSettings(max_source_attempts=0)
    with pytest.raises(ValueError, match="stallSeconds"):
        TransferSettings(stall_s=0)


def test_a_stalled_holder_is_left_for_the_next_without_waiting_for_the_timeout() -> None:
    log: list[tuple] = []
    c = ctx()
    peer = FakePeer(
        log, read_error=lambda name: TransferStalled("no transfer completed") if name == "agent-a" else None
    )
    settings = TransferSettings(timeout_s=300, rpc_timeout_s=2, stall_s=3)
    result = strategy(peer, FakeClient(log), [cand("a"), cand("b")], settings).load(c)
    assert result.source.replica == "b" and result.resident.content_sha256() == SOURCE.content_sha256()
    assert peer.stall_s == 3  # every READ is bounded by the stall limit, not only by the 300 s budget
    assert [(a.source, a.outcome, a.reason) for a in c.attempts] == [
        ("peer/a", "Failed", "TransferStalled"),
        ("peer/b", "Loaded", "Loaded"),
    ]


# ------------------------------------------------------------------- NixlPeer against a fake agent


class Handle:
    def __init__(self, log: list[tuple], kind: str) -> None:
        self.log, self.kind = log, kind

    def release(self) -> None:
        self.log.append(("release", self.kind))


class FakeAgent:
    def __init__(self, states: Sequence[str] = ("DONE",), remove_error: Exception | None = None) -> None:
        self.log: list[tuple] = []
        self.states = list(states)
        self.remove_error = remove_error
        self.descs: dict[str, Any] = {}

    def register_memory(self, regions: Any, mem: str) -> str:
        self.log.append(("register_memory", len(regions), mem))
        return "reg"

    def deregister_memory(self, reg: Any) -> None:
        self.log.append(("deregister_memory",))

    def get_agent_metadata(self) -> bytes:
        return b"md"

    def add_remote_agent(self, blob: bytes) -> bytes:
        return b"src"

    def remove_remote_agent(self, name: str) -> None:
        self.log.append(("remove_remote_agent", name))
        if self.remove_error is not None:
            raise self.remove_error

    def prep_xfer_dlist(self, agent: str, descs: Any, mem: str) -> Handle:
        self.descs[agent] = descs
        self.log.append(("prep", agent, mem))
        return Handle(self.log, "local" if agent == "NIXL_INIT_AGENT" else "remote")

    def make_prepped_xfer(self, op: str, lh: Any, li: Any, rh: Any, ri: Any) -> Handle:
        self.log.append(("make", op, len(li)))
        return Handle(self.log, "xfer")

    def transfer(self, xfer: Any) -> str:
        self.log.append(("post",))
        return self._next()

    def check_xfer_state(self, xfer: Any) -> str:
        return self._next()

    def _next(self) -> str:
        return self.states.pop(0) if len(self.states) > 1 else self.states[0]

    def get_new_notifs(self) -> dict:
        return {}


def target() -> ResidentWeights:
    return ResidentWeights.allocate(SOURCE.manifest, "cpu")


def remote() -> list[RemoteTensor]:
    return describe(SOURCE)


def test_remove_remote_never_raises_and_forgets_the_peer() -> None:
    agent = FakeAgent(remove_error=RuntimeError("NIXL_ERR_NOT_FOUND"))
    peer = NixlPeer("t", agent=agent)
    assert peer.add_remote(b"blob") == "src" and peer.remote_names == {"src"}
    assert peer.remove_remote("src") is False
    assert peer.remote_names == frozenset()
    assert NixlPeer("t", agent=FakeAgent()).remove_remote("never-added") is True


def test_read_pairs_by_name_with_one_prepped_xfer_and_releases_handles() -> None:
    agent = FakeAgent(states=("PROC", "PROC", "DONE"))
    peer = NixlPeer("t", agent=agent)
    local = target()
    peer.register(local)
    started: list[int] = []
    shuffled = list(reversed(remote()))
    moved = peer.read("src", shuffled, local, 5, on_start=started.append)
    assert moved == started[0] == SOURCE.total_bytes
    assert [e for e in agent.log if e[0] == "make"] == [("make", "READ", 2)]  # the empty tensor is skipped
    # Descriptors pair by name whatever the source's order.
    by_addr = {t.addr: t.name for t in remote()}
    local_addrs = {local.tensors[n].data_ptr(): n for n in local.tensors}
    pairs = zip(agent.descs["NIXL_INIT_AGENT"][:, 0], agent.descs["src"][:, 0], strict=True)
    assert all(local_addrs[int(lo)] == by_addr[int(ro)] for lo, ro in pairs)
    assert agent.log.index(("post",)) > agent.log.index(("make", "READ", 2))
    assert [e[1] for e in agent.log if e[0] == "release"] == ["xfer", "local", "remote"]


def test_groups_that_land_as_posted_are_handed_over_before_the_next_is_posted() -> None:
    """A shared-memory READ is done when `transfer` returns: its check then overlaps the next group's copy."""
    agent = FakeAgent(states=("DONE",))
    peer = NixlPeer("t", agent=agent)
    local = target()
    peer.register(local)
    groups = [["layers.0.weight"], ["layers.0.bias"]]
    peer.read_groups("src", remote(), local, groups, 5, on_done=lambda i: agent.log.append(("done", i)))
    assert [e for e in agent.log if e[0] in ("post", "done")] == [("post",), ("done", 0), ("post",), ("done", 1)]


def test_wedged_read_times_out_and_still_releases_the_xfer() -> None:
    agent = FakeAgent(states=("PROC",))
    peer = NixlPeer("t", agent=agent)
    local = target()
    peer.register(local)
    with pytest.raises(TimeoutError, match="still in progress"):
        peer.read("src", remote(), local, 0.05)
    assert [e[1] for e in agent.log if e[0] == "release"] == ["xfer", "local", "remote"]


def test_a_read_that_completes_nothing_for_the_stall_limit_stalls_long_before_its_timeout() -> None:
    agent = FakeAgent(states=("DONE", "PROC"))  # the first group lands, the second never does
    peer = NixlPeer("t", agent=agent)
    local = target()
    peer.register(local)
    done: list[int] = []
    with pytest.raises(TransferStalled, match=r"no transfer completed for 0\.05s"):
        peer.read_groups(
            "src", remote(), local, [["layers.0.weight"], ["layers.0.bias"]], 300, on_done=done.append, stall_s=0.05
        )
    assert done == [0] and [e[1] for e in agent.log if e[0] == "release"] == ["xfer", "xfer", "local", "remote"]


def test_error_state_raises() -> None:
    peer = NixlPeer("t", agent=FakeAgent(states=("PROC", "ERR")))
    local = target()
    peer.register(local)
    with pytest.raises(RuntimeError, match="state ERR"):
        peer.read("src", remote(), local, 5)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda ts: ts[:-1],
        lambda ts: [*ts, RemoteTensor("extra", 1, 4, "torch.float32", (1,), "DRAM", 0)],
        lambda ts: [*ts, ts[0]],
        lambda ts: [
            t
            if t.name != "layers.0.bias"
            else RemoteTensor(t.name, t.addr, t.nbytes, "torch.float16", t.shape, "DRAM", 0)
            for t in ts
        ],
        lambda ts: [
            t if t.name != "layers.0.weight" else RemoteTensor(t.name, t.addr, t.nbytes, t.dtype, (4, 3), "DRAM", 0)
            for t in ts
        ],
    ],
    ids=["missing", "extra", "duplicate", "dtype", "shape"],
)
def test_manifest_mismatch_is_refused_before_any_nixl_call(mutate: Callable[[list[RemoteTensor]], Any]) -> None:
    agent = FakeAgent()
    peer = NixlPeer("t", agent=agent)
    local = target()
    peer.register(local)
    with pytest.raises(ManifestMismatchError):
        peer.read("src", mutate(remote()), local, 5)
    assert [e for e in agent.log if e[0] in ("prep", "make", "post")] == []


def test_read_requires_a_registered_target() -> None:
    with pytest.raises(RuntimeError, match="registered"):
        NixlPeer("t", agent=FakeAgent()).read("src", remote(), target(), 5)


def test_registration_happens_exactly_once_and_shutdown_cleans_up() -> None:
    agent = FakeAgent()
    peer = NixlPeer("t", agent=agent)
    local = target()
    peer.register(local)
    peer.register(local)
    assert [e[0] for e in agent.log].count("register_memory") == 1
    assert agent.log[0] == ("register_memory", 1, "DRAM")  # one pool, one region
    with pytest.raises(RuntimeError, match="another agent"):
        NixlPeer("u", agent=FakeAgent()).register(local)
    peer.add_remote(b"blob")
    peer.shutdown()
    peer.shutdown()
    assert ("remove_remote_agent", "src") in agent.log and ("deregister_memory",) in agent.log
    assert local.registration is None


def test_device_sync_hook() -> None:
    synced: list[torch.device] = []
    NixlPeer("t", agent=FakeAgent(), device_sync=synced.append).synchronize(torch.device("cpu"))
    assert synced == [torch.device("cpu")]


# ------------------------------------------------------------------------------ resident weights


def test_targets_must_be_contiguous_and_are_never_copied() -> None:
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3).t()
    with pytest.raises(ValueError, match="not contiguous"):
        ResidentWeights({"w": t})


def test_manifest_digest_is_canonical() -> None:
    a = ResidentWeights({"x": torch.zeros(2), "y": torch.zeros(3, dtype=torch.int8)})
    b = ResidentWeights({"y": torch.ones(3, dtype=torch.int8), "x": torch.ones(2)})
    assert a.digest == b.digest == manifest_digest(reversed(a.manifest))
    assert len(a.digest) == 64
    assert ResidentWeights({"x": torch.zeros(2, dtype=torch.float16), "y": torch.zeros(3)}).digest != a.digest


def test_allocate_builds_contiguous_views_of_one_pool() -> None:
    t = target()
    assert t.digest == SOURCE.digest and t.tensor_count == 3
    assert all(x.is_contiguous() for x in t.tensors.values())
    assert len(t.storage_regions()) == 1


def test_one_device_per_rank() -> None:
    with pytest.raises(ValueError, match="one device"):
        ResidentWeights({"a": torch.zeros(1), "b": torch.zeros(1, device="meta")})
