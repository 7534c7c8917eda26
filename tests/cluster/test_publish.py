"""`ferry publish` against the real SeaweedFS S3 server and kube-apiserver: canonical objects, immutable writes,
multipart uploads, the WeightVersion it applies, and clear errors for bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from botocore.exceptions import ClientError
from safetensors.numpy import load, save_file

from ferry import checkpoint_format as ckpt
from ferry.cli import EXIT_CONFLICT, EXIT_INVALID, EXIT_NOT_FOUND, EXIT_TRANSIENT, main
from ferry.publish import ImmutableConflict
from ferry.publish.writer import ImmutableWriter
from ferry_dev.localcluster import LocalCluster, S3Server

pytestmark = pytest.mark.cluster

BUCKET = "ferry-publish"
MODEL = "tiny"


@pytest.fixture
def env(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    s3.create_bucket(BUCKET)
    for key, value in s3.env().items():
        monkeypatch.setenv(key, value)
    return s3.env()


@pytest.fixture
def prefix(env: dict[str, str]) -> str:
    return f"s3://{BUCKET}/{uuid.uuid4().hex[:8]}"


def weights(seed: int, n: int = 4) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {f"layers.{i}.weight": rng.standard_normal((32, 16)).astype(np.float32) for i in range(n)}


def write_dir(path: Path, tensors: dict[str, np.ndarray]) -> Path:
    """Two input files, as a trainer's sharded save would have."""
    path.mkdir(parents=True)
    names = list(tensors)
    save_file({k: tensors[k] for k in names[::2]}, path / "a.safetensors")
    save_file({k: tensors[k] for k in names[1::2]}, path / "b.safetensors")
    return path


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    code = main(["publish", *map(str, args)])
    out, err = capsys.readouterr()
    return code, out, err


def common(s3: S3Server, cluster: LocalCluster, namespace: str, prefix: str) -> list[str]:
    return [
        f"--uri-prefix={prefix}",
        f"--endpoint={s3.endpoint}",
        f"--kubeconfig={cluster.kubeconfig}",
        f"--namespace={namespace}",
        f"--model={MODEL}",
    ]


def objects(s3: S3Server, prefix: str) -> dict[str, bytes]:
    client = s3.client()
    key = prefix.removeprefix(f"s3://{BUCKET}/")
    listing = client.list_objects_v2(Bucket=BUCKET, Prefix=key + "/").get("Contents", [])
    return {o["Key"][len(key) + 1 :]: client.get_object(Bucket=BUCKET, Key=o["Key"])["Body"].read() for o in listing}


def get_wv(cluster: LocalCluster, namespace: str, name: str) -> dict[str, Any] | None:
    proc = cluster.kubectl("get", "wv", name, "-n", namespace, "-o", "json", check=False)
    return json.loads(proc.stdout) if proc.returncode == 0 else None


def replay(stored: list[dict[str, bytes]], version_dirs: list[str]) -> dict[str, np.ndarray]:
    """Rebuild the weights a reader gets: the full checkpoint, then each delta applied in order."""
    full = stored[0]
    index = ckpt.parse_index(full[f"{version_dirs[0]}/{ckpt.INDEX_NAME}"])
    result = {}
    for shard in index.shards:
        result.update(load(full[f"{version_dirs[0]}/{shard}"]))
    for objs, version in zip(stored[1:], version_dirs[1:], strict=True):
        index = ckpt.parse_index(objs[f"{version}/{ckpt.INDEX_NAME}"])
        for shard in index.shards:
            data = objs[f"{version}/{shard}"]
            _, header = ckpt.parse_safetensors_header(data)
            checksums = ckpt.shard_checksums(header)
            for name, frame in load(data).items():
                result[name] = ckpt.apply_xor_delta(result[name], frame.tobytes(), checksums[name])
    return result


def test_full_then_deltas_replayed_from_s3(s3, cluster, namespace, prefix, tmp_path, capsys) -> None:
    args = [*common(s3, cluster, namespace, prefix), "--layout-signature=tiny/f32/tp1"]
    v1 = weights(1)
    code, out, err = run(capsys, write_dir(tmp_path / "v1", v1), "--version=v1", "--shard-size=4KiB", *args)
    assert code == 0, err
    assert "weightversion.ferry.dev/v1 created" in out and "MB/s" in err and "\r" in err
    index = ckpt.parse_index(objects(s3, prefix)[f"v1/{ckpt.INDEX_NAME}"])
    assert not index.is_delta and set(index.weight_map) == set(v1) and len(index.shards) == 2
    assert get_wv(cluster, namespace, "v1")["spec"] == {
        "modelName": MODEL,
        "format": "FullCheckpoint",
        "layoutSignature": "tiny/f32/tp1",
        "storage": {"uri": f"{prefix}/v1/{ckpt.INDEX_NAME}", "endpoint": s3.endpoint},
    }

    # v2: no --base-dir, so the base comes back from S3 through the v1 WeightVersion.
    v2 = {**v1, "layers.2.weight": v1["layers.2.weight"] + 1}
    code, out, err = run(capsys, write_dir(tmp_path / "v2", v2), "--version=v2", "--base=v1", *args)
    assert code == 0, err
    stored = objects(s3, prefix)
    delta = ckpt.parse_index(stored[f"v2/{ckpt.INDEX_NAME}"])
    ckpt.check_delta_identity(delta, version="v2", base_version="v1")
    assert list(delta.weight_map) == ["layers.2.weight"]
    spec = get_wv(cluster, namespace, "v2")["spec"]
    assert (spec["format"], spec["baseVersion"]) == ("XorDelta", "v1")

    # v3 from a torch state dict, on top of a delta: the publisher replays v1 + v2 to get its base.
    v3 = {**v2, "layers.0.weight": v2["layers.0.weight"] * 2}
    torch.save({k: torch.from_numpy(a) for k, a in v3.items()}, tmp_path / "v3.pt")
    code, out, err = run(capsys, tmp_path / "v3.pt", "--version=v3", "--base=v2", *args)
    assert code == 0, err
    stored = objects(s3, prefix)
    by_version = [{k: v for k, v in stored.items() if k.startswith(f"{ver}/")} for ver in ("v1", "v2", "v3")]
    rebuilt = replay(by_version, ["v1", "v2", "v3"])
    assert set(rebuilt) == set(v3) and all(np.array_equal(rebuilt[k], v3[k]) for k in v3)


def test_bf16_state_dict_keeps_its_dtype(s3, cluster, namespace, prefix, tmp_path, capsys) -> None:
    state = {"w": torch.randn(8, 4).to(torch.bfloat16), "scale": torch.randn(3).to(torch.float8_e4m3fn)}
    torch.save(state, tmp_path / "m.pt")
    code, _, err = run(capsys, tmp_path / "m.pt", "--version=b1", "--no-apply", f"--uri-prefix={prefix}", "-q")
    assert code == 0 and err == ""
    shard = tmp_path / "shard.safetensors"
    shard.write_bytes(objects(s3, prefix)["b1/model-00001-of-00001.safetensors"])
    from safetensors import safe_open

    with safe_open(shard, framework="pt") as f:
        for name, tensor in state.items():
            loaded = f.get_tensor(name)
            assert loaded.dtype == tensor.dtype and torch.equal(loaded.view(torch.uint8), tensor.view(torch.uint8))


def test_republish_identical_succeeds_and_different_fails(s3, cluster, namespace, prefix, tmp_path, capsys, env):
    args = [*common(s3, cluster, namespace, prefix), "--version=v1", "--shard-size=4KiB"]
    source = write_dir(tmp_path / "v1", weights(1))
    assert run(capsys, source, *args)[0] == 0
    before = objects(s3, prefix)
    wv_before = get_wv(cluster, namespace, "v1")

    code, out, err = run(capsys, source, *args)
    assert code == 0, err
    assert f"0 objects written, {len(before)} already there" in out and "v1 unchanged" in out

    # The real console script, so the exit status is what a shell sees. Other tensors: another index.
    other = write_dir(tmp_path / "other", weights(2, n=3))
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "ferry"), "publish", str(other), *args],
        capture_output=True,
        text=True,
        env={**os.environ, **env},
        timeout=120,
    )
    assert proc.returncode == EXIT_CONFLICT, proc.stderr
    assert f"{prefix}/v1/{ckpt.INDEX_NAME} already exists with different content" in proc.stderr
    assert "nothing was overwritten" in proc.stderr
    assert objects(s3, prefix) == before
    assert get_wv(cluster, namespace, "v1")["metadata"]["resourceVersion"] == wv_before["metadata"]["resourceVersion"]

    # Same index, different shard content (one value changed): caught on the shard, before the index.
    tweaked = weights(1)
    tweaked["layers.3.weight"][0, 0] += 1
    code, _, err = run(capsys, write_dir(tmp_path / "tweaked", tweaked), *args)
    assert code == EXIT_CONFLICT and "model-00002-of-00002.safetensors already exists with different content" in err
    assert objects(s3, prefix) == before

    # A different spec for an existing WeightVersion fails before any upload.
    code, _, err = run(capsys, source, *args, "--layout-signature=changed")
    assert code == EXIT_CONFLICT and "WeightVersion" in err and "already exists with spec" in err


def test_multipart_upload(s3, prefix, tmp_path, capsys) -> None:
    big = {"embed": np.random.default_rng(3).standard_normal(3 * 1024 * 1024).astype(np.float16)}  # 6 MiB
    source = write_dir(tmp_path / "big", {**big, "tiny": np.ones(4, np.float32)})
    args = [source, "--version=m1", "--no-apply", f"--uri-prefix={prefix}", "--multipart-threshold=1MiB"]
    code, _, err = run(capsys, *args)
    assert code == 0, err
    client = s3.client()
    key = prefix.removeprefix(f"s3://{BUCKET}/") + "/m1/model-00001-of-00001.safetensors"
    head = client.head_object(Bucket=BUCKET, Key=key)
    assert head["ContentLength"] > 6 * 1024 * 1024 and head["ETag"].strip('"').endswith("-2")  # 5 MiB parts
    stored = objects(s3, prefix)
    shard = load(stored["m1/model-00001-of-00001.safetensors"])
    assert np.array_equal(shard["embed"], big["embed"])
    assert run(capsys, *args)[0] == 0  # idempotent, through the multipart ETag

    changed = write_dir(tmp_path / "changed", {**big, "tiny": np.zeros(4, np.float32)})
    code, _, err = run(capsys, changed, *args[1:])
    assert code == EXIT_CONFLICT and "already exists with different content" in err
    assert objects(s3, prefix) == stored
    assert not client.list_multipart_uploads(Bucket=BUCKET, Prefix=key).get("Uploads")


class _LateHead:
    """A client whose first HEAD misses, as if another publisher wrote the object right after we looked."""

    def __init__(self, client: Any) -> None:
        self._client, self._missed = client, False

    def head_object(self, **kwargs: Any) -> Any:
        if not self._missed:
            self._missed = True
            raise ClientError({"Error": {"Code": "404"}}, "HeadObject")
        return self._client.head_object(**kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._client, name)


@pytest.mark.parametrize("size", [1024, 6 * 1024 * 1024], ids=["put", "multipart"])
def test_if_none_match_race(s3, env, size: int) -> None:
    """The server's If-None-Match answer (412) is what protects a concurrent write; then we compare."""
    client = s3.client()
    prefix = f"race/{uuid.uuid4().hex[:8]}/"
    data = os.urandom(size)
    client.put_object(Bucket=BUCKET, Key=prefix + "obj", Body=data)
    assert ImmutableWriter(_LateHead(client), BUCKET, prefix, multipart_threshold=1 << 20).put("obj", data) is False
    with pytest.raises(ImmutableConflict, match="different content"):
        ImmutableWriter(_LateHead(client), BUCKET, prefix, multipart_threshold=1 << 20).put("obj", data[::-1])
    assert client.get_object(Bucket=BUCKET, Key=prefix + "obj")["Body"].read() == data
    assert not client.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix).get("Uploads")


def set_status(cluster: LocalCluster, namespace: str, name: str, phase: str, ready: str, reason: str) -> None:
    """Play the operator (not running in these tests): write the status it would."""
    condition = {
        "type": "Ready",
        "status": ready,
        "reason": reason,
        "message": f"{reason} for the test",
        "lastTransitionTime": "2026-01-01T00:00:00Z",
    }
    patch = json.dumps({"status": {"phase": phase, "conditions": [condition]}})
    cluster.kubectl("patch", "wv", name, "-n", namespace, "--subresource=status", "--type=merge", "-p", patch)


def test_wait_for_ready(s3, cluster, namespace, prefix, tmp_path, capsys) -> None:
    source = write_dir(tmp_path / "w", weights(5))
    args = [source, "--version=w1", *common(s3, cluster, namespace, prefix)]
    code, _, err = run(capsys, *args, "--wait", "--timeout=1")
    assert code == EXIT_TRANSIENT and "is not Ready after 1s" in err
    set_status(cluster, namespace, "w1", "Ready", "True", "Verified")
    code, out, err = run(capsys, *args, "--wait", "--timeout=5")
    assert code == 0 and "w1 unchanged" in out, err

    args = [source, "--version=w2", *common(s3, cluster, namespace, prefix)]
    assert run(capsys, *args)[0] == 0
    set_status(cluster, namespace, "w2", "Failed", "False", "LayoutMismatch")
    code, _, err = run(capsys, *args, "--wait", "--timeout=60")  # a Failed phase ends the wait at once
    assert code == 1 and "failed (Failed: LayoutMismatch: LayoutMismatch for the test)" in err


def test_delta_with_base_dir_and_no_apply(s3, cluster, namespace, prefix, tmp_path, capsys) -> None:
    base = weights(7)
    base_dir = write_dir(tmp_path / "base", base)
    new = write_dir(tmp_path / "new", {**base, "layers.1.weight": base["layers.1.weight"] - 1})
    code, out, err = run(
        capsys, new, "--version=d2", "--base=d1", f"--base-dir={base_dir}", "--no-apply", f"--uri-prefix={prefix}"
    )
    assert code == 0, err
    assert "weightversion" not in out and get_wv(cluster, namespace, "d2") is None
    delta = ckpt.parse_index(objects(s3, prefix)[f"d2/{ckpt.INDEX_NAME}"])
    assert delta.metadata["base_version"] == "d1" and list(delta.weight_map) == ["layers.1.weight"]


def test_bad_input(s3, cluster, namespace, prefix, tmp_path, capsys) -> None:
    good = write_dir(tmp_path / "good", weights(1))
    (tmp_path / "empty").mkdir()
    save_file({}, tmp_path / "none.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    renamed = write_dir(tmp_path / "renamed", {f"x.{k}": v for k, v in weights(1).items()})
    reshaped = write_dir(tmp_path / "reshaped", {k: v.reshape(16, 32) for k, v in weights(1).items()})
    retyped = write_dir(tmp_path / "retyped", {k: v.astype(np.float16) for k, v in weights(1).items()})
    base = ["--base=b0", f"--base-dir={good}"]
    cases: list[tuple[list[Any], int, str]] = [
        ([tmp_path / "missing"], EXIT_NOT_FOUND, "does not exist"),
        ([tmp_path / "empty"], EXIT_INVALID, "has no *.safetensors files"),
        ([tmp_path / "none.safetensors"], EXIT_INVALID, "holds no tensors"),
        ([tmp_path / "junk.safetensors"], EXIT_INVALID, "is not a valid safetensors file"),
        ([renamed, *base], EXIT_INVALID, "missing layers.0.weight; missing layers.1.weight"),
        ([reshaped, *base], EXIT_INVALID, "layers.0.weight: F32[32, 16] → F32[16, 32]"),
        ([retyped, *base], EXIT_INVALID, "layers.0.weight: F32[32, 16] → F16[32, 16]"),
        ([good, "--base=nope"], EXIT_NOT_FOUND, f"base WeightVersion {namespace}/nope not found"),
        ([good, "--uri-prefix=http://x/y"], EXIT_INVALID, "is not an s3://bucket/prefix URI"),
        ([good, "--version=Not_Valid"], EXIT_INVALID, "is not a valid object name"),
        ([good, "--base=v1", "--version=v1"], EXIT_INVALID, "cannot be its own base"),
        ([good, "--credentials-secret=absent"], EXIT_INVALID, f"Secret {namespace}/absent (--credentials-secret) does"),
    ]
    for extra, status, message in cases:
        code, _, err = run(capsys, "--version=v1", *common(s3, cluster, namespace, prefix), *extra)
        assert (code, message in err) == (status, True), (extra, err)
    code, _, err = run(capsys, good, "--version=v1", f"--uri-prefix={prefix}")
    assert code == EXIT_INVALID and "--model is required" in err
    assert objects(s3, prefix) == {} and get_wv(cluster, namespace, "v1") is None


def secret(cluster: LocalCluster, namespace: str, name: str, data: dict[str, str]) -> None:
    body = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": name}, "stringData": data}
    cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(body))


def test_the_credentials_secret_is_checked_before_the_upload(s3, cluster, namespace, prefix, tmp_path, capsys) -> None:
    source = write_dir(tmp_path / "s", weights(3))
    args = [source, "--version=s1", *common(s3, cluster, namespace, prefix)]
    secret(cluster, namespace, "half", {"AWS_ACCESS_KEY_ID": s3.access_key})
    code, _, err = run(capsys, *args, "--credentials-secret=half")
    assert code == EXIT_INVALID and f"Secret {namespace}/half (--credentials-secret): Secret data has no key" in err
    assert objects(s3, prefix) == {} and get_wv(cluster, namespace, "s1") is None  # nothing uploaded or applied
