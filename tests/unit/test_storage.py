"""Storage verification against an in-memory fake S3: every reason, without processes, through both drivers: a
blocking boto3-like client (`verify_checkpoint`) and an asyncio one (`verify_checkpoint_async`, the operator's
against an explicit endpoint)."""

from __future__ import annotations

import asyncio
import json
import re
import struct
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from botocore.exceptions import (
    ClientError,
    EndpointConnectionError,
    NoCredentialsError,
    ReadTimeoutError,
    ResponseStreamingError,
)
from safetensors.numpy import save

from ferry import checkpoint_format as ckpt
from ferry.storage import HEADER_PROBE_BYTES, StorageReason, StorageReport, verify_checkpoint, verify_checkpoint_async
from ferry_operator import verification

pytestmark = pytest.mark.unit

BUCKET = "weights"
PREFIX = "llama/v1/"
URI = f"s3://{BUCKET}/{PREFIX}{ckpt.INDEX_NAME}"


def client_error(code: str, status: int, message: str = "") -> ClientError:
    return ClientError(
        {"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}}, "op"
    )


class FakeBody:
    def __init__(self, data: bytes, fail: Exception | None = None) -> None:
        self.data, self.fail, self.closed, self.given = data, fail, False, 0

    def read(self, amt: int | None = None) -> bytes:
        if self.fail:
            raise self.fail
        self.given = len(self.data) if amt is None else min(amt, len(self.data))
        return self.data[: self.given]

    def close(self) -> None:
        self.closed = True


class FakeS3:
    """head_object/get_object over a dict, with per-key failure injection and a request log."""

    def __init__(self, files: dict[str, bytes] | None = None, prefix: str = PREFIX) -> None:
        self.objects = {(BUCKET, prefix + name): data for name, data in (files or {}).items()}
        self.fail: dict[tuple[str, str], Exception] = {}  # (operation, key) → raised
        self.body_fail: dict[str, Exception] = {}
        self.requests: list[tuple[str, str, str | None]] = []
        self.bodies: list[FakeBody] = []
        self.ignore_range = False  # answer every GET with the whole object, as a server that ignores Range does

    def _find(self, op: str, Bucket: str, Key: str) -> bytes:
        if (op, Key) in self.fail:
            raise self.fail[(op, Key)]
        if ("*", "*") in self.fail:
            raise self.fail[("*", "*")]
        if (Bucket, Key) not in self.objects:
            if op == "head":
                raise client_error("404", 404, "Not Found")
            raise client_error("NoSuchKey", 404, "The specified key does not exist.")
        return self.objects[(Bucket, Key)]

    def head_object(self, *, Bucket: str, Key: str) -> dict[str, Any]:
        self.requests.append(("head", Key, None))
        return {"ContentLength": len(self._find("head", Bucket, Key))}

    def get_object(self, *, Bucket: str, Key: str, Range: str | None = None) -> dict[str, Any]:
        self.requests.append(("get", Key, Range))
        whole = self._find("get", Bucket, Key)
        if not Range or self.ignore_range:
            self.bodies.append(FakeBody(whole, self.body_fail.get(Key)))
            return {"ContentLength": len(whole), "Body": self.bodies[-1]}
        first, last = map(int, re.fullmatch(r"bytes=(\d+)-(\d+)", Range).groups())  # type: ignore[union-attr]
        if first >= len(whole):
            raise client_error("InvalidRange", 416, "The requested range is not satisfiable")
        data = whole[first : last + 1]
        return {
            "ContentLength": len(data),
            "ContentRange": f"bytes {first}-{first + len(data) - 1}/{len(whole)}",
            "Body": FakeBody(data, self.body_fail.get(Key)),
        }


class AsyncBody:
    def __init__(self, body: FakeBody) -> None:
        self.body = body

    async def read(self, amt: int | None = None) -> bytes:
        return self.body.read(amt)

    def close(self) -> None:
        self.body.close()


class AsyncClient:
    """A fake as `ferry.s3reader.S3Reader` answers: `get_object` and its Body's `read` are coroutines."""

    def __init__(self, fake: FakeS3) -> None:
        self.fake = fake

    async def get_object(self, **kw: Any) -> dict[str, Any]:
        response = self.fake.get_object(**kw)
        return {**response, "Body": AsyncBody(response["Body"])}


_driver = {"name": "blocking"}


@pytest.fixture(autouse=True, params=["blocking", "asyncio"])
def driver(request: pytest.FixtureRequest) -> str:
    _driver["name"] = request.param
    return request.param


def full_files(**kw: Any) -> dict[str, bytes]:
    rng = np.random.default_rng(1)
    tensors = {f"layer.{i}.weight": rng.standard_normal((4, 8)).astype(np.float32) for i in range(5)}
    return ckpt.build_full_checkpoint(tensors, shard_bytes=kw.get("shard_bytes", 300))


def delta_files(version: str = "v2", base_version: str = "v1") -> dict[str, bytes]:
    base = {"a": np.zeros((16,), np.float32), "b": np.ones((4, 4), np.float16), "c": np.arange(3)}
    new = {"a": base["a"] + 1, "b": base["b"], "c": base["c"] * 2}
    return ckpt.build_xor_delta(base, new, version, base_version)


def verify(fake: FakeS3, fmt: str = "FullCheckpoint", uri: str = URI, **kw: Any) -> StorageReport:
    kw.setdefault("version", "v2" if fmt == "XorDelta" else "v1")
    kw.setdefault("base_version", "v1" if fmt == "XorDelta" else None)
    if _driver["name"] == "asyncio":
        kw.pop("map_shards", None)
        return asyncio.run(verify_checkpoint_async(AsyncClient(fake), uri, fmt=fmt, **kw))
    return verify_checkpoint(fake, uri, fmt=fmt, **kw)


def edit_index(files: dict[str, bytes], change: Callable[[dict], None]) -> dict[str, bytes]:
    doc = json.loads(files[ckpt.INDEX_NAME])
    change(doc)
    return {**files, ckpt.INDEX_NAME: json.dumps(doc).encode()}


def shards(files: dict[str, bytes]) -> list[str]:
    return sorted(n for n in files if n != ckpt.INDEX_NAME)


# ---------------------------------------------------------------- helpers


def test_reasons_are_a_fixed_camelcase_list() -> None:
    assert [r.value for r in StorageReason] == [r.name for r in StorageReason]
    assert set(StorageReason) == {
        "Verified",
        "NotApplicable",
        "VerificationPending",
        "ObjectMissing",
        "IndexInvalid",
        "UriInvalid",
        "SizeMismatch",
        "AccessDenied",
        "CredentialsMissing",
        "AmbientCredentialsDenied",
        "EndpointUnreachable",
    }


# ---------------------------------------------------------------- verification: success


def test_verified_full_checkpoint() -> None:
    files = full_files()
    fake = FakeS3(files)
    report = verify(fake)
    assert report.ok and report.reason == StorageReason.Verified and not report.transient
    assert report.total_bytes == sum(len(files[s]) for s in shards(files))
    assert report.tensor_count == 5 and report.shard_count == len(shards(files)) > 1
    assert "5 tensors" in report.message
    # No tensor data is downloaded: one index GET, then one header-sized ranged GET per shard (its Content-Range
    # gives the shard's size: no HEAD).
    assert [r[0] for r in fake.requests] == ["get"] + ["get"] * len(shards(files))
    assert all(r[2] is not None for r in fake.requests[1:] if r[0] == "get")


def test_verified_delta() -> None:
    files = delta_files()
    report = verify(FakeS3(files), "XorDelta")
    assert report.ok and report.reason == StorageReason.Verified
    assert report.tensor_count == 2 and report.shard_count == 1
    assert report.total_bytes == len(files["model-00000-of-00001.safetensors"])


def test_verified_empty_delta() -> None:
    base = {"a": np.zeros(4, np.float32)}
    report = verify(FakeS3(ckpt.build_xor_delta(base, base, "v2", "v1")), "XorDelta")
    assert report.ok and (report.tensor_count, report.shard_count, report.total_bytes) == (0, 0, 0)


def test_index_at_bucket_root() -> None:
    report = verify(FakeS3(full_files(), prefix=""), uri=f"s3://{BUCKET}/{ckpt.INDEX_NAME}")
    assert report.ok


def test_large_header_is_read_with_a_second_ranged_get() -> None:
    tensors = {f"t{i:05d}-" + "x" * 40: np.zeros(1, np.uint8) for i in range(2000)}  # ~150 KiB of header
    fake = FakeS3(ckpt.build_full_checkpoint(tensors, 1 << 30))
    report = verify(fake)
    assert report.ok, report.message
    probe, rest = [r[2] for r in fake.requests if r[0] == "get"][1:]
    assert probe == "bytes=0-65535" and rest.startswith("bytes=65536-")


def test_a_server_that_ignores_the_range_is_read_no_further_than_the_probe() -> None:
    """Shard probes answered with whole shards (gigabytes, in a real checkpoint) take only the probe's bytes of each
    and close the rest unread: whoever runs the endpoint a WeightVersion names cannot make the operator buffer it."""
    rng = np.random.default_rng(2)
    tensors = {f"w{i}": rng.standard_normal((128, 256)).astype(np.float32) for i in range(2)}  # 128 KiB each
    files = ckpt.build_full_checkpoint(tensors, shard_bytes=1)
    fake = FakeS3(files)
    fake.ignore_range = True
    report = verify(fake)
    assert report.ok and report.total_bytes == sum(len(files[s]) for s in shards(files)), report.message
    probed = fake.bodies[1:]  # after the index
    assert len(probed) == 2 and all(len(b.data) > HEADER_PROBE_BYTES for b in probed)
    assert [(b.given, b.closed) for b in probed] == [(HEADER_PROBE_BYTES, True)] * 2


def test_peer_only_is_not_applicable() -> None:
    fake = FakeS3()
    report = verify(fake, "PeerOnly", uri="")
    assert report.ok and report.reason == StorageReason.NotApplicable and fake.requests == []


def test_unknown_format_is_a_programming_error() -> None:
    with pytest.raises(ValueError):
        verify(FakeS3(), "Lora")


# ---------------------------------------------------------------- verification: failures


def test_missing_index() -> None:
    report = verify(FakeS3())
    assert (report.ok, report.reason, report.transient) == (False, StorageReason.ObjectMissing, False)
    assert URI in report.message


def test_missing_bucket() -> None:
    fake = FakeS3()
    fake.fail[("get", PREFIX + ckpt.INDEX_NAME)] = client_error("NoSuchBucket", 404, "bucket does not exist")
    report = verify(fake)
    assert report.reason == StorageReason.ObjectMissing and URI in report.message and "NoSuchBucket" in report.message


def test_missing_shard_is_named() -> None:
    files = full_files()
    gone = shards(files)[-1]
    del files[gone]
    report = verify(FakeS3(files))
    assert report.reason == StorageReason.ObjectMissing
    assert f"s3://{BUCKET}/{PREFIX}{gone}" in report.message


@pytest.mark.parametrize("cut", [1, 100])
def test_truncated_shard(cut: int) -> None:
    files = full_files()
    shard = shards(files)[0]
    files[shard] = files[shard][:-cut]
    report = verify(FakeS3(files))
    assert report.reason == StorageReason.SizeMismatch and not report.ok
    assert shard in report.message and "truncated" in report.message
    assert str(len(files[shard])) in report.message


def test_shard_cut_inside_its_header() -> None:
    files = full_files()
    shard = shards(files)[0]
    files[shard] = files[shard][:20]
    report = verify(FakeS3(files))
    assert report.reason == StorageReason.SizeMismatch and "header alone needs" in report.message


@pytest.mark.parametrize("data", [b"\x00" * 3, b""])  # an empty object answers a ranged GET with InvalidRange
def test_tiny_shard(data: bytes) -> None:
    files = full_files()
    files[shards(files)[0]] = data
    report = verify(FakeS3(files))
    assert report.reason == StorageReason.SizeMismatch and f"only {len(data)} bytes" in report.message


def test_padded_shard() -> None:
    files = full_files()
    files[shards(files)[0]] += b"\x00" * 8
    report = verify(FakeS3(files))
    assert report.reason == StorageReason.SizeMismatch and "longer" in report.message


def test_total_size_mismatch_names_both_numbers() -> None:
    files = full_files()
    real = json.loads(files[ckpt.INDEX_NAME])["metadata"]["total_size"]
    files = edit_index(files, lambda d: d["metadata"].update(total_size=real + 4))
    report = verify(FakeS3(files))
    assert report.reason == StorageReason.SizeMismatch
    assert str(real) in report.message and str(real + 4) in report.message


def test_corrupt_index_json() -> None:
    files = {**full_files(), ckpt.INDEX_NAME: b'{"metadata": {"total_size": 1}, "weight_map": '}
    report = verify(FakeS3(files))
    assert report.reason == StorageReason.IndexInvalid and "not valid JSON" in report.message
    assert URI in report.message


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda d: d["weight_map"].update({"layer.0.weight": "../escape.safetensors"}), "plain"),
        (lambda d: d["weight_map"].update({"layer.0.weight": "/etc/x.safetensors"}), "plain"),
        (lambda d: d.pop("weight_map"), "weight_map"),
        (lambda d: d["metadata"].update(checksum_format="md5"), "checksum_format"),
    ],
)
def test_invalid_full_index(change: Callable[[dict], None], match: str) -> None:
    report = verify(FakeS3(edit_index(full_files(), change)))
    assert report.reason == StorageReason.IndexInvalid and match in report.message


def test_delta_metadata_must_match_the_weight_version() -> None:
    fake = FakeS3(delta_files(version="v2", base_version="v1"))
    report = verify(fake, "XorDelta", version="v3", base_version="v1")
    assert report.reason == StorageReason.IndexInvalid and "'v2', expected 'v3'" in report.message
    report = verify(fake, "XorDelta", version="v2", base_version="v0")
    assert report.reason == StorageReason.IndexInvalid and "base_version is 'v1', expected 'v0'" in report.message


def test_format_and_index_kind_must_agree() -> None:
    report = verify(FakeS3(full_files()), "XorDelta")
    assert report.reason == StorageReason.IndexInvalid and "full checkpoint" in report.message
    report = verify(FakeS3(delta_files()), "FullCheckpoint")
    assert report.reason == StorageReason.IndexInvalid and "XorDelta index" in report.message


def test_delta_with_wrong_encoding() -> None:
    files = edit_index(delta_files(), lambda d: d["metadata"].update(compression_format="gzip"))
    report = verify(FakeS3(files), "XorDelta")
    assert report.reason == StorageReason.IndexInvalid and "compression_format" in report.message


def test_index_names_a_tensor_its_shard_lacks() -> None:
    files = edit_index(full_files(), lambda d: d["weight_map"].update(ghost="model-00001-of-00003.safetensors"))
    report = verify(FakeS3(files))
    assert report.reason == StorageReason.IndexInvalid and "lacks" in report.message and "ghost" in report.message


def test_shard_holds_a_tensor_the_index_does_not_list() -> None:
    files = edit_index(full_files(), lambda d: d["weight_map"].pop("layer.0.weight"))
    report = verify(FakeS3(files))
    assert report.reason == StorageReason.IndexInvalid and "not in the index" in report.message


def test_shard_without_checksums() -> None:
    files = {"model-00001-of-00001.safetensors": save({"w": np.zeros(4, np.float32)})}
    files[ckpt.INDEX_NAME] = json.dumps(
        {
            "metadata": {"total_size": 16, "checksum_format": "adler32"},
            "weight_map": {"w": "model-00001-of-00001.safetensors"},
        }
    ).encode()
    report = verify(FakeS3(files))
    assert report.reason == StorageReason.IndexInvalid and "checksum" in report.message
    # Without checksum_format (a plain Hugging Face index) too: the agent checks every tensor's adler32, so a
    # checkpoint without them is not Ready (it would be refused on every node).
    files = edit_index(files, lambda d: d["metadata"].pop("checksum_format"))
    report = verify(FakeS3(files))
    assert report.reason == StorageReason.IndexInvalid and "for tensors ['w'] (rule checksum)" in report.message


def test_malformed_shard_header() -> None:
    files = full_files()
    shard = shards(files)[0]
    files[shard] = struct.pack("<Q", 4) + b"nope" + b"\x00" * 100
    report = verify(FakeS3(files))
    assert report.reason == StorageReason.IndexInvalid and "malformed header" in report.message


def test_oversized_index_is_refused_unread() -> None:
    fake = FakeS3({ckpt.INDEX_NAME: b" " * 10})
    real_get = fake.get_object

    def huge(**kw: Any) -> dict[str, Any]:
        response = real_get(**kw)
        return {**response, "ContentLength": 1 << 30}

    fake.get_object = huge  # type: ignore[method-assign]
    report = verify(fake)
    assert report.reason == StorageReason.IndexInvalid and "too big" in report.message


@pytest.mark.parametrize("uri", ["s3://x", "s3://bucket/m/../model.safetensors.index.json"])
def test_invalid_uri(uri: str) -> None:
    """Refused before any request: a `..` key would otherwise reach S3 and come back as a signature mismatch."""
    report = verify(FakeS3(), uri=uri)
    assert report.reason == StorageReason.UriInvalid and "spec.storage.uri" in report.message
    assert not report.transient


@pytest.mark.parametrize(
    ("error", "reason", "transient"),
    [
        (client_error("AccessDenied", 403), StorageReason.AccessDenied, False),
        (client_error("403", 403), StorageReason.AccessDenied, False),
        (client_error("InvalidAccessKeyId", 403), StorageReason.AccessDenied, False),
        (client_error("SignatureDoesNotMatch", 403), StorageReason.AccessDenied, False),
        (client_error("InternalError", 500), StorageReason.EndpointUnreachable, True),
        (client_error("SlowDown", 503), StorageReason.EndpointUnreachable, True),
        (EndpointConnectionError(endpoint_url="http://127.0.0.1:1"), StorageReason.EndpointUnreachable, True),
        (ReadTimeoutError(endpoint_url="http://127.0.0.1:1"), StorageReason.EndpointUnreachable, True),
        (NoCredentialsError(), StorageReason.CredentialsMissing, False),
    ],
)
def test_error_classification(error: Exception, reason: StorageReason, transient: bool) -> None:
    files = full_files()
    for target in (PREFIX + ckpt.INDEX_NAME, PREFIX + shards(files)[0]):
        fake = FakeS3(files)
        fake.fail[("head", target)] = fake.fail[("get", target)] = error
        report = verify(fake)
        assert (report.ok, report.reason, report.transient) == (False, reason, transient)
        assert f"s3://{BUCKET}/{target}" in report.message


def test_connection_dropped_while_reading_a_body_is_transient() -> None:
    fake = FakeS3(full_files())
    fake.body_fail[PREFIX + ckpt.INDEX_NAME] = ResponseStreamingError(error="connection reset")
    report = verify(fake)
    assert report.reason == StorageReason.EndpointUnreachable and report.transient


class BarrierS3(FakeS3):
    """Each shard header GET waits until all of them are under way: only concurrent reads get through."""

    def __init__(self, files: dict[str, bytes]) -> None:
        super().__init__(files)
        self.barrier = threading.Barrier(len(shards(files)), timeout=10)

    def get_object(self, *, Bucket: str, Key: str, Range: str | None = None) -> dict[str, Any]:
        if not Key.endswith(ckpt.INDEX_NAME):
            self.barrier.wait()
        return super().get_object(Bucket=Bucket, Key=Key, Range=Range)


def test_the_operator_reads_all_shard_headers_at_once(driver: str) -> None:
    files = full_files()
    if driver == "asyncio":  # every shard header GET waits until all are under way
        barrier = asyncio.Barrier(len(shards(files)))

        class BarrierClient(AsyncClient):
            async def get_object(self, **kw: Any) -> dict[str, Any]:
                if not kw["Key"].endswith(ckpt.INDEX_NAME):
                    await asyncio.wait_for(barrier.wait(), 10)
                return await super().get_object(**kw)

        async def scenario() -> StorageReport:
            uri = URI
            return await verify_checkpoint_async(
                BarrierClient(FakeS3(files)), uri, fmt="FullCheckpoint", version="v1", base_version=None
            )

        report = asyncio.run(scenario())
        assert report.ok and report.shard_count == len(shards(files))
        return
    assert len(shards(files)) > 2
    report = verify(BarrierS3(files), map_shards=verification._map_shards)
    assert report.ok and report.shard_count == len(shards(files))


def test_read_at_once_the_first_failing_shard_in_index_order_is_named() -> None:
    files = full_files()
    first, *_, last = shards(files)
    del files[first], files[last]
    report = verify(FakeS3(files), map_shards=verification._map_shards)
    assert report.reason == StorageReason.ObjectMissing
    assert f"s3://{BUCKET}/{PREFIX}{first}" in report.message and last not in report.message
