"""Multi-rank attach through a real agent: a two-rank replica (one rank process each, seeded from a local file)
serves its shares from the rank processes' sealed memory, which the agent adopts; a consumer attaches rank 1 alone
and then every rank, and gets exactly those tensors, sha256 for sha256. The replica's status counts that memory."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import save_file

from ferry.client import attach, request
from ferry_agent.ranks.sharding import rank_specs
from ferry_agent.store.resident import spec_of
from tests.e2e.attach_consumer import build_model, model_tensors, tensors_sha256
from tests.support.agents import node, replica_status, seed_arg, start_agent
from tests.support.consumers import engine_pod
from tests.support.objects import apply, ml_body, wait_for, wv_body

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def test_a_consumer_attaches_one_ranks_share_or_all_of_a_two_rank_replica(
    cluster, namespace, operator, tmp_path, socket_root
):
    served = {n: t.detach().clone().contiguous() for n, t in model_tensors(build_model(seed=0)).items()}
    checkpoint = tmp_path / "v1.safetensors"
    save_file(served, str(checkpoint))
    share1 = {s.name for s in rank_specs([spec_of(n, t) for n, t in sorted(served.items())], 1, 2)}
    assert share1 and share1 != set(served)
    node_name = f"{namespace}-n0"
    node(cluster, node_name, {"ferry.dev/pool": namespace})
    agent = start_agent(cluster, tmp_path, node_name, seed_arg(namespace, "v1", checkpoint), socket_dir=socket_root)

    def status() -> dict:
        return replica_status(cluster, namespace)

    def describe() -> str:
        return json.dumps(status(), indent=1) + agent.log_tail(40)

    try:
        pod_dir = socket_root / "pods" / engine_pod(cluster, namespace, node_name)
        apply(
            cluster, namespace, wv_body(namespace, "v1", fmt="PeerOnly"), ml_body(namespace, "v1", 1, ranksPerReplica=2)
        )
        wait_for(lambda: status().get("phase") == "Serving", 180, "the two-rank replica serves", describe)
        assert len(status()["ranks"]) == 2
        total = sum(t.numel() * t.element_size() for t in served.values())
        assert (status()["residentBytes"], status()["residentVersions"]) == (total, ["v1"]), describe()

        with attach("serve", socket_dir=pod_dir, timeout=60, rank=1, verify=True) as one:
            assert one.rank == 1 and set(one.tensors()) == share1
            assert tensors_sha256(dict(one.tensors())) == tensors_sha256({n: served[n] for n in share1})
            with attach("serve", socket_dir=pod_dir, timeout=60, verify=True) as whole:
                assert set(whole.tensors()) == set(served)
                assert tensors_sha256(dict(whole.tensors())) == tensors_sha256(served)
            assert [v["attached"] for v in request({"op": "list"}, socket_dir=pod_dir, timeout=5)["versions"]] == [1]
        assert [v["attached"] for v in request({"op": "list"}, socket_dir=pod_dir, timeout=5)["versions"]] == [0]
    finally:
        agent.stop()
