"""The node agent's side of attach: what it calls when a replica starts or stops being served.

A one-rank CPU replica already lives in sealed memfd chunks of the agent's host store (`memstore.HostStore`): the
offer hands out that very memory, no copy. Tensors elsewhere (a CUDA replica's) are copied into sealed chunks
(`memstore.seal_tensors`). A multi-rank replica's shares live in its rank processes' sealed chunks, which the
agent adopts (`memstore.adopt_rank`): `attach(rank=r)` gets share r, `attach()` all shares as one version.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kubernetes import client

from ferry_agent.attach.memstore import CHUNK_BYTES, HostStore, SealedVersion, combined, seal_tensors, sealed_of
from ferry_agent.attach.pods import PodWatcher
from ferry_agent.attach.publish import TrainerPublishing
from ferry_agent.attach.server import DEFAULT_ATTACH_CONNECTIONS_PER_POD, AttachServer, Offer
from ferry_agent.store.resident import ResidentWeights

log = logging.getLogger("ferry.agent.attach")


class AttachService:
    def __init__(
        self,
        api: client.ApiClient,
        node: str,
        socket_dir: Path,
        *,
        agent_name: str = "",
        chunk_bytes: int = CHUNK_BYTES,
        store: HostStore | None = None,
        max_connections_per_pod: int = DEFAULT_ATTACH_CONNECTIONS_PER_POD,
        publishing: TrainerPublishing | None = None,
    ) -> None:
        self.server = AttachServer(
            socket_dir, agent_name=agent_name, max_connections_per_pod=max_connections_per_pod, publishing=publishing
        )
        self._pods = PodWatcher(api, node, self.server)
        self._chunk_bytes = chunk_bytes
        self._store = store or HostStore()  # the agent's: what a multi-rank offer's combined version is counted in
        # replica -> (version uid, tensor identities) of what it last offered: what the next version's `changed`
        # is relative to (kept after the memory itself is gone, so a refit needs no second copy held).
        self._last: dict[tuple[str, str], tuple[str | None, dict[str, tuple]]] = {}

    def start(self) -> None:
        self.server.start()
        self._pods.start()

    def stop(self) -> None:
        self._pods.stop()
        self.server.stop()

    def serve(
        self, key: tuple[str, str], spec: Mapping[str, Any], resident: ResidentWeights, version_uid: str | None
    ) -> None:
        """Offer a served replica's tensors to the pods of its namespace. Never raises: a version that cannot be
        offered (no memory for the copy) is still served to peers."""
        namespace, _ = key
        label = f"{namespace}/{spec['modelName']}/{spec['version']}"
        try:
            sealed = sealed_of(resident)
            if sealed is not None:
                sealed.ref()  # the offer's hold on the replica's own memory
            else:
                t0 = time.monotonic()
                sealed = seal_tensors(
                    resident.tensors, label, self._chunk_bytes, store=self._store, key=key, version=spec["version"]
                )
                log.info("%s sealed for attach in %.2fs (a copy)", label, time.monotonic() - t0)
        except Exception:
            log.exception("%s cannot be offered for attach", label)
            self.server.withdraw(key)
            return
        self._compare(key, sealed, version_uid)
        offer = Offer(namespace, spec.get("modelLoad", ""), spec["modelName"], spec["version"], version_uid, sealed)
        self.server.offer(key, offer)

    def serve_ranks(
        self, key: tuple[str, str], spec: Mapping[str, Any], shares: Sequence[SealedVersion], version_uid: str | None
    ) -> None:
        """Offer a multi-rank replica: `attach(rank=r)` gets share r, `attach()` all of them. Never raises."""
        namespace, _ = key
        label = f"{namespace}/{spec['modelName']}/{spec['version']}"
        try:
            whole = combined(self._store, label, shares)
        except Exception:
            log.exception("%s cannot be offered for attach", label)
            self.server.withdraw(key)
            return
        for share in shares:
            share.ref()  # the offer's hold on each rank's share
        self._compare(key, whole, version_uid)
        offer = Offer(
            namespace,
            spec.get("modelLoad", ""),
            spec["modelName"],
            spec["version"],
            version_uid,
            whole,
            ranks=list(shares),
        )
        self.server.offer(key, offer)

    def _compare(self, key: tuple[str, str], sealed: SealedVersion, version_uid: str | None) -> None:
        """`changed` against the replica's previous version (by each tensor's sha256)."""
        last = self._last.get(key)
        if last is not None and last[0] != version_uid:
            sealed.base_uid = last[0]
            sealed.changed = frozenset(e.name for e in sealed.entries if last[1].get(e.name) != e.identity())
        self._last[key] = (version_uid, {e.name: e.identity() for e in sealed.entries})

    def withdraw(self, key: tuple[str, str]) -> None:
        self.server.withdraw(key)
