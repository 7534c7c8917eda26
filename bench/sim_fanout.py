"""Fan-out at fleet scale, by simulation: time to all replicas Serving for N cold replicas of one model.

A discrete-event, fluid-rate simulation whose scheduling decisions are the agents' own code, called on simulated
objects: which replicas are sources is `kube.registry.source_candidates` over WeightReplica and Lease dicts as the
agents write them, the order a reader tries them in is the ModelLoad's selector (`strategies.selector`), and who goes
to object storage when no peer has the version is `kube.registry.first_loader`. The rest is modelled:

- links: every node's NIC (each direction), optionally one shared fabric for all peer flows (one host's cores
  and memory, as on the calibration machine), each S3 client's rate and the store's aggregate; each flow gets the
  smallest equal share of the links it crosses (conservative next to max-min fairness);
- a fixed per-request latency (S3: time to first byte; peer: lease, manifest and connection set-up), and per
  replica the time from apply to load start and from the last byte to counted Serving.

Modes
- `s3only`: every replica reads S3 (`sourceOrder: [ObjectStorage]`).
- `whole`: today's agents (`sourceOrder: [Peer, ObjectStorage]`). A replica lists Serving sources; none: the first
  loader reads S3 and the others poll every 0.5 s (up to the transfer timeout, then S3) until it serves; a reader
  copies the whole replica from the first source in selector order (up to `maxSourceAttempts`; a copy that exceeds
  the transfer timeout is abandoned and the next candidate, then S3, is tried) and serves only when it has all of it.
- `whole`: the agents before pipelined fan-out (issue 14), kept as the reference.
- `pipelined`: today's agents. Every decision is the agents' own code: the chunks are `strategies.fanout.plan_chunks`
  of the manifest, the sources a reader lists are `kube.registry.source_candidates` (Serving) plus
  `holder_candidates` (replicas still loading, which publish their worker service once they start), ordered by the
  selector, and at every step the reader takes one lease from the holder `strategies.fanout.choose` names (at most
  `max_readers` leases on a source at once), for every chunk it still needs that the holder has, all posted at
  once; with no Serving source, the first loader (`registry.first_loader`) streams S3 (`s3_inflight` ranged GETs)
  and serves each chunk as it lands. Modelled, not run: the long poll of a waiting reader (it is woken when one of
  its lowest needed chunks lands anywhere or when a busy holder of what it needs frees a slot, and lists the sources
  again every `RELIST_S`), and the NIXL/gRPC costs (`peer_latency_s` per lease).

`python bench/sim_fanout.py` predicts 1 TB and 1 GB to 1,000 nodes at 400 Gb/s beside published figures, and, given
bench/results/modelload.json from `bench_modelload.py --only cold`, fits this machine's rates on the 1- and
3-replica rows and predicts the others beside what was measured. Writes bench/results/sim_fanout.json and .md.
"""

from __future__ import annotations

import argparse
import datetime as dt
import heapq
import itertools
import json
import math
import statistics
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

try:
    from bench._common import RESULTS, write_results
except ImportError:  # run as a script: bench/ is on sys.path, the repository root may not be
    from _common import RESULTS, write_results

from ferry.api.models import RankState, ReplicaPhase, SelectorKind
from ferry_agent.kube.registry import first_loader, holder_candidates, lease_body, source_candidates
from ferry_agent.kube.sources import FIRST_LOADER_POLL_S as PIPELINED_POLL_S
from ferry_agent.strategies.fanout import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_READERS,
    HolderView,
    choose,
    lease_chunks,
    plan_chunks,
)
from ferry_agent.strategies.peer import DEFAULT_MAX_SOURCE_ATTEMPTS, RELIST_S
from ferry_agent.strategies.selector import make_selector
from ferry_agent.transport.worker_service import DEFAULT_TRANSFER_TIMEOUT_S

S3_ONLY, WHOLE, PIPELINED = "s3only", "whole", "pipelined"
MODES = (S3_ONLY, WHOLE, PIPELINED)
FIRST_LOADER_POLL_S = 0.5  # whole: the agents before issue 14 re-listed the sources this often while waiting
UID = "uid-v1"  # the simulated WeightVersion's uid (loading holders publish the uid of what they load)
WAKE_ON = 4  # a blocked reader is woken when one of its lowest this many needed chunks lands anywhere
S3 = -1  # the source index of object storage
MODEL, VERSION = "sim", "v1"
_NOW = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)  # the registry's lease check; the simulated leases are always fresh
GBIT = 1e9 / 8  # bytes per second in one Gb/s


@dataclass(frozen=True)
class Fleet:
    """Rates in Gb/s (1e9 bits); None: unbounded."""

    replicas: int
    model_bytes: int
    nic_gbps: float | None = 400.0  # per node, each direction
    fabric_gbps: float | None = None  # all peer flows together (one host); None: a non-blocking network
    s3_client_gbps: float = 100.0  # one replica's S3 read, all its connections
    s3_total_gbps: float | None = None  # the store, all readers together
    s3_latency_s: float = 0.03  # per request
    peer_latency_s: float = 0.005  # per request (whole: lease + manifest + add_remote; pipelined: per chunk)
    start_s: float = 0.0  # apply → the agent starts the load
    finish_s: float = 0.0  # last byte → counted Serving (status patch, the ModelLoad's count)
    max_readers: int | None = None  # per source at once; None: no limit (the agents before issue 14 had none)
    chunk_bytes: int = DEFAULT_CHUNK_BYTES  # pipelined: spec.transfer.chunkMiB
    tensor_bytes: int = 16 << 20  # pipelined: the manifest's tensors (the last one takes the rest)
    s3_inflight: int = 8  # pipelined: ranged GETs the first loader keeps open (--s3-download-workers)
    selector: str = SelectorKind.RENDEZVOUS_HASH
    timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S  # spec.transfer.timeoutSeconds: the wait and each peer copy
    max_source_attempts: int = DEFAULT_MAX_SOURCE_ATTEMPTS


@dataclass
class Result:
    mode: str
    fleet: Fleet
    serving_s: list[float]  # per replica, when it counted Serving
    received: list[int]  # per replica, bytes of completed transfers into it
    from_s3: list[int]  # per replica, of those the bytes read from S3
    max_readers_seen: int  # the most readers one peer source had at once
    abandoned_bytes: int = 0  # moved by copies that timed out and were dropped
    events: int = 0

    @property
    def all_serving_s(self) -> float:
        return max(self.serving_s)

    @property
    def s3_bytes(self) -> int:
        return sum(self.from_s3)

    def summary(self) -> dict[str, Any]:
        return {
            "mode": self.mode,
            "replicas": self.fleet.replicas,
            "model_bytes": self.fleet.model_bytes,
            "all_serving_s": round(self.all_serving_s, 3),
            "first_serving_s": round(min(self.serving_s), 3),
            "median_serving_s": round(statistics.median(self.serving_s), 3),
            "s3_reads_model_equivalents": round(self.s3_bytes / self.fleet.model_bytes, 3),
            "max_readers_seen": self.max_readers_seen,
            "abandoned_bytes": self.abandoned_bytes,
            "fleet": asdict(self.fleet),
        }


@dataclass(eq=False)
class _Flow:
    src: int
    dst: int
    chunk: int
    size: int
    remaining: float = 0.0
    rate: float = 0.0
    t: float = 0.0
    version: int = 0
    active: bool = False
    done: bool = False
    batch: tuple[int, ...] = ()  # pipelined peer flow: the chunks of one lease (posted at once, sharing the links
    # equally, they land together at its end)


@dataclass
class _Replica:
    name: str
    node: str
    held: set[int] = field(default_factory=set)
    requested: set[int] = field(default_factory=set)  # chunks held or in flight
    inflight: int = 0
    loading: bool = False
    serving: bool = False
    started: float = 0.0
    ordered: list[int] = field(default_factory=list)  # whole: the listing's candidates, selector order
    polling: bool = False
    needed: set[int] = field(default_factory=set)  # pipelined: chunks not held yet
    held_frozen: frozenset[int] = frozenset()  # pipelined: `held`, as the holder views `choose` reads
    lease: list[int] | None = None  # pipelined: [source, chunks of the lease]
    ranked: list[int] | None = None  # pipelined: the holders listed, selector order; None: not listed yet
    listed_at: float = 0.0
    published: bool = False  # pipelined: its worker service is in status.loadingRanks
    s3_loader: bool = False
    next_s3: int = 0  # pipelined, the S3 loader: the next chunk to request
    waits: list[tuple[str, int]] = field(default_factory=list)  # pipelined: where it is registered as blocked
    relist_at: float | None = None
    seen: int = 0  # pipelined: replicas published when it last listed


class Simulation:
    def __init__(self, fleet: Fleet, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"mode {mode!r}: one of {', '.join(MODES)}")
        if fleet.replicas < 1 or fleet.model_bytes < 1:
            raise ValueError("at least one replica and one byte")
        if fleet.nic_gbps is None and fleet.fabric_gbps is None:
            raise ValueError("peer copies need a bound: nic_gbps or fabric_gbps")
        self.fleet, self.mode = fleet, mode
        if mode == PIPELINED:
            whole, rest = divmod(fleet.model_bytes, fleet.tensor_bytes)
            sizes = [fleet.tensor_bytes] * whole + ([rest] if rest else [])
            self.chunk_bytes = [c.nbytes for c in plan_chunks(sizes, fleet.chunk_bytes)]
        else:
            self.chunk_bytes = [fleet.model_bytes]
        self.nchunks = len(self.chunk_bytes)
        width = len(str(fleet.replicas - 1))
        self.reps = [_Replica(f"{MODEL}-{i:0{width}d}", f"node-{i:0{width}d}") for i in range(fleet.replicas)]
        self.index = {r.name: i for i, r in enumerate(self.reps)}
        self.selector = make_selector(fleet.selector)
        self.now = 0.0
        self._heap: list[tuple[float, int, str, Any]] = []
        self._seq = itertools.count()
        self.out: dict[int, set[_Flow]] = defaultdict(set)  # active flows by source
        self.into: dict[int, set[_Flow]] = defaultdict(set)  # active flows by destination
        self.s3_into: dict[int, int] = defaultdict(int)  # active S3 flows by destination
        self.s3_flows: set[_Flow] = set()
        self.peer_flows: set[_Flow] = set()
        self.readers: dict[int, int] = defaultdict(int)  # requests a source serves (latency phase included)
        self.holders: list[set[int]] = [set() for _ in range(self.nchunks)]
        self.waiting: dict[tuple[str, int], set[int]] = defaultdict(set)  # pipelined: ("chunk"|"slot", n) -> readers
        self.published_order: list[int] = []  # pipelined: replicas in the order they published a worker service
        self.relisters: set[int] = set()  # pipelined: blocked readers whose next listing waits for a publish
        self.listers: set[int] = set()  # pipelined: replicas with no source yet, watching for one to publish
        self.pollers: set[int] = set()  # whole: followers waiting for a source
        self.received = [0] * fleet.replicas
        self.from_s3 = [0] * fleet.replicas
        self.serving_s = [math.nan] * fleet.replicas
        self.max_readers_seen = 0
        self.abandoned = 0
        self.events = 0
        self._listing: tuple[list[dict[str, Any]], dict[str, Any]] | None = None

    # -- the agents' own rules, over simulated objects ------------------------------------------------------------

    def _objects(self) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        """WeightReplica and Lease dicts of the fleet as it is now (cached until a replica's state changes)."""
        if self._listing is None:
            now = _NOW.isoformat().replace("+00:00", "Z")
            replicas, leases = [], {}
            for i, r in enumerate(self.reps):
                status: dict[str, Any] = {"phase": ReplicaPhase.LOADING if r.loading else ReplicaPhase.PENDING}
                if r.loading and r.published:
                    status |= {
                        "version": VERSION,
                        "loadingVersionUid": UID,
                        "loadingRanks": [
                            {
                                "rank": 0,
                                "state": RankState.LOADING,
                                "agentName": f"agent-{r.node}",
                                "grpcEndpoint": f"{r.node}:50052",
                            }
                        ],
                    }
                if r.serving:
                    status = {
                        "phase": ReplicaPhase.SERVING,
                        "version": VERSION,
                        "activeLeases": self.readers[i],
                        "ranks": [
                            {
                                "rank": 0,
                                "state": RankState.READY,
                                "agentName": f"agent-{r.node}",
                                "grpcEndpoint": f"{r.node}:50051",
                            }
                        ],
                    }
                    body = lease_body(r.name, f"agent-{r.node}", now, node=r.node)
                    leases[body["metadata"]["name"]] = body
                replicas.append(
                    {"metadata": {"name": r.name}, "spec": {"version": VERSION, "nodeName": r.node}, "status": status}
                )
            self._listing = replicas, leases
        return self._listing

    def _changed(self) -> None:
        self._listing = None

    def _lease_count(self, i: int) -> None:
        """A source's `status.activeLeases` (what the loadAware selector reads), patched in place."""
        if self._listing is not None and self.reps[i].serving:
            self._listing[0][i]["status"]["activeLeases"] = self.readers[i]

    def _serving_sources(self, i: int) -> list[int]:
        """What the Peer strategy would try, in order: `source_candidates`, then the selector."""
        replicas, leases = self._objects()
        found = source_candidates(replicas, leases, version=VERSION, rank=0, self_replica=self.reps[i].name, now=_NOW)
        ordered = self.selector.order(found, model=MODEL, target_id=self.reps[i].name, target_rank=0)
        return [self.index[c.replica] for c in ordered]

    def _is_first_loader(self, i: int) -> bool:
        replicas, _ = self._objects()
        return first_loader(replicas, version=VERSION, self_replica=self.reps[i].name) == self.reps[i].name

    # -- events ---------------------------------------------------------------------------------------------------

    def _push(self, at: float, kind: str, payload: Any) -> None:
        heapq.heappush(self._heap, (at, next(self._seq), kind, payload))

    def run(self) -> Result:
        for i in range(self.fleet.replicas):
            self._push(self.fleet.start_s, "start", i)
        while self._heap:
            self.now, _, kind, payload = heapq.heappop(self._heap)
            self.events += 1
            getattr(self, f"_on_{kind}")(payload)
        if any(math.isnan(t) for t in self.serving_s):
            raise RuntimeError(f"{self.mode}: not every replica served (a scheduling deadlock)")
        return Result(
            self.mode,
            self.fleet,
            self.serving_s,
            self.received,
            self.from_s3,
            self.max_readers_seen,
            self.abandoned,
            self.events,
        )

    def _on_start(self, i: int) -> None:
        r = self.reps[i]
        r.loading, r.started = True, self.now
        self._changed()
        self._schedule(i)

    def _on_poll(self, i: int) -> None:
        if self.reps[i].polling:  # else an earlier tick served it
            self.reps[i].polling = False
            self.pollers.discard(i)
            self.listers.discard(i)
            self._schedule(i)

    def _on_begin(self, f: _Flow) -> None:
        """The request's latency is over: bytes flow."""
        if f.done:
            return
        f.active, f.t, f.remaining = True, self.now, float(f.size)
        self.out[f.src].add(f)
        self.into[f.dst].add(f)
        if f.src == S3:
            self.s3_into[f.dst] += 1
            self.s3_flows.add(f)
        else:
            self.peer_flows.add(f)
        self._rerate(f)

    def _on_end(self, item: tuple[_Flow, int]) -> None:
        f, version = item
        if f.done or version != f.version:
            return
        self._finish(f)
        dst = self.reps[f.dst]
        dst.inflight -= 1
        self.received[f.dst] += f.size
        if f.src == S3:
            self.from_s3[f.dst] += f.size
        if self.mode == PIPELINED:
            self._landed(f)
            return
        dst.held.add(f.chunk)
        self.holders[f.chunk].add(f.dst)
        if len(dst.held) == self.nchunks:
            self._push(self.now + self.fleet.finish_s, "serving", f.dst)
        self._freed(f.src)

    def _on_timeout(self, f: _Flow) -> None:
        """Whole mode: the copy took longer than the transfer timeout; the target is dropped (its bytes are lost)
        and the strategy goes on to its next candidate, then S3."""
        if f.done:
            return
        if f.active:
            self.abandoned += int(f.size - f.remaining - f.rate * (self.now - f.t))
        self._finish(f)
        self.reps[f.dst].inflight -= 1
        self.reps[f.dst].requested.discard(f.chunk)
        self._freed(f.src)
        self._attempt(f.dst)

    def _on_serving(self, i: int) -> None:
        r = self.reps[i]
        r.loading, r.serving = False, True
        self.serving_s[i] = self.now
        self._changed()
        if self.mode == WHOLE:  # a new source: the followers see it at their next poll
            for j in self.pollers:
                self._push(self._next_tick(j), "poll", j)

    # -- scheduling -----------------------------------------------------------------------------------------------

    def _schedule(self, i: int) -> None:
        r = self.reps[i]
        if self.mode == S3_ONLY:
            if not r.requested:
                self._request(S3, i, 0)
        elif self.mode == WHOLE:
            if not r.requested:
                self._list_whole(i)
        else:
            self._schedule_chunks(i)

    def _list_whole(self, i: int) -> None:
        """The Peer strategy's listing: sources, or wait for the first loader, or (its turn, or after the wait) S3."""
        r, limit = self.reps[i], self.fleet.max_readers
        found = self._serving_sources(i)
        if found and limit is not None and all(self.readers[j] >= limit for j in found):
            self._poll_later(i)  # (a reader limit is not today's policy) every source is full: wait for a slot
        elif found:
            r.ordered = found[: self.fleet.max_source_attempts]
            self._attempt(i)
        elif self._is_first_loader(i) or self.now - r.started >= self.fleet.timeout_s:
            self._request(S3, i, 0)
        else:
            self._poll_later(i)

    def _attempt(self, i: int) -> None:
        """The next candidate of the listing (skipping any at the reader limit), else ObjectStorage."""
        r, limit = self.reps[i], self.fleet.max_readers
        while r.ordered:
            j = r.ordered.pop(0)
            if limit is None or self.readers[j] < limit:
                flow = self._request(j, i, 0)
                self._push(self.now + self.fleet.timeout_s, "timeout", flow)
                return
        self._request(S3, i, 0)

    # -- pipelined: the agents' PeerStrategy loop over `fanout.choose` ----------------------------------------------

    def _schedule_chunks(self, i: int) -> None:
        r = self.reps[i]
        if r.lease is not None or r.s3_loader or r.serving or (r.ranked is not None and not r.needed):
            return
        if r.ranked is None:
            self._list_pipelined(i)
            if r.ranked is None:
                return
        most = lease_chunks(self.fleet.chunk_bytes)
        pick = choose(sorted(r.needed), self._ranked(r), most)
        if pick is None and self.now - r.listed_at >= RELIST_S:
            self._relist(i)
            pick = choose(sorted(r.needed), self._ranked(r), most)
        if pick is None:
            self._block(i)
            return
        src, batch = int(pick[0]), pick[1]
        if not r.published:  # the first lease gave it its manifest: its target, served from now on
            self._publish(i)
        self.readers[src] += 1
        self.max_readers_seen = max(self.max_readers_seen, self.readers[src])
        r.lease = [src, len(batch)]
        r.requested.update(batch)
        r.inflight += 1
        size = sum(self.chunk_bytes[c] for c in batch)
        self._push(self.now + self.fleet.peer_latency_s, "begin", _Flow(src, i, batch[0], size, batch=tuple(batch)))

    def _list_pipelined(self, i: int) -> None:
        """The Peer strategy's listing: Serving sources and loading holders, or (the first loader, with no Serving
        source) S3, or nothing yet: list again after the poll interval."""
        r = self.reps[i]
        replicas, leases = self._objects()
        serving = source_candidates(replicas, leases, version=VERSION, rank=0, self_replica=r.name, now=_NOW)
        if not serving and first_loader(replicas, version=VERSION, self_replica=r.name) == r.name:
            r.s3_loader = True
            r.needed = set(range(self.nchunks))
            self._publish(i)
            for _ in range(min(self.fleet.s3_inflight, self.nchunks)):
                self._next_s3(i)
            return
        found = serving + holder_candidates(replicas, version=VERSION, rank=0, self_replica=r.name, version_uid=UID)
        if not found:  # the agent watches its model's replicas: it lists again when one publishes, or after the bound
            self._push(self.now + PIPELINED_POLL_S, "poll", i)
            self.listers.add(i)
            r.polling = True
            return
        r.ranked = [self.index[c.replica] for c in self._order(found, r)]
        r.needed = set(range(self.nchunks))
        r.listed_at, r.seen = self.now, len(self.published_order)

    def _publish(self, i: int) -> None:
        self.reps[i].published = True
        self.published_order.append(i)
        self._changed()
        for j in self.relisters:
            r = self.reps[j]
            if r.relist_at is None:
                r.relist_at = max(self.now, r.listed_at + RELIST_S)
                self._push(r.relist_at, "relist", j)
        self.relisters.clear()
        for j in self.listers:
            self._push(self.now, "poll", j)
        self.listers.clear()

    def _relist(self, i: int) -> None:
        """List again: the replicas that published a worker service since (every holder is one: Serving ones were
        loading holders first), through `holder_candidates` over their objects."""
        r = self.reps[i]
        assert r.ranked is not None
        replicas, _ = self._objects()
        new = [replicas[j] for j in self.published_order[r.seen :] if self.reps[j].loading]
        found = holder_candidates(new, version=VERSION, rank=0, self_replica=r.name, version_uid=UID)
        r.ranked += [self.index[c.replica] for c in self._order(found, r)]
        r.listed_at, r.seen = self.now, len(self.published_order)

    def _ranked(self, r: _Replica) -> list[HolderView]:
        """The reader's holders in its selector order as `fanout.choose` reads them; those that are busy or hold
        nothing it needs are left out, which changes nothing `choose` decides."""
        limit, needed = self.fleet.max_readers, r.needed
        assert r.ranked is not None
        return [
            HolderView(str(j), self.reps[j].held_frozen)
            for j in r.ranked
            if (limit is None or self.readers[j] < limit) and not self.reps[j].held_frozen.isdisjoint(needed)
        ]

    def _order(self, found: list, r: _Replica) -> list:
        return self.selector.order(found, model=MODEL, target_id=r.name, target_rank=0)

    def _next_s3(self, i: int) -> None:
        r = self.reps[i]
        if r.next_s3 < self.nchunks:
            r.requested.add(r.next_s3)
            self._request(S3, i, r.next_s3)
            r.next_s3 += 1

    def _block(self, i: int) -> None:
        """Wait: for one of its lowest needed chunks to land anywhere, for a busy holder of what it needs to free a
        slot, and for the next listing."""
        r = self.reps[i]
        assert r.ranked is not None
        keys = [("chunk", c) for c in sorted(r.needed)[:WAKE_ON]]
        limit = self.fleet.max_readers
        if limit is not None:
            busy = (
                j for j in r.ranked if self.readers[j] >= limit and not self.reps[j].held_frozen.isdisjoint(r.needed)
            )
            keys += [("slot", j) for j in itertools.islice(busy, WAKE_ON)]
        for key in keys:
            self.waiting[key].add(i)
        r.waits = keys
        if r.relist_at is None:
            r.relist_at = max(self.now, r.listed_at + RELIST_S)
            self._push(r.relist_at, "relist", i)

    def _on_relist(self, i: int) -> None:
        r = self.reps[i]
        r.relist_at = None
        if len(self.published_order) > r.seen:
            self._unblock(i)
        elif r.waits:  # a listing would find nothing new: the next one is due once someone publishes
            self.relisters.add(i)

    def _unblock(self, i: int) -> None:
        r = self.reps[i]
        for key in r.waits:
            self.waiting[key].discard(i)
        r.waits = []
        self._schedule_chunks(i)

    def _wake(self, key: tuple[str, int]) -> None:
        for i in list(self.waiting.pop(key, ())):
            self._unblock(i)

    def _landed(self, f: _Flow) -> None:
        """Chunks landed and passed their checks: held (and served on) at once."""
        r = self.reps[f.dst]
        landed = f.batch or (f.chunk,)
        for chunk in landed:
            r.held.add(chunk)
            self.holders[chunk].add(f.dst)
        r.needed.difference_update(landed)
        r.held_frozen = frozenset(r.held)
        if f.src == S3:
            self._next_s3(f.dst)
        else:  # the lease's READs are all in: released
            r.lease = None
            self.readers[f.src] -= 1
            self._lease_count(f.src)
            self._wake(("slot", f.src))
        if not r.needed:
            self._push(self.now + self.fleet.finish_s, "serving", f.dst)
        for chunk in landed:
            self._wake(("chunk", chunk))
        self._schedule_chunks(f.dst)

    def _request(self, src: int, dst: int, chunk: int) -> _Flow:
        """Whole and S3: one request of `chunk` (the whole model, or a chunk from S3)."""
        f = _Flow(src, dst, chunk, self.chunk_bytes[chunk])
        self.reps[dst].requested.add(chunk)
        self.reps[dst].inflight += 1
        if src != S3:
            self.readers[src] += 1
            self.max_readers_seen = max(self.max_readers_seen, self.readers[src])
            self._lease_count(src)
        latency = self.fleet.s3_latency_s if src == S3 else self.fleet.peer_latency_s
        self._push(self.now + latency, "begin", f)
        return f

    def _freed(self, src: int) -> None:
        """A source's request ended."""
        if src != S3:
            self.readers[src] -= 1
            self._lease_count(src)

    def _poll_later(self, i: int) -> None:
        """Wait for the next poll tick that can list something new: the next one after a replica turns Serving,
        or the one at the end of the wait (ticks in between would see the same objects, so they are skipped)."""
        r = self.reps[i]
        r.polling = True
        self.pollers.add(i)
        deadline = max(self.now + 1e-9, r.started + self.fleet.timeout_s)
        self._push(self._next_tick(i, deadline), "poll", i)

    def _next_tick(self, i: int, at: float | None = None) -> float:
        """The first poll of replica `i` after `at` (default: now): the agent re-lists every 0.5 s from its start."""
        r, at = self.reps[i], self.now + 1e-9 if at is None else at
        return r.started + math.ceil((at - r.started) / FIRST_LOADER_POLL_S - 1e-9) * FIRST_LOADER_POLL_S

    # -- rates ----------------------------------------------------------------------------------------------------

    def _finish(self, f: _Flow) -> None:
        f.done = True
        if not f.active:  # still in its request latency: its begin event finds it done
            return
        self.out[f.src].discard(f)
        self.into[f.dst].discard(f)
        if f.src == S3:
            self.s3_into[f.dst] -= 1
            self.s3_flows.discard(f)
        else:
            self.peer_flows.discard(f)
        self._rerate(f)

    def _rate(self, f: _Flow) -> float:
        fl, rate = self.fleet, math.inf
        if f.src == S3:
            rate = fl.s3_client_gbps * GBIT / self.s3_into[f.dst]
            if fl.s3_total_gbps is not None:
                rate = min(rate, fl.s3_total_gbps * GBIT / len(self.s3_flows))
        else:
            if fl.nic_gbps is not None:
                rate = min(rate, fl.nic_gbps * GBIT / len(self.out[f.src]))
            if fl.fabric_gbps is not None:
                rate = min(rate, fl.fabric_gbps * GBIT / len(self.peer_flows))
        if fl.nic_gbps is not None:
            rate = min(rate, fl.nic_gbps * GBIT / len(self.into[f.dst]))
        return rate

    def _rerate(self, changed: _Flow) -> None:
        """New shares for the flows that cross a link whose flow count just changed."""
        affected = set(self.into[changed.dst])
        if changed.src == S3:
            if self.fleet.s3_total_gbps is not None:
                affected |= self.s3_flows
        else:
            affected |= self.out[changed.src]
            if self.fleet.fabric_gbps is not None:
                affected |= self.peer_flows
        for f in affected:
            f.remaining = max(0.0, f.remaining - f.rate * (self.now - f.t))
            f.t = self.now
            f.rate = self._rate(f)
            f.version += 1
            self._push(self.now + f.remaining / f.rate, "end", (f, f.version))


def simulate(fleet: Fleet, mode: str) -> Result:
    return Simulation(fleet, mode).run()


# -- the report ---------------------------------------------------------------------------------------------------

PUBLISHED = [  # quoted from the projects' own write-ups; not measured here, and on their hardware
    {"system": "Dragonfly (P2P distribution, quoted)", "what": "1 GB to 990 nodes", "seconds": 28.5},
    {"system": "checkpoint-engine (quoted)", "what": "1T parameters to 256 GPUs", "seconds": 16.0},
]
# What a 1,000-node fleet's store is assumed to give (labelled in the output): one client 100 Gb/s with many ranged
# GETs, the bucket 1 Tb/s in all, 30 ms to first byte.
FLEET_S3 = {"s3_client_gbps": 100.0, "s3_total_gbps": 1000.0, "s3_latency_s": 0.03}
UNBOUNDED_S = 1e9  # a transfer timeout nothing reaches


# The 1 TB model in 1 GiB tensors and 32 GiB chunks (30 chunks: a 16 MiB chunk would be 60,000 of them, more events
# than this simulation runs in minutes); 1 GB in the agents' defaults (16 MiB tensors and chunks: 60 chunks).
SIZES = (("1 TB", 10**12, 1 << 30, 32 << 30), ("1 GB", 10**9, 16 << 20, DEFAULT_CHUNK_BYTES))


def scenarios(replicas: int, readers: int) -> list[tuple[str, Fleet, str]]:
    rows = []
    for label, size, tensor, chunk in SIZES:
        base = Fleet(replicas=replicas, model_bytes=size, nic_gbps=400.0, **FLEET_S3)  # type: ignore[arg-type]
        rows += [
            (label, base, S3_ONLY),
            (label, base, WHOLE),
            (label, replace(base, timeout_s=UNBOUNDED_S), WHOLE),
            (label, replace(base, max_readers=readers, tensor_bytes=tensor, chunk_bytes=chunk), PIPELINED),
        ]
    return rows


def describe(mode: str, fleet: Fleet) -> str:
    if mode == S3_ONLY:
        return "today, S3 only"
    if mode == WHOLE:
        timeout = "no timeout" if fleet.timeout_s >= UNBOUNDED_S else f"timeoutSeconds {fleet.timeout_s:g}"
        return f"before issue 14, peers first: whole copies ({timeout})"
    chunks = -(-fleet.model_bytes // fleet.chunk_bytes)
    return f"today: pipelined, ~{chunks} chunks of {fleet.chunk_bytes >> 20} MiB, ≤{fleet.max_readers} readers a source"


def calibrate(cold: Sequence[dict[str, Any]], size_bytes: int) -> tuple[Fleet, dict[str, float]]:
    """This machine's rates from the 1- and 3-replica rows of bench_modelload (1 rank): the agents' start and finish
    overheads (medians), one S3 load's rate (1 replica, S3 only), the store's aggregate (3 replicas, S3 only) and
    the host's aggregate for peer copies (3 replicas, peers first: the two copies' bytes over the time from the
    first one's start to the last one's end). All agents share one host, so peer copies share one fabric and no NIC
    limit applies."""
    rows = {(r["replicas"], r["source_order"]): r for r in cold if r.get("ranks", 1) == 1 and r.get("loads")}
    peer, s3only = "Peer+ObjectStorage", "ObjectStorage"
    start_s = statistics.median(x["started_s"] for r in rows.values() for x in r["loads"])
    finish_s = statistics.median(
        r["seconds_to_ready"] - max(x["completed_s"] for x in r["loads"]) for r in rows.values()
    )
    one = rows[(1, s3only)]["loads"][0]
    s3_client = size_bytes / (one["completed_s"] - one["started_s"])
    three = rows[(3, s3only)]["loads"]
    s3_total = 3 * size_bytes / (max(x["completed_s"] for x in three) - min(x["started_s"] for x in three))
    copies = [x for x in rows[(3, peer)]["loads"] if x["source"].startswith("peer/")]
    span = max(x["completed_s"] for x in copies) - min(x["started_s"] for x in copies)
    fabric = len(copies) * size_bytes / max(span, 1e-3)
    gbit = {"s3_client_gbps": s3_client / GBIT, "s3_total_gbps": s3_total / GBIT, "fabric_gbps": fabric / GBIT}
    fleet = Fleet(
        replicas=1,
        model_bytes=size_bytes,
        nic_gbps=None,
        s3_latency_s=0.0,
        peer_latency_s=0.0,
        start_s=start_s,
        finish_s=finish_s,
        **gbit,
    )
    return fleet, {"start_s": start_s, "finish_s": finish_s, **gbit}


def check_against(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    data = json.loads(path.read_text())
    size = data.get("size_mib", 0) << 20
    cold = [r for r in data.get("cold", []) if r.get("ranks", 1) == 1]
    if not size or not cold:
        return None
    fleet, fitted = calibrate(cold, size)
    fleet = replace(fleet, max_readers=DEFAULT_MAX_READERS, tensor_bytes=data.get("tensor_bytes", 4 << 20))
    rows = []
    for r in cold:
        mode = PIPELINED if r["source_order"].startswith("Peer") else S3_ONLY
        predicted = simulate(replace(fleet, replicas=r["replicas"]), mode)
        rows.append(
            {
                "replicas": r["replicas"],
                "mode": mode,
                "measured_s": r["seconds_to_ready"],
                "predicted_s": round(predicted.all_serving_s, 2),
                "fitted_on": r["replicas"] in (1, 3),
            }
        )
    return {"source": str(path), "size_mib": data["size_mib"], "fitted": fitted, "rows": rows}


def markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Fan-out by simulation (bench/sim_fanout.py)",
        "",
        f"{report['replicas']} replicas, 400 Gb/s NICs; S3 assumed: one client {FLEET_S3['s3_client_gbps']:g} Gb/s, "
        f"the store {FLEET_S3['s3_total_gbps']:g} Gb/s in all, {FLEET_S3['s3_latency_s'] * 1000:g} ms a request. "
        "Source lists, selector order and the first-loader rule are the agents' code.",
        "",
        "| model | policy | all Serving s | median s | S3 reads (models) | most readers on one source | bytes dropped "
        "(timeouts, models) |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in report["predictions"]:
        lines.append(
            f"| {r['model']} | {r['policy']} | {r['all_serving_s']:.1f} | {r['median_serving_s']:.1f} "
            f"| {r['s3_reads_model_equivalents']:g} | {r['max_readers_seen']} "
            f"| {r['abandoned_bytes'] / r['model_bytes']:.1f} |"
        )
    lines += ["", "Published figures, quoted (other systems, other hardware; not measured here):", ""]
    lines += [f"- {p['system']}: {p['what']} in {p['seconds']:g} s" for p in PUBLISHED]
    check = report.get("check")
    if check:
        fit = check["fitted"]
        lines += [
            "",
            f"## Against this machine ({check['source']}, {check['size_mib']} MiB, 1 rank)",
            "",
            f"Fitted on the 1- and 3-replica rows: apply → load start {fit['start_s']:.2f} s, last byte → Ready "
            f"{fit['finish_s']:.2f} s, one S3 load {fit['s3_client_gbps'] / 8:.2f} GB/s, the store "
            f"{fit['s3_total_gbps'] / 8:.2f} GB/s in all, peer copies {fit['fabric_gbps'] / 8:.2f} GB/s in all "
            "(one host). The other rows are predictions.",
            "",
            "| replicas | policy | measured s to Ready | predicted s | predicted / measured | |",
            "|---:|---|---:|---:|---:|---|",
        ]
        for r in check["rows"]:
            lines.append(
                f"| {r['replicas']} | {'peers first' if r['mode'] == PIPELINED else 'S3 only'} | {r['measured_s']:.2f} "
                f"| {r['predicted_s']:.2f} | {r['predicted_s'] / r['measured_s']:.2f} "
                f"| {'fitted' if r['fitted_on'] else 'predicted'} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=1000)
    parser.add_argument("--max-readers", type=int, default=DEFAULT_MAX_READERS, help="pipelined: maxReadersPerSource")
    parser.add_argument("--modelload", type=Path, default=RESULTS / "modelload.json", help="bench_modelload's result")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--modes", default=",".join(MODES), help="of the fleet predictions (whole takes minutes a row at 1,000)"
    )
    args = parser.parse_args(argv)
    predictions = []
    modes = set(args.modes.split(","))
    for label, fleet, mode in (row for row in scenarios(args.replicas, args.max_readers) if row[2] in modes):
        result = simulate(fleet, mode)
        predictions.append({"model": label, "policy": describe(mode, fleet), **result.summary()})
        print(json.dumps({k: v for k, v in predictions[-1].items() if k != "fleet"}), flush=True)
    report = {
        "replicas": args.replicas,
        "predictions": predictions,
        "published": PUBLISHED,
        "check": check_against(args.modelload),
    }
    write_results("sim_fanout", report, markdown(report), args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
