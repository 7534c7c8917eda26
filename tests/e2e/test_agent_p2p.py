"""Node agents as real processes against the real apiserver: agent A seeds a version from a local safetensors
file, agent B loads the same version from A over NIXL, and a third reader verifies B's bytes. A peer copy needs the
WeightVersion to exist and be Ready (the agent checks), so the operator verifies a PeerOnly one first."""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import save_file

from ferry_agent.attach.memstore import shmem_huge_pages
from ferry_agent.kube.registry import lease_name
from ferry_agent.store.resident import ResidentWeights
from tests.support.agents import (
    agent_metrics,
    content_sha256,
    node,
    read_back,
    replica,
    seed_arg,
    start_agent,
    wait_phase,
)
from tests.support.objects import apply, get, wait_for, wait_reason, wv_body

pytestmark = pytest.mark.e2e

_PLAIN_PROBLEM = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} \S+ (WARNING|ERROR|CRITICAL) ")
_NODE_ADVICE = "host memory chunks get 4 KiB pages"  # the one warning a node's own setting earns (shmem_enabled)


def printed(cluster, namespace: str, name: str) -> dict[str, str]:
    """`kubectl get wr NAME -o wide` as a person reads it: each column's cell, cut where its header starts (kubectl
    aligns the cells under it, so a cell with a space, such as the progress, stays whole)."""
    header, row = cluster.kubectl("get", "wr", name, "-n", namespace, "-o", "wide").stdout.splitlines()
    starts = [m.start() for m in re.finditer(r"\S+", header)]
    cells = [row[a:b].strip() for a, b in zip(starts, [*starts[1:], None], strict=True)]
    return dict(zip(header.split(), cells, strict=True))


def test_agent_b_loads_from_agent_a(cluster, namespace, operator, tmp_path):
    gen = torch.Generator().manual_seed(3)
    weights = {f"layers.{i}.weight": torch.randn((128, 256), generator=gen) for i in range(6)}
    weights["norm.bias"] = torch.randn((256,), generator=gen).to(torch.bfloat16)
    seed_file = tmp_path / "v1.safetensors"
    save_file(weights, str(seed_file))
    expected = content_sha256(weights)
    total = sum(t.numel() * t.element_size() for t in weights.values())

    for n in ("node-a", "node-b"):
        node(cluster, n)
    apply(cluster, namespace, wv_body(namespace, "v1", fmt="PeerOnly"))
    uid = wait_reason(cluster, namespace, "v1", "Ready", "True", "Verified")["metadata"]["uid"]
    agent_a = start_agent(cluster, tmp_path, "node-a", seed_arg(namespace, "v1", seed_file))
    agent_b = start_agent(cluster, tmp_path, "node-b", args=["--log-format", "json"])
    try:
        replica(cluster, namespace, "wr-a", "node-a", "v1")
        a = wait_phase(cluster, namespace, "wr-a", "Serving", agent_a)
        assert a["status"]["source"] == "local"
        assert a["status"]["bytesDone"] == a["status"]["bytesTotal"] == total
        lease = json.loads(cluster.kubectl("get", "lease", lease_name("wr-a"), "-n", namespace, "-o", "json").stdout)
        assert lease["spec"]["holderIdentity"] == a["status"]["ranks"][0]["agentName"]
        assert lease["metadata"]["labels"]["ferry.dev/node"] == "node-a"  # what the chart's admission policy checks

        replica(cluster, namespace, "wr-b", "node-b", "v1")
        b = wait_phase(cluster, namespace, "wr-b", "Serving", agent_b)
        status = b["status"]
        assert status["source"] == "peer/wr-a" and status["versionUid"] == uid
        assert status["bytesDone"] == status["bytesTotal"] == total
        assert status["ranks"][0]["manifestDigest"] == a["status"]["ranks"][0]["manifestDigest"]
        outcomes = [(x["source"], x["outcome"]) for x in status["attempts"]]
        assert ("peer/wr-a", "Loaded") in outcomes and ("Peer", "Loaded") in outcomes, outcomes
        assert "Stale" not in status["phase"]

        # `kubectl get wr -o wide` shows the load as a person reads it, through the CRD's printer column.
        assert re.fullmatch(r"100% \S+/s", status["progress"]), status["progress"]
        columns = printed(cluster, namespace, "wr-b")
        assert columns["PROGRESS"] == status["progress"], columns
        assert columns["SERVES"] == "v1" and columns["PHASE"] == "Serving", columns

        # A third reader pulls from B (not the seed) and checks every byte.
        assert read_back(status["ranks"][0], "wr-b") == expected

        assert 'ferry_agent_loads_total{outcome="Loaded",source_kind="peer"} 1.0' in agent_metrics(agent_b)
        assert 'ferry_agent_loads_total{outcome="Loaded",source_kind="local"} 1.0' in agent_metrics(agent_a)

        # A cold start warns of nothing but the node's huge-page advice, once, where this node earns it: A's first
        # Peer attempt has no source yet, which is an expected miss. B logs JSON lines only, as the operator does,
        # NIXL's included.
        advised = [] if shmem_huge_pages()[1] else [True]
        problems = [line for line in agent_a.log_path.read_text().splitlines() if _PLAIN_PROBLEM.match(line)]
        assert [_NODE_ADVICE in line for line in problems] == advised, problems
        logged = [json.loads(line) for line in agent_b.log_path.read_text().splitlines()]  # NIXL's lines too
        assert any(r["logger"] == "ferry.agent" and "serving v1" in r["message"] for r in logged), logged
        problems = [r for r in logged if r["severity"] != "info"]
        assert [r["severity"] == "warn" and _NODE_ADVICE in r["message"] for r in problems] == advised, problems

        # B's read lease on A was released; A publishes the count only when it changes.
        assert (get(cluster, namespace, "wr", "wr-a")["status"].get("activeLeases") or 0) == 0

        # Deleting B's replica releases it: Lease gone, A keeps serving.
        cluster.kubectl("delete", "wr", "wr-b", "-n", namespace)
        wait_for(
            lambda: cluster.kubectl("get", "lease", lease_name("wr-b"), "-n", namespace, check=False).returncode != 0,
            20,
            "wr-b lease deleted",
        )
    finally:
        agent_b.stop()
        agent_a.stop()


def test_no_source_and_no_seed_fails_clearly(cluster, namespace, tmp_path):
    node(cluster, "node-c")
    agent = start_agent(cluster, tmp_path, "node-c")
    try:
        replica(cluster, namespace, "wr-c", "node-c", "v9")
        failed = wait_phase(cluster, namespace, "wr-c", "Failed", agent)
        assert "No load strategy succeeded" in failed["status"]["message"]
        outcomes = {(x["source"], x["outcome"]) for x in failed["status"]["attempts"]}
        assert ("Peer", "Failed") in outcomes and ("LocalFile", "Skipped") in outcomes
        # The version it failed to load is the VERSION column's; SERVES is empty: it serves nothing.
        assert failed["status"]["version"] == "v9" and failed["status"].get("servingVersion") is None
        columns = printed(cluster, namespace, "wr-c")
        assert (columns["PHASE"], columns["VERSION"], columns["SERVES"]) == ("Failed", "v9", ""), columns
    finally:
        agent.stop()


def test_resident_weights_need_contiguous_tensors():
    with pytest.raises(ValueError, match="not contiguous"):
        ResidentWeights({"t": torch.zeros((4, 4)).t()})
