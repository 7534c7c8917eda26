"""Purpose-built S3 clients that `bench_s3` measures beside plain boto3, on the same SeaweedFS and checkpoint:

- the Run:ai model streamer (`runai-model-streamer` + `runai-model-streamer-s3`): `SafetensorsStreamer` reading
  the checkpoint's safetensors shards from s3:// into CPU tensors, its C++ reader on the AWS CRT S3 client;
- obstore (Rust `object_store`): parallel ranged GETs into memory, the same shape as the boto3 baseline;
- s3torchconnector (Amazon's S3 connector for PyTorch, on the Mountpoint client over the AWS CRT): whole objects
  read into preallocated memory, the CRT splitting each GET into parallel part requests itself.

They come with the `bench` extra (`pip install -e '.[bench]'`, which `make bench` does) and are never needed by
Ferry itself; `missing` says which are not installed, and the bench skips their rows with that note.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

REGION = "us-east-1"  # SeaweedFS ignores it; the signers need one
# row → (the modules it imports, the distributions that provide them)
REFERENCES: dict[str, tuple[tuple[str, ...], str]] = {
    "runai_streamer": (
        ("runai_model_streamer", "runai_model_streamer_s3"),
        "runai-model-streamer, runai-model-streamer-s3",
    ),
    "obstore": (("obstore",), "obstore"),
    "s3torchconnector": (("s3torchconnector",), "s3torchconnector"),
}


def missing(row: str) -> str | None:
    """Why `row` cannot be measured here (a printable note), or None when its library is installed."""
    modules, dists = REFERENCES[row]
    absent = [m for m in modules if importlib.util.find_spec(m) is None]
    if not absent:
        return None
    return f"{row} skipped: {dists} not installed (`pip install -e '.[bench]'`, as `make bench` does)"


@contextlib.contextmanager
def environment(values: Mapping[str, str]) -> Iterator[None]:
    """`values` in os.environ for the block (the streamer's C++ side reads its settings there), then restored."""
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def runai_streamer_load(
    endpoint: str, credentials: Mapping[str, str], uris: list[str], concurrency: int, chunk_bytes: int
) -> dict[str, Any]:
    """Every tensor of the safetensors shards at `uris`, read by the Run:ai streamer into CPU tensors, configured
    as its docs say for an S3-compatible store (path-style addressing, no instance metadata, custom endpoint),
    with `concurrency` S3 readers and requests of `chunk_bytes` (its default chunk ran at about half the rate on
    the bench's SeaweedFS)."""
    from runai_model_streamer import SafetensorsStreamer
    from runai_model_streamer.s3_utils.s3_utils import S3Credentials

    settings = {
        "RUNAI_STREAMER_CONCURRENCY": str(concurrency),
        "RUNAI_STREAMER_CHUNK_BYTESIZE": str(chunk_bytes),
        "RUNAI_STREAMER_S3_USE_VIRTUAL_ADDRESSING": "0",
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_ENDPOINT_URL": endpoint,
        "RUNAI_STREAMER_LOG_LEVEL": "WARNING",
    }
    creds = S3Credentials(
        access_key_id=credentials["AWS_ACCESS_KEY_ID"],
        secret_access_key=credentials["AWS_SECRET_ACCESS_KEY"],
        region_name=REGION,
        endpoint=endpoint,
    )
    with environment(settings), SafetensorsStreamer() as streamer:
        streamer.stream_files(uris, s3_credentials=creds, device="cpu")
        return dict(streamer.get_tensors())


def obstore_store(endpoint: str, credentials: Mapping[str, str], bucket: str, timeout_s: float) -> Any:
    """An obstore S3Store on `bucket` with the same endpoint, keys and path-style addressing as ferry/s3.py."""
    from obstore.store import S3Store

    return S3Store(
        bucket,
        endpoint=endpoint,
        access_key_id=credentials["AWS_ACCESS_KEY_ID"],
        secret_access_key=credentials["AWS_SECRET_ACCESS_KEY"],
        region=REGION,
        virtual_hosted_style_request=False,
        client_options={"allow_http": endpoint.startswith("http://"), "timeout": f"{int(timeout_s)}s"},
    )


def obstore_ranged_gets(store: Any, objects: dict[str, int], workers: int, range_bytes: int) -> dict[str, bytearray]:
    """The obstore counterpart of the boto3 baseline: the same ranged GETs on `workers` threads (obstore's
    blocking calls release the GIL), each range copied once from obstore's buffer into preallocated memory."""
    import obstore

    buffers = {key: bytearray(size) for key, size in objects.items()}

    def fetch(key: str, begin: int, end: int) -> None:
        data = obstore.get_range(store, key, start=begin, end=end)
        memoryview(buffers[key])[begin:end] = memoryview(data)

    jobs = [(k, b, min(b + range_bytes, size)) for k, size in objects.items() for b in range(0, size, range_bytes)]
    with ThreadPoolExecutor(workers) as pool:
        for future in [pool.submit(fetch, *job) for job in jobs]:
            future.result()
    return buffers


def crt_environment(endpoint: str, credentials: Mapping[str, str]) -> dict[str, str]:
    """What the CRT client needs in os.environ: it takes static keys only from there."""
    return {**credentials, "AWS_ENDPOINT_URL": endpoint, "AWS_EC2_METADATA_DISABLED": "true", "AWS_REGION": REGION}


def s3torchconnector_client(endpoint: str, credentials: Mapping[str, str], part_bytes: int) -> Any:
    """An s3torchconnector client on `endpoint`, path-style (as ferry/s3.py), with requests of `part_bytes`."""
    from s3torchconnector._s3client import S3Client, S3ClientConfig

    with environment(crt_environment(endpoint, credentials)):
        return S3Client(
            REGION, endpoint=endpoint, s3client_config=S3ClientConfig(force_path_style=True, part_size=part_bytes)
        )


def s3torchconnector_load(
    client: Any, endpoint: str, credentials: Mapping[str, str], bucket: str, objects: dict[str, int], workers: int
) -> dict[str, bytearray]:
    """Every object read whole into preallocated memory (`readinto`), the objects on `workers` threads; the CRT
    fetches each one's parts in parallel."""
    from s3torchconnector import S3ReaderConstructor

    buffers = {key: bytearray(size) for key, size in objects.items()}

    def fetch(key: str) -> None:
        reader = client.get_object(bucket, key, reader_constructor=S3ReaderConstructor.sequential())
        if reader.readinto(buffers[key]) != objects[key]:
            raise OSError(f"s3torchconnector read a short {key}")

    with environment(crt_environment(endpoint, credentials)), ThreadPoolExecutor(workers) as pool:
        for future in [pool.submit(fetch, key) for key in objects]:
            future.result()
    return buffers
