"""A replica that says Serving holds exactly the bytes of its WeightVersion: operator + agent processes + the real
apiserver + SeaweedFS, each replica's bytes read back over NIXL by an independent reader.

- Two namespaces each publish a WeightVersion `v1` of model `m` with different checkpoints; the second replica on
  the same node (whose checkpoint store already holds the first tenant's `v1`) serves its own bytes.
- `v1` deleted and republished (same name, same S3 key, new bytes): the replica serves the new bytes.
- A node seed serves only the WeightVersion it names (namespace/model/version) and only if its tensors match.
- S3 frozen (SIGSTOP, sockets open) during a load: the load fails within the transfer timeout, PeerStalled names
  the s3:// object it waits on, and the replica serves once S3 is back.
- A delta frame corrupted in S3: the streamed replay fails its tensor's check, the served version stays, nothing
  of the delta is stored; repaired, it serves.
"""

from __future__ import annotations

import json
import os
import signal
import uuid

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from ferry import checkpoint_format as ckpt
from tests.support.agents import content_sha256, node, read_back, seed_arg, start_agent
from tests.support.objects import (
    apply,
    condition,
    get,
    ml_body,
    publish_full,
    put_files,
    tensors,
    uri,
    wait_for,
    wait_reason,
    wv_body,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]


def modelload(namespace: str, pool: str, **transfer) -> dict:
    return ml_body(namespace, pool=pool, transfer={"timeoutSeconds": 30, **transfer})


def sha(weights: dict[str, np.ndarray]) -> str:
    return content_sha256({name: torch.from_numpy(array) for name, array in weights.items()})


def replicas(cluster, namespace) -> list[dict]:
    return json.loads(cluster.kubectl("get", "wr", "-n", namespace, "-o", "json").stdout)["items"]


def serving(cluster, namespace, describe) -> dict:
    """The ModelLoad's one replica, once it is Serving."""
    return wait_for(
        lambda: next(
            (r for r in replicas(cluster, namespace) if (r.get("status") or {}).get("phase") == "Serving"), None
        ),
        90,
        f"a Serving replica in {namespace}",
        describe,
    )


def publish(cluster, s3, namespace: str, weights: dict[str, np.ndarray]) -> dict:
    """`v1` of model `m` with these weights at s3://…/<namespace>/v1/, once the operator has verified it."""
    publish_full(s3, namespace, "v1", weights)
    apply(cluster, namespace, wv_body(namespace, "v1"))
    return wait_reason(cluster, namespace, "v1", "Ready", "True", "Verified")


def test_two_namespaces_with_the_same_version_name_serve_their_own_bytes(cluster, s3, namespace, operator, tmp_path):
    other = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", other)
    pool = namespace
    node(cluster, f"{pool}-n", {"ferry.dev/pool": pool})
    agent = start_agent(cluster, tmp_path, f"{pool}-n", s3=s3)
    first, second = tensors(101), tensors(202)

    def describe() -> str:
        return json.dumps([r.get("status") for ns in (namespace, other) for r in replicas(cluster, ns)]) + (
            agent.log_tail(20)
        )

    try:
        wv_a = publish(cluster, s3, namespace, first)
        wv_b = publish(cluster, s3, other, second)
        apply(cluster, namespace, modelload(namespace, pool))
        a = serving(cluster, namespace, describe)
        assert a["status"]["source"] == "s3" and read_back(a["status"]["ranks"][0], a["metadata"]["name"]) == sha(first)

        # The node's store holds the first tenant's `v1`; the second tenant's replica must not be served from it.
        apply(cluster, other, modelload(other, pool))
        b = serving(cluster, other, describe)
        assert b["spec"]["nodeName"] == a["spec"]["nodeName"]
        assert read_back(b["status"]["ranks"][0], b["metadata"]["name"]) == sha(second), "the other tenant's bytes"
        assert b["status"].get("versionUid") == wv_b["metadata"]["uid"] != a["status"].get("versionUid")
        # Same tensor names and shapes: the indexes are byte-identical, only namespace, uid and URI tell them apart.
        assert wv_a["status"].get("indexDigest") == wv_b["status"].get("indexDigest") is not None
        store = tmp_path / f"store-{pool}-n"
        both = [store / ns / "m" / "full" / "v1" for ns in (namespace, other)]
        wait_for(lambda: all(p.is_dir() for p in both), 30, "both versions stored (written behind the loads)", describe)
    finally:
        for ns in (namespace, other):
            cluster.kubectl("delete", "ml", "serve", "-n", ns, "--wait=false", check=False)
        agent.stop()
        cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)


def test_a_seed_is_used_only_for_its_own_weightversion(cluster, s3, namespace, operator, tmp_path):
    """A node seed names namespace/model/version: another tenant's `v1` is not seeded from it, and a seed whose
    tensors are not the WeightVersion's (count or size the operator recorded) is refused."""
    other = f"t-{uuid.uuid4().hex[:8]}"
    cluster.kubectl("create", "namespace", other)
    pool = namespace
    mine, wrong = tensors(505), tensors(606, n=2)
    mine_file, wrong_file = tmp_path / "mine.safetensors", tmp_path / "wrong.safetensors"
    save_file({k: torch.from_numpy(v) for k, v in mine.items()}, str(mine_file))
    save_file({k: torch.from_numpy(v) for k, v in wrong.items()}, str(wrong_file))
    node(cluster, f"{pool}-n", {"ferry.dev/pool": pool})
    agent = start_agent(
        cluster, tmp_path, f"{pool}-n", seed_arg(namespace, "v1", mine_file), seed_arg(other, "v2", wrong_file), s3=s3
    )

    def describe() -> str:
        return json.dumps([r.get("status") for ns in (namespace, other) for r in replicas(cluster, ns)]) + (
            agent.log_tail(20)
        )

    def phase_of(ns: str, ml: str, phase: str) -> dict:
        return wait_for(
            lambda: next(
                (
                    r
                    for r in replicas(cluster, ns)
                    if r["spec"]["modelLoad"] == ml and (r.get("status") or {}).get("phase") == phase
                ),
                None,
            ),
            90,
            f"{ml} {phase} in {ns}",
            describe,
        )

    try:
        for ns in (namespace, other):
            apply(cluster, ns, wv_body(ns, "v1", fmt="PeerOnly"))
            wait_reason(cluster, ns, "v1", "Ready", "True", "Verified")
            apply(cluster, ns, modelload(ns, pool))
        a = phase_of(namespace, "serve", "Serving")
        assert a["status"]["source"] == "local"
        assert read_back(a["status"]["ranks"][0], a["metadata"]["name"]) == sha(mine)
        # The other tenant's `v1` has no seed on this node (and is PeerOnly): nothing may serve it.
        b = phase_of(other, "serve", "Failed")
        local = [x for x in b["status"]["attempts"] if x["source"] == "LocalFile"]
        assert local and all(x["outcome"] == "Skipped" for x in local), b["status"]

        # `v2` in S3 has 4 tensors; the seed configured for it has 2. With S3 out of the source order the seed is
        # all that is left, and it is refused for what it holds.
        publish_full(s3, other, "v2", tensors(707))
        apply(cluster, other, wv_body(other, "v2"))
        assert wait_reason(cluster, other, "v2", "Ready", "True", "Verified")["status"]["tensorCount"] == 4
        apply(cluster, other, ml_body(other, "v2", name="serve2", pool=pool, sourceOrder=["Peer"]))
        c = phase_of(other, "serve2", "Failed")
        assert "tensorCount 2, the WeightVersion has 4" in json.dumps(c["status"]), c["status"]
    finally:
        for ns, ml in ((namespace, "serve"), (other, "serve"), (other, "serve2")):
            cluster.kubectl("delete", "ml", ml, "-n", ns, "--wait=false", check=False)
        agent.stop()
        cluster.kubectl("delete", "namespace", other, "--wait=false", check=False)


def test_a_deleted_and_republished_version_serves_its_new_bytes(cluster, s3, namespace, operator, tmp_path):
    node(cluster, f"{namespace}-n", {"ferry.dev/pool": namespace})
    agent = start_agent(cluster, tmp_path, f"{namespace}-n", s3=s3)
    old, new = tensors(303), tensors(404)

    def describe() -> str:
        return json.dumps([r.get("status") for r in replicas(cluster, namespace)]) + agent.log_tail(20)

    try:
        first = publish(cluster, s3, namespace, old)
        apply(cluster, namespace, modelload(namespace, namespace))
        before = serving(cluster, namespace, describe)
        assert read_back(before["status"]["ranks"][0], before["metadata"]["name"]) == sha(old)

        cluster.kubectl("delete", "ml", "serve", "-n", namespace)
        wait_for(lambda: not replicas(cluster, namespace), 60, "replicas collected", describe)
        cluster.kubectl("delete", "wv", "v1", "-n", namespace, "--wait=false")
        wait_for(lambda: get(cluster, namespace, "wv", "v1") is None, 60, "v1 released", describe)

        # The same name and the same S3 key, new bytes.
        second = publish(cluster, s3, namespace, new)
        assert second["spec"]["storage"]["uri"] == first["spec"]["storage"]["uri"] == uri(namespace, "v1")
        assert second["metadata"]["uid"] != first["metadata"]["uid"]
        apply(cluster, namespace, modelload(namespace, namespace))
        after = serving(cluster, namespace, describe)
        assert after["spec"]["nodeName"] == before["spec"]["nodeName"]  # the node whose store held the old bytes
        assert read_back(after["status"]["ranks"][0], after["metadata"]["name"]) == sha(new), "the old bytes"
        assert after["status"].get("versionUid") == second["metadata"]["uid"]
    finally:
        cluster.kubectl("delete", "ml", "serve", "-n", namespace, "--wait=false", check=False)
        agent.stop()


def test_a_frozen_s3_fails_the_load_in_bounded_time_and_the_stall_names_it(cluster, s3, namespace, operator, tmp_path):
    node(cluster, f"{namespace}-n", {"ferry.dev/pool": namespace})
    agent = start_agent(cluster, tmp_path, f"{namespace}-n", s3=s3, retry_seconds=2)
    weights = tensors(505)
    frozen = False

    def ml_status() -> dict:
        return (get(cluster, namespace, "ml", "serve") or {}).get("status") or {}

    def describe() -> str:
        return json.dumps([ml_status()] + [r.get("status") for r in replicas(cluster, namespace)]) + agent.log_tail(20)

    try:
        publish(cluster, s3, namespace, weights)  # verified while S3 answers
        os.kill(s3.process.proc.pid, signal.SIGSTOP)  # frozen: its sockets stay open, nothing answers
        frozen = True
        apply(cluster, namespace, modelload(namespace, namespace, timeoutSeconds=9, stallSeconds=2))

        stalled = wait_for(
            lambda: (c := condition({"status": ml_status()}, "PeerStalled")).get("status") == "True" and c,
            60,
            "PeerStalled",
            describe,
        )
        assert uri(namespace, "v1") in stalled["message"], stalled["message"]
        # All tries of one S3 request fit in the 9 s transfer timeout; botocore's defaults took minutes.
        failed = wait_for(
            lambda: next(
                (r for r in replicas(cluster, namespace) if (r.get("status") or {}).get("phase") == "Failed"), None
            ),
            60,
            "the load failed",
            describe,
        )
        assert failed["status"]["reason"] == "LoadFailed" and uri(namespace, "v1") in failed["status"]["message"]

        os.kill(s3.process.proc.pid, signal.SIGCONT)
        frozen = False
        done = serving(cluster, namespace, describe)  # the agent retries and loads once S3 answers again
        assert read_back(done["status"]["ranks"][0], done["metadata"]["name"]) == sha(weights)
    finally:
        if frozen:
            os.kill(s3.process.proc.pid, signal.SIGCONT)
        cluster.kubectl("delete", "ml", "serve", "-n", namespace, "--wait=false", check=False)
        agent.stop()


def test_a_corrupt_delta_frame_in_s3_never_serves_and_the_repaired_one_does(cluster, s3, namespace, operator, tmp_path):
    """A byte of v2's delta frame flipped in S3 after publishing (the operator checks headers, not tensor data, so
    v2 is Ready): the agent's streamed replay fails that tensor's check, v1 keeps serving and nothing of v2 is
    stored; once the object is repaired, the retry serves v2's bytes."""
    node(cluster, f"{namespace}-n", {"ferry.dev/pool": namespace})
    agent = start_agent(cluster, tmp_path, f"{namespace}-n", s3=s3)
    v1 = tensors(505, n=4, shape=(64, 64))
    changed = "layer1.weight"
    v2 = {**v1, changed: np.random.default_rng(506).standard_normal((64, 64)).astype(np.float32)}
    good = ckpt.build_xor_delta(v1, v2, version="v2", base_version="v1")
    shard = ckpt.delta_shard_name(0, 1)
    header_len, header = ckpt.parse_safetensors_header(good[shard])
    begin, end = header[changed]["data_offsets"]
    bad = bytearray(good[shard])
    bad[ckpt.HEADER_PREFIX_BYTES + header_len + (begin + end) // 2] ^= 0x10

    def describe() -> str:
        return json.dumps([r.get("status") for r in replicas(cluster, namespace)]) + agent.log_tail(20)

    try:
        v1_uid = publish(cluster, s3, namespace, v1)["metadata"]["uid"]
        put_files(s3, namespace, "v2", {**good, shard: bytes(bad)})
        apply(cluster, namespace, wv_body(namespace, "v2", base="v1"))
        wait_reason(cluster, namespace, "v2", "Ready", "True", "Verified")
        apply(cluster, namespace, modelload(namespace, namespace))
        name = serving(cluster, namespace, describe)["metadata"]["name"]

        cluster.kubectl(
            "patch", "ml", "serve", "-n", namespace, "--type=merge", "-p", '{"spec":{"desiredVersion":"v2"}}'
        )
        failed = wait_for(
            lambda: (
                (s := replicas(cluster, namespace)[0]["status"]).get("loadingVersion") == "v2" and s.get("reason") and s
            ),
            90,
            "v2 failed",
            describe,
        )
        message = failed["message"]
        assert f"{uri(namespace, 'v2').rpartition('/')[0]}/{shard}" in message and repr(changed) in message, message
        assert "adler32" in message or "does not decode" in message, message
        assert (failed["phase"], failed["version"], failed["versionUid"]) == ("Serving", "v1", v1_uid)
        store = tmp_path / f"store-{namespace}-n"
        assert not [p for p in store.rglob("*") if "/v2" in str(p)], "nothing of v2 is stored"

        put_files(s3, namespace, "v2", good)  # repaired: the retry (with backoff) loads it
        done = wait_for(
            lambda: (
                (s := replicas(cluster, namespace)[0]["status"]).get("phase") == "Serving"
                and s.get("version") == "v2"
                and s
            ),
            90,
            "v2 served",
            describe,
        )
        assert read_back(done["ranks"][0], name) == sha(v2)
    finally:
        cluster.kubectl("delete", "ml", "serve", "-n", namespace, "--wait=false", check=False)
        agent.stop()
