"""The seam between the P2P core and the agent's Kubernetes wiring: one source rank a target may read from.

The wiring builds these from Serving WeightReplicas of the exact version (same rank, live lease),
`status.ranks[]` and `status.activeLeases`, and from replicas still loading it (`status.loadingRanks[]`), which
serve the tensors they hold so far (pipelined fan-out).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SourceCandidate:
    replica: str  # WeightReplica name
    rank: int
    agent_name: str  # NIXL agent name, unique per source process
    grpc_endpoint: str  # host:port of that rank's Worker service
    metadata: str | bytes = ""  # NIXL metadata endpoint or blob, as published; the manifest carries the blob
    tensor_count: int = 0  # 0: unknown
    manifest_digest: str = ""  # "": unknown
    active_leases: int | None = None  # None: unknown (the loadAware selector assumes a middling load)
    instance_id: str = ""  # optional process id checked by the source on every call
    node: str = ""  # the source's node (`spec.nodeName`): the reader's token for it has that node's audience
    loading: bool = False  # a replica still loading the version, serving the tensors it holds (`status.loadingRanks`)

    @property
    def label(self) -> str:
        """The `status.attempts[].source` / `status.source` value."""
        return f"peer/{self.replica}"
