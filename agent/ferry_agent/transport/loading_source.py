"""A load that serves while it loads (pipelined fan-out): the rank's target is registered with NIXL and served by a
worker service of its own from the moment it is allocated, and every tensor the load has checked (a peer READ's
adler32, or the S3 stream's check against the version's shard header) becomes readable by peers at once.

The replica publishes the service once, in `status.loadingRanks` (one status write per load, never per chunk:
readers learn what it holds from the service itself, `GetHoldings` and each lease). Readers are admitted exactly as
by a Serving replica (worker tokens, TokenReview, the assignment check of `guard`) and at most `max_readers` at
once. When the load ends, `close` drains the readers and stops the service before the target is sealed and served
as usual (or dropped, when the load failed).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ferry.api.models import RankState
from ferry_agent.store.resident import Allocate, ResidentWeights, TensorSpec
from ferry_agent.transport.holdings import Holdings
from ferry_agent.transport.nixl import NixlPeer
from ferry_agent.transport.worker_auth import ReadGuard
from ferry_agent.transport.worker_service import WorkerServer, serve_resident

log = logging.getLogger(__name__)

DRAIN_S = 5.0  # readers of a loading replica hold a lease for one batch of chunks at most

# What the agent writes into the replica's status: `{"loadingRanks": [...], "loadingVersionUid": ...}`, or None
# to clear them (NOT_LOADING).
Publish = Callable[[dict[str, Any] | None], None]
NOT_LOADING: dict[str, Any] = {"loadingRanks": None, "loadingVersionUid": None}


class LoadingSource:
    """Serves one rank's target while it loads. `allocator(inner)` wraps the strategies' allocate; `verified` marks
    checked tensors; `close()` ends the service."""

    def __init__(
        self,
        peer: NixlPeer,
        *,
        rank: int,
        host: str,
        guard: ReadGuard | None,
        max_readers: int,
        transfer_timeout_s: float,
        version_uid: Callable[[], str | None],
        publish: Publish,
    ) -> None:
        self._peer = peer
        self._rank = rank
        self._host = host
        self._guard = guard
        self._max_readers = max_readers
        self._timeout_s = transfer_timeout_s
        self._version_uid = version_uid
        self._publish = publish
        self._lock = threading.Lock()
        self._serving: tuple[ResidentWeights, WorkerServer, Holdings] | None = None

    def allocator(self, inner: Allocate) -> Allocate:
        def allocate(specs: Sequence[TensorSpec], device: str, share: Any = None) -> ResidentWeights:
            resident = inner(specs, device) if share is None else inner(specs, device, share)
            try:
                self._start(resident, share)
            except Exception as exc:  # the load goes on; it only serves nobody before it is loaded
                log.warning("cannot serve the load of rank %d while it loads: %s", self._rank, exc)
            return resident

        return allocate

    def _start(self, resident: ResidentWeights, share: Any) -> None:
        uid = self._version_uid()
        if uid is None:
            return  # unknown object: no reader could check it is theirs
        holdings = Holdings([s.name for s in resident.manifest])
        base = resident.shared_from
        if resident.shared and base is not None and base.uid:
            holdings.set_base(base.uid, resident.shared)
            if not getattr(share, "checked_later", False):
                # A replay's unchanged tensors: the held version's very bytes, checked when it was loaded.
                holdings.mark({e.name: f"{e.adler32:08x}" for e in base.entries if e.name in resident.shared})
        server = serve_resident(
            resident,
            self._peer,
            rank=self._rank,
            host=self._host,
            transfer_timeout_s=self._timeout_s,
            guard=self._guard,
            holdings=holdings,
            max_readers=self._max_readers,
        )
        with self._lock:
            # A strategy that failed left its target: it is served until the new one is published, so that its
            # readers find this replica again instead of taking it for dead.
            old, self._serving = self._serving, (resident, server, holdings)
        entry = {
            "rank": self._rank,
            "agentName": self._peer.name,
            "grpcEndpoint": server.endpoint,
            "tensorCount": resident.tensor_count,
            "manifestDigest": resident.digest,
            "state": RankState.LOADING,
        }
        self._publish({"loadingRanks": [entry], "loadingVersionUid": uid})
        log.info(
            "rank %d serves its load (%d tensors) at %s while it loads",
            self._rank,
            resident.tensor_count,
            server.endpoint,
        )
        if old is not None:
            self._end(old)

    def verified(self, checksums: Mapping[str, str]) -> None:
        """Tensors of the current target that landed and passed their checks."""
        with self._lock:
            serving = self._serving
        if serving is not None:
            names = serving[2].names
            serving[2].mark({n: c for n, c in checksums.items() if n in names})

    def verified_one(self, name: str, checksum: str) -> None:
        self.verified({name: checksum})

    def close(self) -> None:
        """Stop serving the load (readers drained first) and unpublish it."""
        with self._lock:
            serving, self._serving = self._serving, None
        if serving is None:
            return
        self._end(serving)
        self._publish(None)

    def _end(self, serving: tuple[ResidentWeights, WorkerServer, Holdings]) -> None:
        resident, server, _ = serving
        try:
            server.drain(DRAIN_S)
        except TimeoutError:
            log.warning("readers of the load of rank %d still active after %.0fs; stopping anyway", self._rank, DRAIN_S)
        log.info("rank %d stops serving its load: at most %d readers at once", self._rank, server.leases.peak)
        server.stop()
        self._peer.deregister(resident)
