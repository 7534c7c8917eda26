"""The node agent process: loads the WeightReplicas assigned to its node and serves them to peers.

For each WeightReplica with `spec.nodeName` == this node it runs the strategy chain (Peer, then a local seed
checkpoint when one is configured for that version), publishes the loaded rank as a P2P source in
`status.ranks[]`, and keeps a coordination Lease alive. It writes only the WeightReplica `/status` and its Leases.
"""

from __future__ import annotations

import datetime as dt
import logging
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from ferry.api.conditions import now_rfc3339
from ferry.api.models import GROUP, VERSION
from ferry.storage import credentials_from_secret_data
from ferry_agent import metrics
from ferry_agent.checkpoint_store import CheckpointStore
from ferry_agent.nixl_transfer import NixlPeer
from ferry_agent.peer_strategy import PeerStrategy, TransferSettings
from ferry_agent.registry import (
    DEFAULT_LEASE_SECONDS,
    LABEL_NODE,
    LABEL_VERSION,
    first_loader,
    lease_body,
    lease_name,
    source_candidates,
)
from ferry_agent.resident import ResidentWeights
from ferry_agent.s3_strategy import ObjectStorageStrategy
from ferry_agent.strategy import LoadContext, StrategyFailed, run_strategy_chain
from ferry_agent.worker_service import WorkerServer, serve_resident

log = logging.getLogger("ferry.agent")
PLURAL = "weightreplicas"


@dataclass
class LocalLoad:
    resident: ResidentWeights
    bytes_moved: int
    source: str = "local"


class LocalFileStrategy:
    """Seeds a version from a safetensors file on this node (how the first replica of a PeerOnly version, or a
    node with a pre-staged checkpoint, starts). Available only when a file is configured for the version."""

    name = "LocalFile"

    def __init__(self, seeds: Mapping[str, Path]) -> None:
        self._seeds = seeds

    def is_available(self, ctx: LoadContext) -> bool:
        return ctx.version in self._seeds

    def load(self, ctx: LoadContext) -> LocalLoad:
        from safetensors.torch import load_file

        path = self._seeds[ctx.version]
        try:
            tensors = load_file(str(path), device=ctx.device)
        except (OSError, ValueError) as exc:
            raise StrategyFailed(f"cannot read {path}: {exc}", mutated=False) from exc
        resident = ResidentWeights(tensors)
        return LocalLoad(resident, resident.total_bytes)

    def rollback(self, ctx: LoadContext) -> None:
        """Nothing is held before `load` returns."""


@dataclass
class Served:
    version: str
    resident: ResidentWeights
    server: WorkerServer
    published_leases: int = 0
    stop: threading.Event = field(default_factory=threading.Event)


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
            if wr is None or wr["spec"]["version"] != self._served[key].version:
                self._unserve(key)
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

    def _candidates(self, namespace: str, version: str, self_name: str, wait_s: float) -> Callable[[LoadContext], list]:
        def once(ctx: LoadContext) -> tuple[list, list]:
            replicas = self._objects.list_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, label_selector=f"{LABEL_VERSION}={version}"
            )["items"]
            leases = {
                lease.metadata.name: self._api.sanitize_for_serialization(lease)
                for lease in self._leases.list_namespaced_lease(namespace).items
            }
            found = source_candidates(
                replicas, leases, version=version, rank=ctx.rank, self_replica=self_name, now=dt.datetime.now(dt.UTC)
            )
            return found, replicas

        def listing(ctx: LoadContext) -> list:
            found, replicas = once(ctx)
            deadline = time.monotonic() + wait_s
            # No source yet, but another replica is already fetching this version: wait to copy from it.
            while not found and time.monotonic() < deadline:
                leader = first_loader(replicas, version=version, self_replica=self_name)
                if leader == self_name or self._stopping.is_set():
                    break
                self._patch_status((namespace, self_name), {"message": f"waiting for {leader} to load {version}"})
                time.sleep(0.5)
                found, replicas = once(ctx)
            return found

        return listing

    def _version_reader(self, namespace: str) -> Callable[[str], dict | None]:
        def read(name: str) -> dict | None:
            try:
                return self._objects.get_namespaced_custom_object(GROUP, VERSION, namespace, "weightversions", name)
            except ApiException as exc:
                if exc.status == 404:
                    return None
                raise

        return read

    def _credentials_reader(self, namespace: str) -> Callable[[Mapping], dict[str, str] | None]:
        def read(storage: Mapping) -> dict[str, str] | None:
            secret = storage.get("credentialsSecret")
            if not secret:
                return None  # the agent's own environment (instance role, env vars)
            data = client.CoreV1Api(self._api).read_namespaced_secret(secret, namespace).data
            return credentials_from_secret_data(data)

        return read

    def _load(self, key: tuple[str, str], wr: dict[str, Any]) -> None:
        namespace, name = key
        spec = wr["spec"]
        version = spec["version"]
        generation = wr["metadata"].get("generation")
        if spec.get("ranks", 1) != 1:
            self._fail(key, version, generation, "multi-rank replicas need the rank process group, not yet supported")
            return
        started = _micro_now()
        self._patch_status(
            key,
            {
                "phase": "Loading", "version": version, "startedTime": started, "completedTime": None,
                "bytesDone": 0, "bytesTotal": None, "source": None, "attempts": [], "ranks": None,
                "message": "", "observedGeneration": generation,
            },
        )  # fmt: skip

        def progress(done: int, total: int, source: str) -> None:
            self._patch_status(
                key,
                {"bytesDone": done, "bytesTotal": total or None, "source": source, "lastProgressTime": now_rfc3339()},
            )

        ctx = LoadContext(model=spec["modelName"], version=version, rank=0, target_id=name, device=spec["device"])
        settings = TransferSettings.from_spec(spec.get("transfer") or {})
        strategies = {
            "Peer": PeerStrategy(
                peer=self._peer, candidates=self._candidates(namespace, version, name, settings.timeout_s),
                settings=settings,
                progress=progress,
            ),
        }  # fmt: skip
        if self._store is not None:
            strategies["ObjectStorage"] = ObjectStorageStrategy(
                fetch_version=self._version_reader(namespace), credentials=self._credentials_reader(namespace),
                store=self._store, default_endpoint=self._s3_endpoint, progress=progress,
            )  # fmt: skip
        chain = [strategies[s] for s in spec.get("sourceOrder", ["Peer"]) if s in strategies]
        chain.append(LocalFileStrategy(self._seeds))
        t0 = time.monotonic()
        try:
            result = run_strategy_chain(chain, ctx, reinit=lambda _ctx: None, publish=lambda _r, _c: None)
        except Exception as exc:  # the chain's own summary names every strategy's failure
            metrics.LOADS.labels(source_kind="none", outcome="Failed").inc()
            self._fail(key, version, generation, str(exc), [a.to_status() for a in ctx.attempts])
            return
        seconds = time.monotonic() - t0
        source = result.source.label if hasattr(result.source, "label") else result.source
        kind = metrics.source_kind(source)
        metrics.LOADS.labels(source_kind=kind, outcome="Loaded").inc()
        metrics.BYTES.labels(source_kind=kind).inc(result.bytes_moved)
        metrics.LOAD_SECONDS.labels(source_kind=kind).observe(seconds)
        server = serve_resident(
            result.resident, self._peer, rank=0, host=self._bind_address, transfer_timeout_s=settings.timeout_s
        )
        self._served[key] = Served(version, result.resident, server)
        self._failed.pop(key, None)
        self._ensure_lease(key)
        self._patch_status(
            key,
            {
                "phase": "Serving", "source": source, "bytesDone": result.bytes_moved,
                "bytesTotal": result.bytes_moved, "completedTime": _micro_now(), "lastProgressTime": _micro_now(),
                "attempts": [a.to_status() for a in ctx.attempts], "activeLeases": 0,
                "message": f"loaded {result.bytes_moved} bytes from {source} in {seconds:.2f}s",
                "ranks": [{
                    "rank": 0, "agentName": self._peer.name, "grpcEndpoint": server.endpoint,
                    "metadataEndpoint": "", "tensorCount": len(result.resident.manifest),
                    "manifestDigest": result.resident.digest, "state": "Ready",
                }],
            },
        )  # fmt: skip
        log.info("%s/%s serving %s (%d bytes from %s in %.2fs)", namespace, name, version, result.bytes_moved,
                 source, seconds)  # fmt: skip
        threading.Thread(target=self._renew_lease, args=(key, self._served[key].stop), daemon=True).start()

    def _fail(self, key, version, generation, message, attempts=None) -> None:
        log.error("%s/%s failed to load %s: %s", *key, version, message)
        previous = self._failed.get(key)
        tries = previous[1] + 1 if previous and previous[0] == version else 1
        delay = min(300.0, self._retry_seconds * 2 ** (tries - 1))
        self._failed[key] = (version, tries, time.monotonic() + delay)
        self._patch_status(
            key,
            {"phase": "Failed", "version": version, "message": message[:4096], "attempts": attempts or [],
             "observedGeneration": generation},
        )  # fmt: skip

    # ------------------------------------------------------------------ liveness

    def _ensure_lease(self, key: tuple[str, str]) -> None:
        namespace, name = key
        body = lease_body(name, self.agent_name, _micro_now(), self._lease_seconds)
        try:
            self._leases.create_namespaced_lease(namespace, body)
        except ApiException as exc:
            if exc.status != 409:
                raise
            self._leases.replace_namespaced_lease(lease_name(name), namespace, body)

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
        count = served.server.leases.active_count()
        metrics.READ_LEASES.set(sum(x.server.leases.active_count() for x in self._served.values()))
        if count != served.published_leases:
            self._patch_status(key, {"activeLeases": count})
            served.published_leases = count

    # ------------------------------------------------------------------ release

    def _unserve(self, key: tuple[str, str], drain_seconds: float = 10.0) -> None:
        served = self._served.pop(key)
        served.stop.set()
        try:
            served.server.drain(drain_seconds)
        except TimeoutError:
            log.warning("%s/%s: readers still active after %.0fs; stopping anyway", *key, drain_seconds)
        served.server.stop()
        self._peer.deregister(served.resident)
        namespace, name = key
        try:
            self._leases.delete_namespaced_lease(lease_name(name), namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise
        log.info("%s/%s released %s", namespace, name, served.version)

    def shutdown(self) -> None:
        for key in list(self._served):
            self._unserve(key, drain_seconds=5.0)
        self._peer.shutdown()


def _micro_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
