"""The node agent process: loads the WeightReplicas assigned to its node and serves them to peers.

For each WeightReplica with `spec.nodeName` == this node it runs the desired-version cold start
(`replica_load.load_rank`: the source order, Peer then ObjectStorage by default, then a local seed checkpoint
when one is configured for that version), publishes every loaded rank as a P2P source in `status.ranks[]`,
and keeps a coordination Lease alive. A one-rank replica loads in this process; a replica of N ranks runs one
`rank_worker` process per rank (`rank_group.RankProcesses`), which agree through a gloo group. The agent writes
only the WeightReplica `/status` and its Leases.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from ferry.api.conditions import now_rfc3339
from ferry.api.models import GROUP, VERSION, ReplicaReason
from ferry_agent import metrics
from ferry_agent.checkpoint_store import CheckpointStore, model_key
from ferry_agent.nixl_transfer import NixlPeer
from ferry_agent.peer_strategy import Progress, TransferSettings
from ferry_agent.rank_group import LoadFailed, RankLaunch, RankProcesses
from ferry_agent.ranks import SingleRank
from ferry_agent.registry import (
    DEFAULT_LEASE_SECONDS,
    LABEL_NODE,
    lease_body,
    lease_name,
)
from ferry_agent.replica_load import PLURAL, ApiSources, load_rank, rank_context, serve_rank, source_label
from ferry_agent.resident import ResidentWeights
from ferry_agent.worker_service import WorkerServer

log = logging.getLogger("ferry.agent")


class InProcessReplica:
    """A one-rank replica served from the agent's own process."""

    def __init__(self, resident: ResidentWeights, server: WorkerServer, peer: NixlPeer) -> None:
        self.resident = resident
        self.server = server
        self._peer = peer

    def active_leases(self) -> int:
        return self.server.leases.active_count()

    def failure(self) -> str | None:
        return None

    def stop(self, drain_s: float) -> None:
        try:
            self.server.drain(drain_s)
        except TimeoutError:
            log.warning("readers still active after %.0fs; stopping anyway", drain_s)
        self.server.stop()
        self._peer.deregister(self.resident)


@dataclass
class Loaded:
    """A replica that every rank has loaded: what goes into its status, and what serves it."""

    handle: InProcessReplica | RankProcesses
    source: str
    bytes_moved: int
    attempts: list[dict[str, Any]]
    ranks: list[dict[str, Any]]
    version_uid: str | None = None  # of the WeightVersion object the bytes came from (status.versionUid)


@dataclass
class Served:
    version: str
    handle: InProcessReplica | RankProcesses
    published_leases: int = 0


class NodeAgent:
    def __init__(
        self,
        api: client.ApiClient,
        node: str,
        *,
        seeds: Mapping[str, Path] | None = None,
        lease_seconds: int = DEFAULT_LEASE_SECONDS,
        poll_seconds: float = 1.0,
        retry_seconds: float = 5.0,
        bind_address: str = "127.0.0.1",
        store: CheckpointStore | None = None,
        s3_endpoint: str | None = None,
        peer_factory: Callable[[str], NixlPeer] = NixlPeer,
        rank_timeout_s: float = 3600.0,
    ) -> None:
        self.node = node
        self.agent_name = f"{node}-{uuid.uuid4().hex[:8]}"
        self._api = api
        self._objects = client.CustomObjectsApi(api)
        self._leases = client.CoordinationV1Api(api)
        self._seeds = dict(seeds or {})
        self._lease_seconds = lease_seconds
        self._poll_seconds = poll_seconds
        self._peer = peer_factory(self.agent_name)
        self._served: dict[tuple[str, str], Served] = {}
        # (ns, name) -> (version that failed, attempts, monotonic time of the next try)
        self._failed: dict[tuple[str, str], tuple[str, int, float]] = {}
        self._retry_seconds = retry_seconds
        self._bind_address = bind_address
        self._store = store
        self._s3_endpoint = s3_endpoint
        # Bound on each collective of a multi-rank replica. Followers wait in one while their leader downloads and
        # replays the whole chain, so it is long; a rank that dies is noticed at once by its exit, not by this.
        self._rank_timeout_s = rank_timeout_s
        self._renewing: dict[tuple[str, str], threading.Event] = {}  # replicas whose Lease this agent renews
        self._stopping = threading.Event()
        self._wake = threading.Event()

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        log.info("agent %s serving node %s", self.agent_name, self.node)
        threading.Thread(target=self._watch, name="ferry-watch", daemon=True).start()
        while not self._stopping.is_set():
            self._wake.clear()
            try:
                self.reconcile_once()
            except ApiException as exc:
                log.warning("API error, retrying: %s %s", exc.status, exc.reason)
            # A watch event wakes us at once; the timeout is the resync (retry backoffs, lease counts).
            self._wake.wait(self._poll_seconds)
        self.shutdown()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()

    def _watch(self) -> None:
        """Wake the loop on any change to this node's WeightReplicas."""
        while not self._stopping.is_set():
            try:
                for _event in watch.Watch().stream(
                    self._objects.list_cluster_custom_object, GROUP, VERSION, PLURAL,
                    label_selector=f"{LABEL_NODE}={self.node}", timeout_seconds=300,
                ):  # fmt: skip
                    self._wake.set()
                    if self._stopping.is_set():
                        return
            except Exception as exc:  # a dropped watch only delays us to the next resync
                log.debug("watch ended: %s", exc)
                self._stopping.wait(1.0)

    def reconcile_once(self) -> None:
        listed = self._objects.list_cluster_custom_object(
            GROUP, VERSION, PLURAL, label_selector=f"{LABEL_NODE}={self.node}"
        )
        assigned = {
            (wr["metadata"]["namespace"], wr["metadata"]["name"]): wr
            for wr in listed["items"]
            if wr["spec"]["nodeName"] == self.node and not wr["metadata"].get("deletionTimestamp")
        }
        for key in list(self._served):
            wr = assigned.get(key)
            failure = self._served[key].handle.failure()
            if wr is None:
                self._unserve(key)
            elif wr["spec"]["version"] != self._served[key].version:
                old, new = self._served[key].version, wr["spec"]["version"]
                self._unserve(key, status={"phase": "Loading", "message": f"releasing {old} to load {new}"},
                              keep_lease=True)  # fmt: skip
            elif failure is not None:  # a rank process died: the replica no longer holds the whole version
                self._fail(key, wr["spec"]["version"], wr["metadata"].get("generation"), ReplicaReason.RANK_EXITED,
                           failure)  # fmt: skip
                self._unserve(key, drain_seconds=0)
        for key, wr in assigned.items():
            served = self._served.get(key)
            if served is not None:
                self._publish_lease_count(key, served)
            elif self._may_try(key, wr["spec"]["version"]):
                self._load(key, wr)

    def _may_try(self, key: tuple[str, str], version: str) -> bool:
        """A failed load is retried with exponential backoff (a source may appear), at once on a new version."""
        failed = self._failed.get(key)
        return failed is None or failed[0] != version or time.monotonic() >= failed[2]

    # ------------------------------------------------------------------ loading

    def _patch_status(self, key: tuple[str, str], status: dict[str, Any]) -> None:
        namespace, name = key
        self._objects.patch_namespaced_custom_object_status(GROUP, VERSION, namespace, PLURAL, name, {"status": status})

    def _load(self, key: tuple[str, str], wr: dict[str, Any]) -> None:
        namespace, name = key
        spec = wr["spec"]
        version = spec["version"]
        generation = wr["metadata"].get("generation")
        self._patch_status(
            key,
            {
                "phase": "Loading", "version": version, "startedTime": _micro_now(), "completedTime": None,
                "bytesDone": 0, "bytesTotal": None, "source": None, "attempts": [], "ranks": None, "versionUid": None,
                "reason": None, "message": "", "observedGeneration": generation,
            },
        )  # fmt: skip

        def progress(done: int, total: int, source: str) -> None:
            self._patch_status(
                key,
                {"bytesDone": done, "bytesTotal": total or None, "source": source, "lastProgressTime": now_rfc3339()},
            )

        def note(message: str) -> None:
            self._patch_status(key, {"message": message})

        t0 = time.monotonic()
        try:
            if spec.get("ranks", 1) == 1:
                loaded = self._load_here(namespace, name, spec, progress, note)
            else:
                loaded = self._load_ranks(namespace, name, spec, progress, note)
        except LoadFailed as exc:  # the message names every strategy's (or rank's) failure
            metrics.LOADS.labels(source_kind="none", outcome="Failed").inc()
            self._fail(key, version, generation, ReplicaReason.LOAD_FAILED, str(exc), exc.attempts)
            return
        seconds = time.monotonic() - t0
        kind = metrics.source_kind(loaded.source)
        metrics.LOADS.labels(source_kind=kind, outcome="Loaded").inc()
        metrics.BYTES.labels(source_kind=kind).inc(loaded.bytes_moved)
        metrics.LOAD_SECONDS.labels(source_kind=kind).observe(seconds)
        self._served[key] = Served(version, loaded.handle)
        self._failed.pop(key, None)
        on_ranks = f" on {len(loaded.ranks)} ranks" if len(loaded.ranks) > 1 else ""
        try:
            self._hold_lease(key)
            self._patch_status(
                key,
                {
                    "phase": "Serving", "source": loaded.source, "bytesDone": loaded.bytes_moved,
                    "bytesTotal": loaded.bytes_moved, "completedTime": _micro_now(), "lastProgressTime": _micro_now(),
                    "attempts": loaded.attempts, "activeLeases": 0, "ranks": loaded.ranks,
                    "versionUid": loaded.version_uid,
                    "message": f"loaded {loaded.bytes_moved} bytes from {loaded.source} in {seconds:.2f}s{on_ranks}",
                },
            )  # fmt: skip
        except ApiException:
            # Unpublished weights serve nobody and would never be retried: release them and load again next pass.
            self._unserve(key, drain_seconds=0)
            raise
        log.info("%s/%s serving %s (%d bytes from %s in %.2fs%s)", namespace, name, version, loaded.bytes_moved,
                 loaded.source, seconds, on_ranks)  # fmt: skip

    def _load_here(self, namespace: str, name: str, spec: Mapping[str, Any], progress: Progress,
                   note: Callable[[str], None]) -> Loaded:  # fmt: skip
        """A one-rank replica, in this process: the same cold start as a rank process, over a one-rank group."""
        group = SingleRank()
        ctx = rank_context(group, name, spec)
        try:
            result = load_rank(
                group, ctx, sources=ApiSources(self._api, namespace, self._stopping), spec=spec,
                configured=spec["version"], peer=self._peer, store=self._store, s3_endpoint=self._s3_endpoint,
                seeds=self._seeds, progress=progress, note=note,
            )  # fmt: skip
        except Exception as exc:
            raise LoadFailed(str(exc), [a.to_status() for a in ctx.attempts]) from exc
        server, entry = serve_rank(result.resident, self._peer, rank=0, host=self._bind_address, spec=spec)
        handle = InProcessReplica(result.resident, server, self._peer)
        attempts = [a.to_status() for a in ctx.attempts]
        return Loaded(handle, source_label(result), result.bytes_moved, attempts, [entry], ctx.version_uid)

    def _load_ranks(self, namespace: str, name: str, spec: Mapping[str, Any], progress: Progress,
                    note: Callable[[str], None]) -> Loaded:  # fmt: skip
        """A multi-rank replica: one process per rank, which agree on everything in a gloo group."""
        settings = TransferSettings.from_spec(spec.get("transfer") or {})
        launch = RankLaunch(
            namespace=namespace, replica=name, world_size=spec["ranks"], version=spec["version"],
            agent_name=self.agent_name, bind_address=self._bind_address,
            checkpoint_dir=self._store.root if self._store else None,
            checkpoint_quota_gib=self._store.quota_bytes / 2**30 if self._store else 500.0,
            s3_endpoint=self._s3_endpoint, seeds=self._seeds, timeout_s=self._rank_timeout_s,
        )  # fmt: skip
        ranks = RankProcesses(launch, progress=progress, note=note, wake=self._wake.set)
        try:
            ranks.start()
            # Loading may wait for the first loader and then copy or replay: the transfer budget twice, plus slack.
            serving = ranks.wait_loaded(timeout_s=settings.timeout_s * 2 + self._rank_timeout_s)
        except BaseException as exc:
            ranks.stop(drain_s=0)  # no rank may keep its GPU memory, or serve, for a load the agent gave up on
            if self._store is not None:  # a leader killed between prepare and activate left its mark
                self._store.release_prepared(model_key(namespace, spec["modelName"]), spec["version"])
            if isinstance(exc, Exception) and not isinstance(exc, LoadFailed):
                raise LoadFailed(f"supervising the rank processes failed: {type(exc).__name__}: {exc}", []) from exc
            raise
        source = ",".join(sorted({e["source"] for e in serving}))  # each rank may copy from a different peer
        entries = [e["entry"] for e in serving]
        uids = {e.get("version_uid") for e in serving}
        uid = uids.pop() if len(uids) == 1 else None  # ranks that disagree serve no uid-checked reader
        return Loaded(ranks, source, sum(e["bytes"] for e in serving), serving[0]["attempts"], entries, uid)

    def _fail(self, key, version, generation, reason: ReplicaReason, message, attempts=None) -> None:
        log.error("%s/%s failed to load %s: %s", *key, version, message)
        self._release_lease(key)
        previous = self._failed.get(key)
        tries = previous[1] + 1 if previous and previous[0] == version else 1
        delay = min(300.0, self._retry_seconds * 2 ** (tries - 1))
        self._failed[key] = (version, tries, time.monotonic() + delay)
        self._patch_status(
            key,
            {"phase": "Failed", "version": version, "reason": str(reason), "message": message[:4096],
             "attempts": attempts or [], "observedGeneration": generation},
        )  # fmt: skip

    # ------------------------------------------------------------------ liveness

    def _hold_lease(self, key: tuple[str, str]) -> None:
        """(Re)write the replica's Lease and keep renewing it until `_release_lease`."""
        namespace, name = key
        body = lease_body(name, self.agent_name, _micro_now(), self._lease_seconds)
        try:
            self._leases.create_namespaced_lease(namespace, body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            # Kept across a version change: take it over as it is (a replace would need its resourceVersion).
            self._leases.patch_namespaced_lease(lease_name(name), namespace, {"spec": body["spec"]})
        if key not in self._renewing:
            self._renewing[key] = threading.Event()
            threading.Thread(target=self._renew_lease, args=(key, self._renewing[key]), daemon=True).start()

    def _release_lease(self, key: tuple[str, str]) -> None:
        renewing = self._renewing.pop(key, None)
        if renewing is None:
            return
        renewing.set()
        namespace, name = key
        try:
            self._leases.delete_namespaced_lease(lease_name(name), namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise

    def _renew_lease(self, key: tuple[str, str], stop: threading.Event) -> None:
        namespace, name = key
        while not stop.wait(self._lease_seconds / 3):
            try:
                self._leases.patch_namespaced_lease(
                    lease_name(name),
                    namespace,
                    {"spec": {"renewTime": _micro_now(), "holderIdentity": self.agent_name}},
                )
            except ApiException as exc:
                log.warning("lease renewal for %s/%s failed: %s", namespace, name, exc.reason)

    def _publish_lease_count(self, key: tuple[str, str], served: Served) -> None:
        """Only on change: the Lease is the heartbeat, the status is not rewritten to say "still here"."""
        count = served.handle.active_leases()
        metrics.READ_LEASES.set(sum(x.handle.active_leases() for x in self._served.values()))
        if count != served.published_leases:
            self._patch_status(key, {"activeLeases": count})
            served.published_leases = count

    # ------------------------------------------------------------------ release

    def _unserve(
        self,
        key: tuple[str, str],
        drain_seconds: float = 10.0,
        status: dict[str, Any] | None = None,
        *,
        keep_lease: bool = False,
    ) -> None:
        """Stop serving: `status` first (so that no new reader picks this replica), then drain the readers, then
        delete the Lease, unless `keep_lease` (a version change: the agent stays alive for this replica, and the
        operator, whose view of the status may lag its view of the Lease, must not take it for a dead one)."""
        served = self._served.pop(key)
        if status is not None:
            self._patch_status(key, status)
        served.handle.stop(drain_seconds)
        if not keep_lease:
            self._release_lease(key)
        log.info("%s/%s released %s", *key, served.version)

    def shutdown(self) -> None:
        for key in list(self._served):
            self._unserve(key, drain_seconds=5.0)
        self._peer.shutdown()


def _micro_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
