"""`ferry publish`: write a full checkpoint or an XOR delta to S3 in the canonical format, then apply its
WeightVersion (docs/checkpoint-format.md; docs/publish.md).

- The objects are built by `ferry.checkpoint_format`, so the operator and the agents read exactly what the
  trainer wrote (`weights`).
- Writes are immutable (`writer`): every object is PUT with `If-None-Match: *` (SeaweedFS honours it on PutObject
  and on CompleteMultipartUpload and answers 412). An existing object is compared: identical content is an
  idempotent retry, different content is an `ImmutableConflict` and nothing is overwritten.
- Shards go first and the index last, so a reader never finds an index whose shards are missing. If the index
  already exists with other content, the publish stops before writing anything.
- A delta's base comes from `base_dir` or is rebuilt from S3 by replaying the base's chain (`base`).
- The WeightVersion is applied and waited on through the Kubernetes API (`kube`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from botocore.exceptions import BotoCoreError, ClientError

from ferry import checkpoint_format as ckpt
from ferry import s3
from ferry.api.models import WeightFormat, is_object_name
from ferry.kube import kube_client
from ferry.publish.base import replay_base
from ferry.publish.errors import (
    ImmutableConflict,
    InvalidPublish,
    PublishError,
    PublishNotFound,
    publish_error,
)
from ferry.publish.kube import (
    apply_weight_version,
    check_credentials_secret,
    check_existing,
    kube_errors,
    read_weight_version,
    wait_ready,
    weight_version_body,
)
from ferry.publish.progress_bar import ProgressBar
from ferry.publish.weights import DEFAULT_SHARD_BYTES, build_files, load_weights
from ferry.publish.writer import DEFAULT_MULTIPART_THRESHOLD, ImmutableWriter, parse_size, upload_files

__all__ = [
    "DEFAULT_MULTIPART_THRESHOLD",
    "DEFAULT_SHARD_BYTES",
    "ImmutableConflict",
    "PublishError",
    "PublishOptions",
    "PublishResult",
    "index_uri",
    "parse_size",
    "publish",
]


def index_uri(uri_prefix: str, version: str) -> str:
    """Where `version`'s index goes under `--uri-prefix`: `<prefix>/<version>/model.safetensors.index.json`."""
    try:
        bucket, key = s3.parse_s3_prefix(uri_prefix)
    except s3.InvalidUri as exc:
        raise InvalidPublish(f"--uri-prefix {exc}") from exc
    return f"s3://{bucket}/{key}{version}/{ckpt.INDEX_NAME}"


@dataclass(frozen=True)
class PublishOptions:
    source: Path
    version: str
    uri_prefix: str
    model: str | None = None
    base: str | None = None
    base_dir: Path | None = None
    layout_signature: str | None = None
    endpoint: str | None = None
    region: str | None = None
    credentials_secret: str | None = None
    namespace: str = "default"
    kubeconfig: str | None = None
    apply: bool = True
    wait: bool = False
    wait_timeout: float = 300.0
    shard_bytes: int = DEFAULT_SHARD_BYTES
    multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD
    workers: int = 8


@dataclass
class PublishResult:
    uri: str
    format: str
    written: list[str] = field(default_factory=list)
    identical: list[str] = field(default_factory=list)
    stored_bytes: int = 0
    weight_version: str | None = None  # "created" | "unchanged" | None with --no-apply


def _validate(opts: PublishOptions) -> None:
    for what, name in (("--version", opts.version), ("--base", opts.base)):
        if name is not None and not is_object_name(name):
            raise InvalidPublish(f"{what} {name!r} is not a valid object name (lowercase DNS subdomain)")
    if opts.base == opts.version:
        raise InvalidPublish(f"a version cannot be its own base ({opts.version!r})")
    if opts.base_dir is not None and opts.base is None:
        raise InvalidPublish("--base-dir needs --base (the version those weights are)")
    if opts.apply and not opts.model:
        raise InvalidPublish("--model is required to apply the WeightVersion (or pass --no-apply)")
    if opts.wait and not opts.apply:
        raise InvalidPublish("--wait needs the WeightVersion to be applied (drop --no-apply)")
    if opts.shard_bytes <= 0 or opts.multipart_threshold <= 0 or opts.workers <= 0:
        raise InvalidPublish("--shard-size, --multipart-threshold and --workers must be positive")


def _base_locator(opts: PublishOptions, api: Any | None) -> Callable[[str], str]:
    """Where a chain version's index lives: its WeightVersion's storage.uri, or with --no-apply the layout
    `<uri-prefix>/<version>/` this command writes."""
    if api is None:
        return lambda version: index_uri(opts.uri_prefix, version)

    def locate(version: str) -> str:
        with kube_errors(f"reading WeightVersion {opts.namespace}/{version}"):
            wv = read_weight_version(api, opts.namespace, version)
        if wv is None:
            raise PublishNotFound(f"base WeightVersion {opts.namespace}/{version} not found; pass --base-dir")
        spec = wv.get("spec") or {}
        if version == opts.base and spec.get("modelName") != opts.model:
            raise InvalidPublish(
                f"base {version!r} is a version of model {spec.get('modelName')!r}, not {opts.model!r}"
            )
        uri = (spec.get("storage") or {}).get("uri")
        if not uri:
            raise InvalidPublish(
                f"base WeightVersion {version!r} has no storage ({spec.get('format')}); pass --base-dir"
            )
        return uri

    return locate


def publish(opts: PublishOptions, *, progress: TextIO | None = None) -> PublishResult:
    """Validate, build, upload (index last), then apply and optionally wait. Raises PublishError. `progress`:
    where the upload progress line goes (the CLI passes stderr)."""
    _validate(opts)
    uri = index_uri(opts.uri_prefix, opts.version)
    bucket, key_prefix = s3.parse_s3_prefix(uri.rsplit("/", 1)[0])
    body = None
    api = None
    if opts.apply:
        body = weight_version_body(
            name=opts.version,
            model=opts.model or "",
            base_version=opts.base,
            uri=uri,
            endpoint=opts.endpoint,
            region=opts.region,
            credentials_secret=opts.credentials_secret,
            layout_signature=opts.layout_signature,
        )
        with kube_errors("checking the WeightVersion before the upload"):
            api = kube_client(opts.kubeconfig)
            existing = read_weight_version(api, opts.namespace, opts.version)
        # Fail before uploading anything if the version name is already taken by a different spec.
        check_existing(existing, body, opts.namespace)
        if opts.credentials_secret:
            with kube_errors(f"checking Secret {opts.namespace}/{opts.credentials_secret}"):
                check_credentials_secret(api, opts.namespace, opts.credentials_secret)
    client = s3.new_client(opts.endpoint, opts.region, None, s3.publishing())  # the environment's credentials, now
    try:
        weights = load_weights(opts.source)
        base = None
        if opts.base is not None:
            locate = _base_locator(opts, api)
            base_weights = load_weights(opts.base_dir) if opts.base_dir else replay_base(client, opts.base, locate)
            base = (opts.base, base_weights)
        files = build_files(weights, version=opts.version, shard_bytes=opts.shard_bytes, base=base)
        total = sum(len(d) for d in files.values())
        bar = ProgressBar(f"uploading {opts.version}", total, progress)
        writer = ImmutableWriter(client, bucket, key_prefix, opts.multipart_threshold, opts.workers, bar)
        try:
            written, identical = upload_files(writer, files)
        finally:
            bar.close()
    except (BotoCoreError, ClientError) as exc:
        raise publish_error(s3.translate(exc, uri), f"S3 request failed: {exc}") from exc
    result = PublishResult(
        uri=uri,
        format=WeightFormat.XOR_DELTA if opts.base else WeightFormat.FULL_CHECKPOINT,
        written=written,
        identical=identical,
        stored_bytes=total,
    )
    if api is not None and body is not None:
        with kube_errors(f"applying WeightVersion {opts.namespace}/{opts.version}"):
            created = apply_weight_version(api, opts.namespace, body)
            result.weight_version = "created" if created else "unchanged"
            if opts.wait:
                wait_ready(api, opts.namespace, opts.version, opts.wait_timeout, created=created)
    return result
