"""The node agent's reconcile: loads the WeightReplicas assigned to its node, serves them, and retires them.

For each WeightReplica with `spec.nodeName` == this node (`kube.replicas`: the watch, the list, the status writes) it
runs the desired-version cold start (`replica_load.load_rank`: the source order, Peer then ObjectStorage by default,
then a local seed checkpoint when one is configured for that version), publishes every loaded rank as a P2P source in
`status.ranks[]`, and holds the replica's Lease while it serves (`kube.lease`). A one-rank replica loads in this
process; a replica of N ranks runs one `ranks.worker` process per rank (`ranks.supervisor.RankProcesses`), which agree
through a gloo group. A new version loads next to the served one, which is retired only once the new one serves. An
unreachable or failing apiserver costs nothing held: loaded replicas keep serving, status patches are kept and
written when it answers again (`kube.apiretry.StatusOutbox`), and every loop retries with capped backoff. The agent
writes only the WeightReplica `/status` and its Leases.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kubernetes import client

from ferry.api.conditions import now_rfc3339
from ferry.api.models import AttemptOutcome, ReplicaPhase, ReplicaReason, SourceKind
from ferry.errors import LoadFailed
from ferry_agent import metrics
from ferry_agent.attach.memstore import (
    SHMEM_HUGE_PAGES,
    HostStore,
    MemoryBudgetExceeded,
    SealedVersion,
    adopt_rank,
    shmem_huge_pages,
)
from ferry_agent.attach.service import AttachService
from ferry_agent.attach.status import AttachmentPublisher
from ferry_agent.config import AgentConfig
from ferry_agent.kube.apiretry import Backoff, describe, is_transient
from ferry_agent.kube.lease import ReplicaLeases
from ferry_agent.kube.replicas import NodeReplicas
from ferry_agent.kube.sources import ApiSources
from ferry_agent.ranks.agreement import SingleRank
from ferry_agent.ranks.supervisor import RankLaunch, RankPool, RankProcesses, RanksExceedNode, WorkerSettings
from ferry_agent.replica_load import deltas_first, load_rank, loading_source, rank_context, read_guard, serve_rank
from ferry_agent.store.checkpoints import CheckpointStore, model_key
from ferry_agent.store.resident import ResidentWeights
from ferry_agent.strategies.peer import TransferSettings
from ferry_agent.strategies.progress import Progress
from ferry_agent.transport.loading_source import NOT_LOADING
from ferry_agent.transport.nixl import NixlPeer
from ferry_agent.transport.worker_auth import ReaderTokens, WorkerAuth
from ferry_agent.transport.worker_service import WorkerServer

# Progress a load reports in its first seconds is written only then (a stall is diagnosed after many more: the
# ModelLoad's transfer.stallSeconds, 60 by default), so a load that ends sooner writes none of it on its own.
QUIET_START_S = 1.0

log = logging.getLogger("ferry.agent")


class InProcessReplica:
    """A one-rank replica served from the agent's own process; `sealed` when it lives in the host store."""

    def __init__(
        self, resident: ResidentWeights, server: WorkerServer, peer: NixlPeer, sealed: SealedVersion | None = None
    ) -> None:
        self.resident = resident
        self.server = server
        self._peer = peer
        self.sealed = sealed

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
        if self.sealed is not None:  # the replica's hold; attach leases may keep the memory a while longer
            self.sealed.unref()


def report_huge_pages() -> None:
    """Say once whether host memory gets huge pages: the node setting that decides how fast a fresh version lands."""
    mode, huge = shmem_huge_pages()
    metrics.SHMEM_HUGE_PAGES.set(int(huge))
    if huge:
        log.info("host memory chunks get 2 MiB pages (%s is %s)", SHMEM_HUGE_PAGES, mode)
    else:
        log.warning(
            "host memory chunks get 4 KiB pages (%s is %s): a fresh version's pages fault in several times slower "
            "and every engine maps 512x more of them; set it to advise (charts/ferry/README.md, Production nodes)",
            SHMEM_HUGE_PAGES,
            mode or "absent",
        )


@dataclass
class Loaded:
    """A replica that every rank has loaded: what goes into its status, and what serves it."""

    handle: InProcessReplica | RankProcesses
    source: str
    bytes_moved: int
    attempts: list[dict[str, Any]]
    ranks: list[dict[str, Any]]
    version_uid: str | None = None  # of the WeightVersion object the bytes came from (status.versionUid)
    shares: list[SealedVersion] = field(default_factory=list)  # each rank process's sealed memory, adopted


@dataclass
class Served:
    version: str
    handle: InProcessReplica | RankProcesses
    status: dict[str, Any]  # the Serving status it was published with, re-asserted if the object says otherwise
    published_leases: int = 0
    shares: list[SealedVersion] = field(default_factory=list)  # held until the replica stops being served


class NodeAgent:
    """Reconciles the WeightReplicas of `config.node` (`kube.replicas`): loads each one's `spec.version`, serves it
    to peers and to the node's pods, holds its Lease while it serves (`kube.lease`), and retires what it no longer
    should serve."""

    def __init__(
        self,
        api: client.ApiClient,
        config: AgentConfig,
        *,
        store: CheckpointStore | None = None,
        peer_factory: Callable[[str], NixlPeer] = NixlPeer,
        worker_auth: WorkerAuth | None = None,
        worker_tokens: ReaderTokens | None = None,
        attach: AttachService | None = None,
        host: HostStore | None = None,
    ) -> None:
        """`store` is the node's checkpoint store (None: no ObjectStorage strategy). `worker_auth` checks the readers
        of what this agent serves and `worker_tokens` are its own credentials as a reader (`python -m ferry_agent`
        always sets both; None leaves the worker services open). `attach` offers what is served to the pods of this
        node (None: not at all). `host` holds the CPU replicas' bytes (sealed memfd chunks: a one-rank replica's own,
        a multi-rank one's adopted from its rank processes), with the host-memory budget (default: unlimited)."""
        self.node = config.node
        self.agent_name = f"{self.node}-{uuid.uuid4().hex[:8]}"
        self._api = api
        self.replicas = NodeReplicas(client.CustomObjectsApi(api), self.node)
        self.leases = ReplicaLeases(
            client.CoordinationV1Api(api), holder=self.agent_name, node=self.node, lease_seconds=config.lease_seconds
        )
        self._seeds = dict(config.seeds)
        self._poll_seconds = config.poll_seconds
        self._peer = peer_factory(self.agent_name)
        self._served: dict[tuple[str, str], Served] = {}
        # (ns, name) -> (version that failed, attempts, monotonic time of the next try)
        self._failed: dict[tuple[str, str], tuple[str, int, float]] = {}
        self._retry_seconds = config.retry_seconds
        self._bind_address = config.bind_address
        self._store = store
        self._s3_endpoint = config.s3_endpoint
        self._s3_workers = config.s3_download_workers
        self._ambient = config.ambient_credentials
        # Bound on each collective of a multi-rank replica. Followers wait in one while their leader downloads and
        # replays the whole chain, so it is long; a rank that dies is noticed at once by its exit, not by this.
        self._rank_timeout_s = config.rank_timeout_seconds
        self._worker_auth = worker_auth
        self._worker_tokens = worker_tokens
        self._attach = attach
        self._host = host or HostStore()
        self._log_format = config.log_format  # the rank processes log as the agent does
        self._host.on_change = lambda: self._wake.set()  # memory a lease held is freed: republish residentBytes
        # Rank processes for multi-rank replicas, started ahead of their loads and kept between them.
        self._rank_pool = RankPool(
            WorkerSettings(
                self.agent_name,
                config.model_copy(
                    update={
                        "checkpoint_dir": store.root if store else None,
                        "checkpoint_quota_gib": store.quota_bytes / 2**30 if store else config.checkpoint_quota_gib,
                    }
                ),
            ),
            warm=config.warm_ranks,
            wake=lambda: self._wake.set(),
            cap=config.max_rank_processes,
        )
        self._gpus: int | None = None  # CUDA devices this agent sees, counted at the first multi-rank CUDA load
        # status.attachments of each replica, written through the same outbox.
        self._attachments = AttachmentPublisher(attach.server, self._patch_status) if attach is not None else None
        self._stopping = threading.Event()
        self._wake = threading.Event()

    # ------------------------------------------------------------------ loop

    def run(self) -> None:
        log.info("agent %s serving node %s", self.agent_name, self.node)
        report_huge_pages()
        self._rank_pool.maintain(0)  # the warm rank processes start with the agent (and die with this thread)
        args = (self._wake, self._stopping)
        threading.Thread(target=self.replicas.watch, args=args, name="ferry-watch", daemon=True).start()
        if self._attachments is not None:
            self._attachments.start()
        backoff = Backoff()
        while not self._stopping.is_set():
            self._wake.clear()
            # A watch event wakes us at once; the timeout is the resync (retry backoffs, lease counts).
            wait = self._poll_seconds
            try:
                self.reconcile_once()
                backoff.reset()
            except Exception as exc:  # whatever the apiserver (or the network) does, what is served stays served
                wait = backoff.next()
                if is_transient(exc):
                    log.warning("reconcile failed (%s); retrying in %.1fs", describe(exc), wait)
                else:
                    log.exception("reconcile failed; retrying in %.1fs", wait)
            unwritten = self.replicas.outbox.next_try_in()
            if unwritten is not None:
                wait = min(wait, max(0.1, unwritten))
            self._wake.wait(wait)
        self.shutdown()

    def stop(self) -> None:
        self._stopping.set()
        self._wake.set()
        if self._attachments is not None:
            self._attachments.stop()

    def reconcile_once(self) -> None:
        self.replicas.outbox.flush()
        assigned = self.replicas.assigned()
        if self._attachments is not None:  # what the objects say against the leases: a restart's leftovers go
            self._attachments.publish(
                observed={key: wr.get("status") for key, wr in assigned.items() if not self.replicas.pending(key)}
            )
        for key in list(self._served):
            wr = assigned.get(key)
            failure = self._served[key].handle.failure()
            if wr is None:
                self._unserve(key)
            elif failure is not None:  # a rank process died: the replica no longer holds the whole version
                self._fail(
                    key, self._served[key].version, wr["metadata"].get("generation"), ReplicaReason.RANK_EXITED, failure
                )
                self._unserve(key, drain_seconds=0)
        for key, wr in assigned.items():
            served = self._served.get(key)
            if served is not None:
                self._assert_serving(key, served, wr)
                self._publish_lease_count(key, served)
            # A new version is loaded next to the served one, which serves until the new one is (make-before-break).
            wanted = wr["spec"]["version"]
            if (served is None or served.version != wanted) and self._may_try(key, wanted):
                self._load(key, wr)
            self._publish_memory(key, wr)
        # Idle rank processes for the next multi-rank load (a new version loads beside the served one); none for a
        # replica whose ranks this node cannot run.
        self._rank_pool.maintain(
            max(
                (
                    r
                    for wr in assigned.values()
                    if (r := wr["spec"].get("ranks", 1)) > 1 and self._rank_refusal(wr["spec"]) is None
                ),
                default=0,
            )
        )

    def _may_try(self, key: tuple[str, str], version: str) -> bool:
        """A failed load is retried with exponential backoff (a source may appear), at once on a new version."""
        failed = self._failed.get(key)
        return failed is None or failed[0] != version or time.monotonic() >= failed[2]

    # ------------------------------------------------------------------ loading

    def _patch_status(self, key: tuple[str, str], status: dict[str, Any]) -> None:
        """Never raises: what the apiserver does not take now is written by a later pass (in order)."""
        self.replicas.patch_status(key, status)

    def _assert_serving(self, key: tuple[str, str], served: Served, wr: Mapping[str, Any]) -> None:
        """The agent owns the phase: a served replica whose object says otherwise (a write lost to an outage, an
        older operator's `Stale`) is published again, without reloading anything."""
        status = wr.get("status") or {}
        # A failed next version that is no longer wanted (spec is back on the served one) is cleared the same way.
        moot = bool(status.get("loadingVersion")) and wr["spec"]["version"] == served.version
        said = (status.get("phase"), status.get("version")) == (ReplicaPhase.SERVING, served.version)
        if self.replicas.pending(key) or (said and not moot):
            return
        log.info(
            "%s/%s: status says %s %s, but %s is served; publishing it again",
            *key,
            status.get("phase"),
            status.get("version"),
            served.version,
        )
        served.published_leases = served.handle.active_leases()
        self._patch_status(key, {**served.status, "activeLeases": served.published_leases})

    def _load(self, key: tuple[str, str], wr: dict[str, Any]) -> None:
        """Load spec.version. A replica that serves another version keeps serving it (Serving, `version`) while it
        loads this one (`loadingVersion`), and releases it only once this one serves; a failed load leaves it so."""
        namespace, name = key
        spec = wr["spec"]
        version = spec["version"]
        generation = wr["metadata"].get("generation")
        previous = self._served.get(key)
        progress_fields = {
            "startedTime": now_rfc3339(micro=True),
            "completedTime": None,
            "bytesDone": 0,
            "bytesTotal": None,
            "source": None,
            "attempts": [],
            "reason": None,
            "observedGeneration": generation,
            "progress": None,
            "loadingRanks": None,  # a previous agent's, if it died loading
            "loadingVersionUid": None,
        }
        if previous is None:
            start = {
                "phase": ReplicaPhase.LOADING,
                "version": version,
                "servingVersion": None,
                "loadingVersion": None,
                "ranks": None,
                "versionUid": None,
                "message": "",
            }
        else:
            start = {"loadingVersion": version, "message": f"loading {version}; {previous.version} serves meanwhile"}
        self._patch_status(key, {**progress_fields, **start})
        tracked = metrics.LoadProgress(namespace, name)

        quiet_until = time.monotonic() + QUIET_START_S
        completed = threading.Event()

        def quiet_start_over() -> None:
            if not completed.is_set():  # a completion waits for the patch that ends the load
                self.replicas.write_staged(key)

        written_late = threading.Timer(QUIET_START_S, quiet_start_over)
        written_late.daemon = True
        written_late.start()

        def progress(done: int, total: int, source: str) -> None:
            status = dict(bytesDone=done, bytesTotal=total or None, source=source, lastProgressTime=now_rfc3339())
            status["progress"] = tracked.update(done, total)
            if total and done >= total:
                # Every load ends with a Serving or failure patch: a completion goes with it, one status round trip
                # (and one event to every watcher of the namespace's replicas) fewer on the load's path.
                completed.set()
                self.replicas.stage_status(key, status)
            elif time.monotonic() < quiet_until:
                self.replicas.stage_status(key, status)
                if time.monotonic() >= quiet_until:  # the timer may have written what was staged before this
                    quiet_start_over()
            else:
                self._patch_status(key, status)

        noted = [start["message"]]

        def note(message: str) -> None:
            # Once per change: a replica waiting for the first loader says so every poll, and N of them
            # rewriting the same message only load the apiserver and the operator.
            if message != noted[0]:
                noted[0] = message
                self._patch_status(key, {"message": message})

        t0 = time.monotonic()
        try:
            self._check_budget(key, spec)
            self._check_ranks(spec)
            if spec.get("ranks", 1) == 1:
                loaded = self._load_here(namespace, name, spec, progress, note)
            else:
                loaded = self._load_ranks(namespace, name, spec, progress, note)
        except (LoadFailed, MemoryBudgetExceeded, RanksExceedNode) as exc:  # the message names every failure
            metrics.LOADS.labels(source_kind="none", outcome=AttemptOutcome.FAILED).inc()
            attempts = exc.attempts if isinstance(exc, LoadFailed) else []
            refused = exc if isinstance(exc, MemoryBudgetExceeded) else self._host.take_refusal(key)
            if isinstance(exc, RanksExceedNode):
                reason, message = ReplicaReason.RANKS_EXCEED_NODE, f"{version}: {exc}; no rank process was started"
            elif refused is not None:  # every source would need the same memory: that is the reason, not a source
                reason, message = ReplicaReason.MEMORY_BUDGET_EXCEEDED, f"{version} {refused}; nothing was loaded"
            else:
                reason, message = ReplicaReason.LOAD_FAILED, str(exc)
            if previous is None:
                self._fail(key, version, generation, reason, message, attempts)
            else:
                self._fail_next(key, previous, version, reason, message, attempts)
            return
        finally:
            written_late.cancel()
            tracked.close()
        seconds = time.monotonic() - t0
        kind = metrics.source_kind(loaded.source)
        metrics.LOADS.labels(source_kind=kind, outcome=AttemptOutcome.LOADED).inc()
        metrics.BYTES.labels(source_kind=kind).inc(loaded.bytes_moved)
        metrics.LOAD_SECONDS.labels(source_kind=kind).observe(seconds)
        on_ranks = f" on {len(loaded.ranks)} ranks" if len(loaded.ranks) > 1 else ""
        status = {
            "phase": ReplicaPhase.SERVING,
            "version": version,
            "servingVersion": version,
            "loadingVersion": None,
            "source": loaded.source,
            "bytesDone": loaded.bytes_moved,
            "bytesTotal": loaded.bytes_moved,
            "completedTime": now_rfc3339(micro=True),
            "lastProgressTime": now_rfc3339(micro=True),
            "attempts": loaded.attempts,
            "activeLeases": 0,
            "ranks": loaded.ranks,
            "reason": None,
            "versionUid": loaded.version_uid,
            "loadingRanks": None,
            "loadingVersionUid": None,
            "progress": metrics.progress_text(loaded.bytes_moved, loaded.bytes_moved, seconds),
            "message": f"loaded {loaded.bytes_moved} bytes from {loaded.source} in {seconds:.2f}s{on_ranks}",
        }
        if isinstance(loaded.handle, InProcessReplica) or loaded.shares:
            memory = self._memory(key)
            status.update(residentBytes=memory[0], residentVersions=memory[1])
        self._served[key] = Served(version, loaded.handle, status, shares=loaded.shares)
        self._failed.pop(key, None)
        # Lease first, so nobody sees Serving without a live Lease. Neither write failing unloads anything: the
        # renewals retry the Lease and the outbox the status, until the apiserver takes them.
        self.leases.hold(key)
        self._patch_status(key, status)
        log.info(
            "%s/%s serving %s (%d bytes from %s in %.2fs%s)",
            namespace,
            name,
            version,
            loaded.bytes_moved,
            loaded.source,
            seconds,
            on_ranks,
        )
        if previous is not None:
            # Only now, with the new version published in place of the old: readers that picked the old one
            # before the switch finish (the drain), attached pods keep their sealed copy.
            self._retire(key, previous)
        if self._attach is not None:
            # After the status: peers copy the new version meanwhile. Pods follow the offer, not the status, and
            # keep being offered the old version until this replaces it.
            if isinstance(loaded.handle, InProcessReplica):
                self._attach.serve(key, spec, loaded.handle.resident, loaded.version_uid)
            elif loaded.shares:
                self._attach.serve_ranks(key, spec, loaded.shares, loaded.version_uid)

    def _load_here(
        self, namespace: str, name: str, spec: Mapping[str, Any], progress: Progress, note: Callable[[str], None]
    ) -> Loaded:
        """A one-rank replica, in this process: the same cold start as a rank process, over a one-rank group."""
        group = SingleRank()
        ctx = rank_context(group, name, spec)
        label = f"{namespace}/{spec['modelName']}/{spec['version']}"
        sources = ApiSources(self._api, namespace, self._stopping, ambient=self._ambient, s3_endpoint=self._s3_endpoint)

        def held() -> list[SealedVersion]:  # the replica's versions in host memory, which a replay may start from
            return self._host.versions((namespace, name))

        spec = self._deltas_first((namespace, name), spec, sources, held())
        serving = loading_source(
            self._peer,
            ctx,
            auth=self._worker_auth,
            namespace=namespace,
            version=spec["version"],
            spec=spec,
            sources=sources,
            host=self._bind_address,
            publish=lambda fields: self._patch_status((namespace, name), fields or NOT_LOADING),
        )
        try:
            result = load_rank(
                group,
                ctx,
                sources=sources,
                spec=spec,
                configured=spec["version"],
                peer=self._peer,
                store=self._store,
                s3_endpoint=self._s3_endpoint,
                seeds=self._seeds,
                progress=progress,
                note=note,
                credentials=self._worker_tokens,
                allocate=self._host.allocator((namespace, name), label),
                held=held,
                serving=serving,
                download_workers=self._s3_workers,
            )
            serving.close()  # before the seal: no reader may hold the writable pages
            shared_from = getattr(result.resident, "shared_from", None)
            shared = getattr(result.resident, "shared", ())
            # the seal clears them
            base = (shared_from.uid, shared) if shared_from is not None and shared_from.uid and shared else None
            sealed = None
            if result.resident.host is not None:
                # The READ's registration goes first: sealing needs no pinned, writable pages; serving registers the
                # sealed, read-only mapping of the same memory again.
                self._peer.deregister(result.resident)
                sealed = self._host.seal(result.resident, label, ctx.version, ctx.version_uid)
        except Exception as exc:
            raise LoadFailed(str(exc), [a.to_status() for a in ctx.attempts]) from exc
        finally:
            serving.close()
        server, entry = serve_rank(
            result.resident,
            self._peer,
            rank=0,
            host=self._bind_address,
            spec=spec,
            guard=read_guard(self._worker_auth, namespace, ctx),
            base=base,
        )
        handle = InProcessReplica(result.resident, server, self._peer, sealed)
        attempts = [a.to_status() for a in ctx.attempts]
        return Loaded(handle, result.source_label, result.bytes_moved, attempts, [entry], ctx.version_uid)

    def _deltas_first(
        self, key: tuple[str, str], spec: Mapping[str, Any], sources: ApiSources, held: list[SealedVersion]
    ) -> Mapping[str, Any]:
        """`spec` with ObjectStorage before Peer when the replica holds a version of the target's chain and the
        deltas after it are small (`replica_load.deltas_first`): every replica of a rollout then applies them to
        what it holds instead of copying the whole version from the first to load it. Only the default order
        (peers first, then S3) is changed, and only on a CPU replica with a checkpoint store."""
        order = [SourceKind(s) for s in spec.get("sourceOrder") or ()]
        if order != [SourceKind.PEER, SourceKind.OBJECT_STORAGE] or self._store is None or not held:
            return spec
        if spec.get("device", "cpu") != "cpu":
            return spec
        try:
            first = deltas_first(spec["version"], sources.version, held)
        except Exception as exc:  # an optimisation: the load reads the same objects and fails on its own
            log.warning("%s/%s: cannot size the deltas to %s: %s", *key, spec["version"], describe(exc))
            return spec
        if first is None:
            return spec
        version, deltas, total = first
        log.info(
            "%s/%s holds %s: %d bytes of deltas to %s (a %d-byte model) come from object storage before peers",
            *key,
            version,
            deltas,
            spec["version"],
            total,
        )
        return {**spec, "sourceOrder": [SourceKind.OBJECT_STORAGE, SourceKind.PEER]}

    def _check_budget(self, key: tuple[str, str], spec: Mapping[str, Any]) -> None:
        """Refuse, before any byte moves, a CPU version whose recorded size does not fit the host-memory budget (the
        allocation checks again, with what it shares with a version still held)."""
        if self._host.budget_bytes is None or spec.get("device", "cpu") != "cpu":
            return
        try:
            body = ApiSources(self._api, key[0], self._stopping).version(spec["version"])
        except Exception as exc:  # the load itself reads it again, and fails or not on its own
            log.warning("%s/%s: cannot read %s for the budget check: %s", *key, spec["version"], describe(exc))
            return
        total = ((body or {}).get("status") or {}).get("totalBytes")
        if isinstance(total, int) and not self._host.versions(key):
            self._host.check_budget(total)

    def _rank_refusal(self, spec: Mapping[str, Any]) -> str | None:
        """Why this node can never run a multi-rank replica: more ranks than its GPUs (cuda: one rank a GPU) or
        than its cap of rank processes; None if it can (a one-rank replica loads in the agent's own process)."""
        ranks = spec.get("ranks", 1)
        if ranks == 1:
            return None
        if spec.get("device", "cuda") == "cuda":
            if self._gpus is None:
                import torch  # the rank processes import it anyway; the agent only for a multi-rank CUDA replica

                self._gpus = torch.cuda.device_count()
            if ranks > self._gpus:
                return f"ranksPerReplica {ranks} > this node's {self._gpus} GPUs (cuda: a rank a GPU)"
        return self._rank_pool.refusal(ranks)

    def _check_ranks(self, spec: Mapping[str, Any]) -> None:
        """Refuse, before any process starts, a replica this node cannot run, or not beside its other loads now."""
        if (why := self._rank_refusal(spec)) is not None:
            raise RanksExceedNode(why)
        if spec.get("ranks", 1) > 1:
            self._rank_pool.check(spec["ranks"])

    def _load_ranks(
        self, namespace: str, name: str, spec: Mapping[str, Any], progress: Progress, note: Callable[[str], None]
    ) -> Loaded:
        """A multi-rank replica: one process per rank (lent by the pool), which agree on everything in a gloo
        group."""
        settings = TransferSettings.from_spec(spec.get("transfer") or {})
        launch = RankLaunch(
            namespace=namespace,
            replica=name,
            world_size=spec["ranks"],
            version=spec["version"],
            timeout_s=self._rank_timeout_s,
        )
        ranks = RankProcesses(
            launch,
            self._rank_pool,
            progress=progress,
            note=note,
            wake=self._wake.set,
            loading=lambda fields: self._patch_status((namespace, name), fields or NOT_LOADING),
        )
        try:
            ranks.start()
            # Loading may wait for the first loader and then copy or replay: the transfer budget twice, plus slack.
            serving = ranks.wait_loaded(timeout_s=settings.timeout_s * 2 + self._rank_timeout_s)
        except BaseException as exc:
            ranks.stop(drain_s=0)  # no rank may keep its GPU memory, or serve, for a load the agent gave up on
            if self._store is not None:  # a leader killed between prepare and activate left its mark
                self._store.release_prepared(model_key(namespace, spec["modelName"]), spec["version"])
            if isinstance(exc, Exception) and not isinstance(exc, (LoadFailed, RanksExceedNode)):
                raise LoadFailed(f"supervising the rank processes failed: {type(exc).__name__}: {exc}", []) from exc
            raise
        source = ",".join(sorted({e["source"] for e in serving}))  # each rank may copy from a different peer
        entries = [e["entry"] for e in serving]
        uids = {e.get("version_uid") for e in serving}
        uid = uids.pop() if len(uids) == 1 else None  # ranks that disagree serve no uid-checked reader
        shares = self._adopt_shares((namespace, name), spec, ranks, serving, uid)
        return Loaded(ranks, source, sum(e["bytes"] for e in serving), serving[0]["attempts"], entries, uid, shares)

    def _adopt_shares(
        self,
        key: tuple[str, str],
        spec: Mapping[str, Any],
        ranks: RankProcesses,
        serving: list[dict[str, Any]],
        uid: str | None,
    ) -> list[SealedVersion]:
        """Each rank's sealed host memory, held by this agent too (accounting, attach). None when a rank has none
        (a device replica) or it cannot be opened: the ranks still serve peers."""
        if not all(e.get("memory") for e in serving):
            return []
        shares: list[SealedVersion] = []
        try:
            for rank, event in enumerate(serving):
                label = f"{key[0]}/{spec['modelName']}/{spec['version']}#{rank}"
                shares.append(
                    adopt_rank(self._host, key, label, spec["version"], uid, ranks.pid(rank), event["memory"])
                )
        except Exception:
            log.exception("%s/%s: the rank processes' memory cannot be adopted; not offered for attach", *key)
            for share in shares:
                share.unref()
            return []
        return shares

    def _fail(self, key, version, generation, reason: ReplicaReason, message, attempts=None) -> None:
        log.error("%s/%s failed to load %s: %s", *key, version, message)
        self.leases.release(key)
        self._note_failure(key, version)
        self._patch_status(
            key,
            {
                "phase": ReplicaPhase.FAILED,
                "version": version,
                "servingVersion": None,
                "loadingVersion": None,
                "loadingRanks": None,
                "loadingVersionUid": None,
                "reason": str(reason),
                "message": message[:4096],
                "attempts": attempts or [],
                "observedGeneration": generation,
            },
        )

    def _fail_next(
        self,
        key: tuple[str, str],
        served: Served,
        version: str,
        reason: ReplicaReason,
        message: str,
        attempts: list[dict[str, Any]],
    ) -> None:
        """Loading `version` next to the served one failed: the served one stays (its Lease and status too), the
        failure is reported beside it, and the load is retried with backoff like a first load."""
        log.error("%s/%s failed to load %s (still serving %s): %s", *key, version, served.version, message)
        self._note_failure(key, version)
        self._patch_status(
            key,
            {
                "loadingVersion": version,
                "loadingRanks": None,
                "loadingVersionUid": None,
                "reason": str(reason),
                "message": message[:4096],
                "attempts": attempts or [],
            },
        )

    def _note_failure(self, key: tuple[str, str], version: str) -> None:
        previous = self._failed.get(key)
        tries = previous[1] + 1 if previous and previous[0] == version else 1
        delay = min(300.0, self._retry_seconds * 2 ** (tries - 1))
        self._failed[key] = (version, tries, time.monotonic() + delay)

    # ------------------------------------------------------------------ liveness

    def _publish_lease_count(self, key: tuple[str, str], served: Served) -> None:
        """Only on change: the Lease is the heartbeat, the status is not rewritten to say "still here"."""
        count = served.handle.active_leases()
        metrics.READ_LEASES.set(sum(x.handle.active_leases() for x in self._served.values()))
        if count != served.published_leases:
            self._patch_status(key, {"activeLeases": count})
            served.published_leases = count

    def _memory(self, key: tuple[str, str]) -> tuple[int, list[str]]:
        held = self._host.versions(key)
        return self._host.resident_bytes(key), sorted({v.version for v in held})

    def _publish_memory(self, key: tuple[str, str], wr: Mapping[str, Any]) -> None:
        """`residentBytes` and `residentVersions`, when the object says otherwise: a version leased by a pod after the
        replica moved on stays counted until its last lease goes."""
        status = wr.get("status") or {}
        memory = self._memory(key)
        if self.replicas.pending(key) or memory == (
            status.get("residentBytes") or 0,
            status.get("residentVersions") or [],
        ):
            return
        self._patch_status(key, {"residentBytes": memory[0], "residentVersions": memory[1]})

    # ------------------------------------------------------------------ release

    def _unserve(self, key: tuple[str, str], drain_seconds: float = 10.0) -> None:
        """Stop serving: drain the readers, then delete the Lease."""
        served = self._served.pop(key)
        if self._attach is not None:  # no new consumer; the attached ones keep their sealed copy
            self._attach.withdraw(key)
        _stop(served, drain_seconds)
        self.leases.release(key)
        log.info("%s/%s released %s", *key, served.version)

    def _retire(self, key: tuple[str, str], old: Served, drain_seconds: float = 10.0) -> None:
        """Release the version a newer one replaced (already published, Lease kept): drain its readers, stop it."""
        _stop(old, drain_seconds)
        log.info("%s/%s released %s (replaced by %s)", *key, old.version, self._served[key].version)

    def shutdown(self) -> None:
        for key in list(self._served):
            self._unserve(key, drain_seconds=5.0)
        self._rank_pool.shutdown()
        self._peer.shutdown()


def _stop(served: Served, drain_seconds: float) -> None:
    """Drain a served version's readers and stop it, then drop the agent's hold on the rank processes' memory
    (attached pods' leases may keep that longer)."""
    served.handle.stop(drain_seconds)
    for share in served.shares:
        share.unref()
