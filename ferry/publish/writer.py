"""Immutable writes to S3: every object is PUT with `If-None-Match: *`, an existing object is compared, and
nothing is ever overwritten."""

from __future__ import annotations

import contextlib
import hashlib
import math
import re
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from botocore.exceptions import ClientError

from ferry import checkpoint_format as ckpt
from ferry import s3
from ferry.publish.errors import ImmutableConflict
from ferry.publish.progress_bar import ProgressBar

MiB = 1 << 20
DEFAULT_MULTIPART_THRESHOLD = 64 * MiB
MIN_PART_BYTES = 5 * MiB  # S3's minimum for every part but the last
MAX_PARTS = 10_000
COMPARE_CHUNK = 8 * MiB
_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """`64MiB`, `4GiB`, `5MB`, `1000` → bytes."""
    match = _SIZE.fullmatch(text)
    if not match:
        raise ValueError(f"{text!r} is not a size such as 64MiB, 4GiB or 1000000")
    unit = (match.group(2) or "b").lower().rstrip("b")
    if not unit:
        return int(match.group(1))
    power = "kmgt".index(unit[0]) + 1
    return int(match.group(1)) * ((1024 if unit.endswith("i") else 1000) ** power)


@dataclass
class ImmutableWriter:
    """Writes objects under one prefix, never overwriting: a conflicting existing object is an error."""

    client: Any
    bucket: str
    prefix: str
    multipart_threshold: int = DEFAULT_MULTIPART_THRESHOLD
    workers: int = 8
    progress: ProgressBar | None = None

    def uri(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.prefix}{name}"

    def part_size(self, size: int) -> int:
        return max(MIN_PART_BYTES, self.multipart_threshold, math.ceil(size / MAX_PARTS))

    def put(self, name: str, data: bytes) -> bool:
        """True if written, False if an identical object was already there (an idempotent retry)."""
        key = self.prefix + name
        # HEAD first: a retry of a big shard then costs a HEAD (plus an ETag check), not a re-upload.
        if self.matches(name, data):
            self._advance(len(data))
            return False
        try:
            if len(data) >= self.multipart_threshold:
                self._multipart(key, data)
            else:
                self.client.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*")
                self._advance(len(data))
        except ClientError as exc:
            if not isinstance(s3.translate(exc, self.uri(name)), s3.PreconditionFailed):
                raise
            # Someone wrote it between our HEAD and PUT (a multipart upload already counted its parts).
            if len(data) < self.multipart_threshold:
                self._advance(len(data))
            if not self.matches(name, data):
                raise self._conflict(name, data) from exc
            return False
        return True

    def matches(self, name: str, data: bytes) -> bool:
        """False if absent, True if present with exactly `data`, ImmutableConflict otherwise."""
        key = self.prefix + name
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if isinstance(s3.translate(exc, self.uri(name)), s3.ObjectMissing):
                return False
            raise
        if head["ContentLength"] != len(data):
            raise self._conflict(name, data, stored=head["ContentLength"])
        if head.get("ETag", "").strip('"') == self._etag(data):
            return True
        body = self.client.get_object(Bucket=self.bucket, Key=key)["Body"]
        view, offset = memoryview(data), 0
        for chunk in body.iter_chunks(COMPARE_CHUNK):
            if view[offset : offset + len(chunk)] != chunk:
                raise self._conflict(name, data)
            offset += len(chunk)
        if offset != len(data):
            raise self._conflict(name, data, stored=offset)
        return True

    def _etag(self, data: bytes) -> str:
        """The S3 ETag our own upload would have had: MD5, or MD5 of the part MD5s plus `-N` for multipart."""
        if len(data) < self.multipart_threshold:
            return hashlib.md5(data, usedforsecurity=False).hexdigest()
        size = self.part_size(len(data))
        digests = [hashlib.md5(data[i : i + size], usedforsecurity=False).digest() for i in range(0, len(data), size)]
        return f"{hashlib.md5(b''.join(digests), usedforsecurity=False).hexdigest()}-{len(digests)}"

    def _multipart(self, key: str, data: bytes) -> None:
        size = self.part_size(len(data))
        upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]

        def part(number: int) -> dict[str, Any]:
            body = data[(number - 1) * size : number * size]
            etag = self.client.upload_part(
                Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number, Body=body
            )["ETag"]
            self._advance(len(body))
            return {"PartNumber": number, "ETag": etag}

        try:
            with ThreadPoolExecutor(max_workers=self.workers) as pool:
                parts = list(pool.map(part, range(1, math.ceil(len(data) / size) + 1)))
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}, IfNoneMatch="*"
            )
        except BaseException:
            # An abandoned upload keeps its parts (and costs storage) until aborted.
            with contextlib.suppress(Exception):
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            raise

    def _advance(self, n: int) -> None:
        if self.progress is not None:
            self.progress.add(n)

    def _conflict(self, name: str, data: bytes, stored: int | None = None) -> ImmutableConflict:
        sizes = f" ({stored} bytes stored, {len(data)} to write)" if stored is not None else ""
        return ImmutableConflict(
            f"{self.uri(name)} already exists with different content{sizes}; published objects are immutable, "
            "so nothing was overwritten: publish under a new version name"
        )


def upload_files(writer: ImmutableWriter, files: Mapping[str, bytes]) -> tuple[list[str], list[str]]:
    """Shards first, the index last. Returns (written, already identical). An index already stored with other
    content stops everything before a single object is written."""
    index = files[ckpt.INDEX_NAME]
    writer.matches(ckpt.INDEX_NAME, index)
    written: list[str] = []
    identical: list[str] = []
    for name in [*sorted(n for n in files if n != ckpt.INDEX_NAME), ckpt.INDEX_NAME]:
        (written if writer.put(name, files[name]) else identical).append(name)
    return written, identical
