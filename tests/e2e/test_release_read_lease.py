"""A peer's read lease on a replica holds the release of the version it reads only while it is held: once the
reader lets go (the replica's activeLeases back at 0) the deleted WeightVersion is released. Real agent, real
reader token, real operator."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from ferry_agent.transport.worker_service import SourceIdentity, prepare_tensor_read
from tests.support.agents import node, reader_tokens, replica, seed_arg, start_agent, wait_phase
from tests.support.objects import apply, get, wait_for, wait_reason, wv_body

pytestmark = pytest.mark.e2e


def test_a_released_read_lease_no_longer_blocks_the_release(cluster, namespace, operator, tmp_path):
    gen = torch.Generator().manual_seed(3)
    seed = tmp_path / "v1.safetensors"
    save_file({"layer.weight": torch.randn((32, 32), generator=gen)}, str(seed))
    node_name = f"{namespace}-n0"
    node(cluster, node_name)
    apply(cluster, namespace, wv_body(namespace, "v1", fmt="PeerOnly"))
    wait_reason(cluster, namespace, "v1", "Ready", "True", "Verified")
    agent = start_agent(cluster, tmp_path, node_name, seed_arg(namespace, "v1", seed))

    def status(kind: str, name: str) -> dict:
        return (get(cluster, namespace, kind, name) or {}).get("status") or {}

    def describe() -> str:
        return json.dumps({"wr": status("wr", "wr-read"), "v1": status("wv", "v1")}, indent=1) + agent.log_tail(20)

    try:
        replica(cluster, namespace, "wr-read", node_name, "v1")  # no ModelLoad desires v1
        entry = wait_phase(cluster, namespace, "wr-read", "Serving", agent)["status"]["ranks"][0]
        lease = prepare_tensor_read(
            entry["grpcEndpoint"],
            SourceIdentity(entry["agentName"]),
            credentials=lambda: reader_tokens(cluster, node_name)(node_name),
        )
        wait_for(lambda: status("wr", "wr-read").get("activeLeases") == 1, 20, "the lease counted", describe)

        cluster.kubectl("delete", "wv", "v1", "-n", namespace, "--wait=false")
        wait_for(
            lambda: status("wv", "v1").get("releaseBlockers") == ["WeightReplica/wr-read"],
            20,
            "v1 blocked by the read lease",
            describe,
        )
        lease.close()
        wait_for(lambda: status("wr", "wr-read").get("activeLeases") == 0, 20, "the lease released", describe)
        wait_for(lambda: get(cluster, namespace, "wv", "v1") is None, 30, "v1 released", describe)
    finally:
        agent.stop()
