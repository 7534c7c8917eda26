"""The canonical on-S3 checkpoint format, shared by the publisher, the operator's verifier and the agent.

It is ModelExpress's canonical format (docs/checkpoint-format.md), so checkpoints
interoperate:

- a full checkpoint is a Hugging Face style sharded safetensors checkpoint:
  `model-00001-of-0000N.safetensors` shards, each with `__metadata__ = {tensor_name: adler32_hex(raw bytes)}`,
  and `model.safetensors.index.json` =
  `{"metadata": {"total_size", "checksum_format": "adler32"}, "weight_map": {tensor: shard}}`;
- an XOR delta stores, per changed tensor, one zstd (level 1) frame of `base_bytes ^ new_bytes` as a 1-D
  uint8 tensor, with `__metadata__` holding the adler32 of the *new* full bytes; unchanged tensors are
  omitted. Its index metadata is exactly `{"version", "base_version", "delta_encoding": "xor",
  "compression_format": "zstd", "checksum_format": "adler32"}` plus Ferry's `total_size` (stored bytes).

Shards always sit beside the index; shard names are plain file names (no paths), so an index cannot point
outside its folder. See docs/checkpoint-format.md.

`parse_index` and `check_shard` are the one validation of indexes and shard headers: the operator's verification
(`ferry.storage`) and the agent's load (`ObjectStorage` plan) both call them, so what the operator marks Ready the
agent can load. Each refusal names the shard's tensor and the `Rule` it breaks.
"""

from __future__ import annotations

import json
import re
import struct
import threading
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import zstandard
from safetensors.numpy import save
from zlib_ng import zlib_ng  # zlib's adler32, vectorised: 5 to 10x the stock zlib's on every tensor checked

from ferry.errors import IntegrityError

INDEX_NAME = "model.safetensors.index.json"
SAFE_SHARD = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\.safetensors$")  # use with fullmatch: `$` allows a trailing \n
METADATA_KEY = "__metadata__"
CHECKSUM_FORMAT = "adler32"
DELTA_ENCODING = "xor"
# A delta whose tensors are XOR frames or sparse patches (`SparsePatch`), chosen per tensor: format version 2. An
# index of it says so in `delta_encoding` and `format_version`, so a reader of version 1 (and ModelExpress) refuses
# it by name instead of misreading a patch as an XOR frame.
SPARSE_DELTA_ENCODING = "xor+sparse"
FORMAT_VERSION = 2  # the newest delta format this code reads and writes (1: XOR frames only, no format_version)
COMPRESSION_FORMATS = frozenset({"zstd"})
ZSTD_LEVEL = 1
HEADER_PREFIX_BYTES = 8  # little-endian u64 header length
XOR_CHUNK_BYTES = 1 << 20  # streamed delta decoding works in blocks of this size (in cache: decode, XOR, adler32)
_CHECKSUM = re.compile(r"^[0-9a-f]{8}$")
MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit
DELTA_METADATA_KEYS = frozenset(
    {
        "version",
        "base_version",
        "delta_encoding",
        "compression_format",
        "checksum_format",
        "total_size",
        "format_version",
    }
)

# Byte width per element of every dtype Ferry loads: fixed-width ones, each with a torch dtype (`TORCH_DTYPES`). A
# shard with any other (F128, sub-byte F4, ...) is refused.
DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "U16": 2,
    "I16": 2,
    "F16": 2,
    "BF16": 2,
    "U32": 4,
    "I32": 4,
    "F32": 4,
    "U64": 8,
    "I64": 8,
    "F64": 8,
    "C64": 8,
}

# safetensors dtype → numpy dtype. Dtypes numpy lacks travel as same-width unsigned "carriers" (`CARRIERS`); their
# real name is written into the shard header (`canonical_shard`), since the builders only know numpy arrays.
NUMPY_DTYPES: dict[str, type[np.generic]] = {
    "BOOL": np.bool_,
    "U8": np.uint8,
    "I8": np.int8,
    "U16": np.uint16,
    "I16": np.int16,
    "F16": np.float16,
    "U32": np.uint32,
    "I32": np.int32,
    "F32": np.float32,
    "U64": np.uint64,
    "I64": np.int64,
    "F64": np.float64,
    "C64": np.complex64,
}
CARRIERS: dict[str, type[np.generic]] = {
    "BF16": np.uint16,
    "F8_E4M3": np.uint8,
    "F8_E5M2": np.uint8,
    "F8_E8M0": np.uint8,
}
# safetensors dtype → torch dtype name (`getattr(torch, name)`), as names: the operator runs without torch.
TORCH_DTYPES: dict[str, str] = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu",
    "U16": "uint16",
    "I16": "int16",
    "F16": "float16",
    "BF16": "bfloat16",
    "U32": "uint32",
    "I32": "int32",
    "F32": "float32",
    "U64": "uint64",
    "I64": "int64",
    "F64": "float64",
    "C64": "complex64",
}


class Rule(StrEnum):
    """The rules of a checkpoint's shard headers (docs/checkpoint-format.md); a refusal names the one broken."""

    HEADER = "header"  # 8 bytes of length, then at most MAX_HEADER_BYTES of JSON: an object
    ENTRY = "entry"  # a tensor's entry is an object of dtype, shape and data_offsets
    DTYPE_KNOWN = "dtype-known"  # the dtype is one of the fixed-width dtypes Ferry loads (DTYPE_SIZES)
    SHAPE = "shape"  # a list of non-negative integers
    OFFSETS = "data-offsets"  # [begin, end], non-negative integers, end not before begin
    SIZE_MATCHES_SHAPE = "size-matches-shape"  # the shape's elements times the dtype's width: end - begin
    OFFSETS_DISJOINT = "offsets-disjoint"  # no two tensors share a byte
    OFFSETS_CONTIGUOUS = "offsets-contiguous"  # the tensors tile the data from byte 0, no gap (as safetensors)
    NAME_UNIQUE = "name-unique"  # a name appears once in a header (and in an index's weight_map)
    DELTA_FRAME = "delta-frame"  # a delta stores each tensor as a 1-D U8 zstd frame
    SHARD_SIZE = "shard-size"  # the shard is exactly as long as its header describes
    INDEX_MATCHES = "index-matches-header"  # a shard holds exactly the tensors its index maps to it
    CHECKSUM = "checksum"  # every tensor has its adler32 (8 lowercase hex digits) in __metadata__


# Rules whose message completes "shard X …" on its own; the others are faults of the header's content.
_SHARD_SENTENCES = frozenset({Rule.SHARD_SIZE, Rule.INDEX_MATCHES, Rule.CHECKSUM})


class InvalidIndex(IntegrityError, ValueError):
    """The index JSON is not a canonical Ferry/ModelExpress index; the message says precisely why."""


class InvalidShard(IntegrityError, ValueError):
    """A shard breaks a `Rule`; the message names it (and the tensor, `tensor`, where one is at fault)."""

    def __init__(self, message: str, rule: Rule = Rule.HEADER, tensor: str | None = None) -> None:
        super().__init__(f"{message} (rule {rule})")
        self.rule = rule
        self.tensor = tensor

    def describe(self, shard: str) -> str:
        """The refusal as a sentence about `shard` (its URI or path), the same for the operator and the agent."""
        return (
            f"shard {shard} {self}"
            if self.rule in _SHARD_SENTENCES
            else f"shard {shard} has a malformed header: {self}"
        )


class _Duplicate(ValueError):
    pass


def _unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """json object_pairs_hook: a JSON object naming a key twice is refused (json.loads keeps the last silently)."""
    found: dict[str, Any] = {}
    for key, value in pairs:
        if key in found:
            raise _Duplicate(key)
        found[key] = value
    return found


def adler32(data: bytes | bytearray | memoryview | np.ndarray, value: int = 1) -> int:
    """zlib's adler32 (continuing from `value`), from zlib-ng: the same function, vectorised."""
    return zlib_ng.adler32(data, value) & 0xFFFFFFFF


def adler32_hex(data: bytes | bytearray | memoryview | np.ndarray) -> str:
    return f"{adler32(data):08x}"


def is_safe_shard_name(name: object) -> bool:
    return isinstance(name, str) and SAFE_SHARD.fullmatch(name) is not None


def full_shard_name(number: int, total: int) -> str:
    """Full-checkpoint shards are numbered from 1, as Hugging Face does."""
    return f"model-{number:05d}-of-{total:05d}.safetensors"


def delta_shard_name(offset: int, total: int) -> str:
    """Delta shards are numbered from 0 (ModelExpress numbers them among the ranks that have changes)."""
    return f"model-{offset:05d}-of-{total:05d}.safetensors"


def _raw(array: np.ndarray) -> np.ndarray:
    """The tensor's bytes as a flat uint8 view (C order), without copying a contiguous array."""
    return np.ascontiguousarray(array).reshape(-1).view(np.uint8)


# ---------------------------------------------------------------- safetensors headers


def header_length(prefix: bytes | bytearray | memoryview) -> int:
    """The JSON header length from a shard's first 8 bytes."""
    if len(prefix) < HEADER_PREFIX_BYTES:
        raise InvalidShard(
            f"a safetensors file starts with {HEADER_PREFIX_BYTES} bytes of header length, got {len(prefix)}"
        )
    (length,) = struct.unpack("<Q", bytes(prefix[:HEADER_PREFIX_BYTES]))
    if length > MAX_HEADER_BYTES:
        raise InvalidShard(f"safetensors header claims {length} bytes, more than the {MAX_HEADER_BYTES} allowed")
    return length


def parse_safetensors_header(first_bytes: bytes | bytearray | memoryview) -> tuple[int, dict[str, Any]]:
    """(header_len, header) from the start of a shard; `first_bytes` must hold 8 + header_len bytes."""
    length = header_length(first_bytes)
    end = HEADER_PREFIX_BYTES + length
    if len(first_bytes) < end:
        raise InvalidShard(f"need {end} bytes to read the safetensors header, got {len(first_bytes)}")
    try:
        header = json.loads(bytes(first_bytes[HEADER_PREFIX_BYTES:end]), object_pairs_hook=_unique_pairs)
    except _Duplicate as exc:
        raise InvalidShard(f"{exc.args[0]!r} appears twice in one object of the header", Rule.NAME_UNIQUE) from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidShard(f"safetensors header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise InvalidShard("safetensors header is not a JSON object")
    return length, header


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    begin: int  # offsets relative to the end of the header
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def tensor_infos(header: Mapping[str, Any]) -> dict[str, TensorInfo]:
    """The validated tensor entries of a parsed header (everything except `__metadata__`): each entry well formed,
    of a known dtype, as long as its shape says, and together tiling the data without overlap or gap."""
    infos: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        if name == METADATA_KEY:
            continue
        if not isinstance(entry, dict):
            raise InvalidShard(f"tensor {name!r}: header entry is not an object", Rule.ENTRY, name)
        dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if not isinstance(dtype, str):
            raise InvalidShard(f"tensor {name!r}: dtype is missing", Rule.ENTRY, name)
        if dtype not in DTYPE_SIZES:
            raise InvalidShard(
                f"tensor {name!r}: dtype {dtype!r} is not one of the fixed-width dtypes Ferry loads "
                f"({', '.join(DTYPE_SIZES)})",
                Rule.DTYPE_KNOWN,
                name,
            )
        if not isinstance(shape, list) or not all(_is_int(d) for d in shape):
            raise InvalidShard(
                f"tensor {name!r}: shape {shape!r} is not a list of non-negative integers", Rule.SHAPE, name
            )
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise InvalidShard(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end]", Rule.OFFSETS, name)
        begin, end = offsets
        if end < begin:
            raise InvalidShard(f"tensor {name!r}: data_offsets end {end} is before begin {begin}", Rule.OFFSETS, name)
        expected = DTYPE_SIZES[dtype] * int(np.prod(shape, dtype=np.int64))
        if expected != end - begin:
            raise InvalidShard(
                f"tensor {name!r}: {dtype}{shape} needs {expected} bytes but data_offsets span {end - begin}",
                Rule.SIZE_MATCHES_SHAPE,
                name,
            )
        infos[name] = TensorInfo(dtype, tuple(shape), begin, end)
    _check_tiling(infos)
    return infos


def _check_tiling(infos: Mapping[str, TensorInfo]) -> None:
    """The tensors' bytes tile the data from byte 0: in offset order, each begins where the one before it ends.
    Overlapping tensors would alias each other's bytes; a gap hides bytes no tensor (nor checksum) covers."""
    last, covered = None, 0  # the tensor ending furthest so far, and where
    for name, info in sorted(infos.items(), key=lambda item: (item[1].begin, item[1].end, item[0])):
        if info.begin < covered:
            raise InvalidShard(
                f"tensor {name!r}: data_offsets [{info.begin}, {info.end}] overlap tensor {last!r}'s "
                f"[{infos[last].begin}, {infos[last].end}]",
                Rule.OFFSETS_DISJOINT,
                name,
            )
        if info.begin > covered:
            before = f"tensor {last!r} ends" if last is not None else "the data starts"
            raise InvalidShard(
                f"tensor {name!r}: data_offsets begin at {info.begin} but {before} at {covered}: bytes "
                f"[{covered}, {info.begin}] belong to no tensor",
                Rule.OFFSETS_CONTIGUOUS,
                name,
            )
        if info.end > covered or last is None:
            last, covered = name, info.end


def data_length(infos: Mapping[str, TensorInfo]) -> int:
    """Bytes of tensor data after the header: a well-formed shard is exactly 8 + header_len + this long."""
    return max((info.end for info in infos.values()), default=0)


def shard_checksums(header: Mapping[str, Any]) -> dict[str, str]:
    metadata = header.get(METADATA_KEY) or {}
    if not isinstance(metadata, dict):
        raise InvalidShard("safetensors __metadata__ is not an object")
    return {k: v for k, v in metadata.items() if isinstance(v, str)}


@dataclass(frozen=True)
class ShardLayout:
    """A shard's checked safetensors header: where each tensor's bytes are, and their checksums."""

    header_len: int
    infos: dict[str, TensorInfo]
    checksums: dict[str, str]

    @property
    def data_start(self) -> int:
        """File offset of the tensor data (TensorInfo offsets are relative to it)."""
        return HEADER_PREFIX_BYTES + self.header_len

    @property
    def size(self) -> int:
        """The exact file size the header describes."""
        return self.data_start + data_length(self.infos)


def check_shard(
    first_bytes: bytes | bytearray | memoryview, size: int, expected: Collection[str], *, delta: bool = False
) -> ShardLayout:
    """Parse a shard's header (`first_bytes` holds at least 8 + header_len bytes) and check it against every `Rule`:
    the shard's file size, the tensors its index maps to it (`expected`), their checksums, and for a `delta` that
    each is a zstd frame. InvalidShard's `describe` makes the refusal a sentence about the shard."""
    header_len, header = parse_safetensors_header(first_bytes)
    infos = tensor_infos(header)
    layout = ShardLayout(header_len, infos, shard_checksums(header))
    if size != layout.size:
        state = "truncated" if size < layout.size else "longer than its header describes"
        raise InvalidShard(f"is {size} bytes but its header describes {layout.size}; it is {state}", Rule.SHARD_SIZE)
    missing, extra = sorted(set(expected) - infos.keys()), sorted(infos.keys() - set(expected))
    if missing:
        raise InvalidShard(f"lacks tensors the index maps to it: {_some(missing)}", Rule.INDEX_MATCHES, missing[0])
    if extra:
        raise InvalidShard(f"holds tensors not in the index: {_some(extra)}", Rule.INDEX_MATCHES, extra[0])
    bad = sorted(name for name in infos if not _CHECKSUM.fullmatch(layout.checksums.get(name, "")))
    if bad:
        raise InvalidShard(
            f"has no valid adler32 checksum (8 lowercase hex digits) for tensors {_some(bad)}", Rule.CHECKSUM, bad[0]
        )
    if delta:
        for name, info in infos.items():
            if info.dtype != "U8" or len(info.shape) != 1:
                raise InvalidShard(
                    f"tensor {name!r}: a delta stores it as {info.dtype}{list(info.shape)}, not as a 1-D U8 zstd frame",
                    Rule.DELTA_FRAME,
                    name,
                )
    return layout


def _some(names: list[str], limit: int = 5) -> str:
    """The first names of a list, so that a refusal of a whole checkpoint fits a condition's message."""
    return str(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


# ---------------------------------------------------------------- index


@dataclass(frozen=True)
class CheckpointIndex:
    metadata: dict[str, Any]
    weight_map: dict[str, str]  # tensor name → shard file name

    @property
    def is_delta(self) -> bool:
        return "delta_encoding" in self.metadata

    @property
    def shards(self) -> tuple[str, ...]:
        return tuple(sorted(set(self.weight_map.values())))

    def tensors_in(self, shard: str) -> set[str]:
        return {name for name, where in self.weight_map.items() if where == shard}


def parse_index(raw: bytes | str) -> CheckpointIndex:
    """Parse and structurally validate an index (full or delta); raises InvalidIndex with a precise reason."""
    try:
        doc = json.loads(raw, object_pairs_hook=_unique_pairs)
    except _Duplicate as exc:
        raise InvalidIndex(f"{exc.args[0]!r} appears twice in one object (rule {Rule.NAME_UNIQUE})") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidIndex(f"not valid JSON ({exc})") from exc
    if not isinstance(doc, dict):
        raise InvalidIndex("the top level is not a JSON object")
    metadata, weight_map = doc.get("metadata"), doc.get("weight_map")
    if not isinstance(metadata, dict):
        raise InvalidIndex('"metadata" is missing or not an object')
    if not isinstance(weight_map, dict):
        raise InvalidIndex('"weight_map" is missing or not an object')
    for tensor, shard in weight_map.items():
        if not tensor:
            raise InvalidIndex("weight_map has an empty tensor name")
        if not is_safe_shard_name(shard):
            raise InvalidIndex(
                f"weight_map maps {tensor!r} to {shard!r}, which is not a plain *.safetensors file name "
                "beside the index (no paths, '.' or '..')"
            )
    index = CheckpointIndex(metadata, weight_map)
    if "total_size" in metadata and not _is_int(metadata["total_size"]):
        raise InvalidIndex(f"metadata.total_size {metadata['total_size']!r} is not a non-negative integer")
    if index.is_delta:
        _check_delta_metadata_shape(metadata)
    else:
        if not weight_map:
            raise InvalidIndex("a full checkpoint's weight_map is empty")
        if "total_size" not in metadata:
            raise InvalidIndex("metadata.total_size is missing")
        if metadata.get("checksum_format", CHECKSUM_FORMAT) != CHECKSUM_FORMAT:
            raise InvalidIndex(f"metadata.checksum_format {metadata['checksum_format']!r} is not {CHECKSUM_FORMAT!r}")
    return index


def _check_delta_metadata_shape(metadata: Mapping[str, Any]) -> None:
    extra = set(metadata) - DELTA_METADATA_KEYS
    if extra:
        raise InvalidIndex(f"delta metadata has unexpected keys {sorted(extra)}")
    for key in ("version", "base_version"):
        if not isinstance(metadata.get(key), str) or not metadata[key]:
            raise InvalidIndex(f"delta metadata.{key} is missing or empty")
    encoding, version = metadata["delta_encoding"], metadata.get("format_version", 1)
    if not _is_int(version) or version < 1:
        raise InvalidIndex(f"delta metadata.format_version {version!r} is not a positive integer")
    if version > FORMAT_VERSION:
        raise InvalidIndex(
            f"delta metadata.format_version {version} is newer than this reader's {FORMAT_VERSION}; upgrade Ferry"
        )
    want = DELTA_ENCODING if version == 1 else SPARSE_DELTA_ENCODING
    if encoding != want:
        raise InvalidIndex(
            f"delta metadata.delta_encoding {encoding!r} is not {want!r} (the encoding of format_version {version})"
        )
    if metadata.get("compression_format") not in COMPRESSION_FORMATS:
        raise InvalidIndex(
            f"delta metadata.compression_format {metadata.get('compression_format')!r} "
            f"is not one of {sorted(COMPRESSION_FORMATS)}"
        )
    if metadata.get("checksum_format") != CHECKSUM_FORMAT:
        raise InvalidIndex(
            f"delta metadata.checksum_format {metadata.get('checksum_format')!r} is not {CHECKSUM_FORMAT!r}"
        )


def check_delta_identity(index: CheckpointIndex, *, version: str, base_version: str | None) -> None:
    """A delta index must name exactly the version and base it is published as (catches mislabels)."""
    if not index.is_delta:
        raise InvalidIndex("expected an XorDelta index but metadata has no delta_encoding (it is a full checkpoint)")
    if index.metadata["version"] != version:
        raise InvalidIndex(f"delta metadata.version is {index.metadata['version']!r}, expected {version!r}")
    if index.metadata["base_version"] != base_version:
        raise InvalidIndex(
            f"delta metadata.base_version is {index.metadata['base_version']!r}, expected {base_version!r}"
        )


def _index_bytes(metadata: dict[str, Any], weight_map: dict[str, str]) -> bytes:
    return (json.dumps({"metadata": metadata, "weight_map": weight_map}, indent=2, sort_keys=True) + "\n").encode()


# ---------------------------------------------------------------- writers


def _check_names(names: Mapping[str, Any]) -> None:
    for name in names:
        if not isinstance(name, str) or not name or name == METADATA_KEY:
            raise ValueError(f"invalid tensor name {name!r}")


def canonical_shard(shard: bytes, dtypes: Mapping[str, str] | None = None) -> bytes:
    """The shard with a deterministic header, and carrier dtypes renamed (U16 → BF16, ...) when `dtypes` is given.

    The safetensors writer emits `__metadata__` in hash order, so two builds of the same weights differ by a few
    header bytes; an immutable re-publish must produce identical bytes to be recognised as a retry. Tensor
    offsets are relative to the data, so only the header changes.
    """
    length, header = parse_safetensors_header(shard)
    metadata = header.pop(METADATA_KEY, None)
    if dtypes is not None:
        for name, entry in header.items():
            entry["dtype"] = dtypes[name]
    ordered: dict[str, Any] = {} if metadata is None else {METADATA_KEY: dict(sorted(metadata.items()))}
    ordered.update(sorted(header.items(), key=lambda item: (item[1]["data_offsets"], item[0])))
    text = json.dumps(ordered, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # safetensors pads so that the data starts 8-byte aligned
    return struct.pack("<Q", len(text)) + text + shard[HEADER_PREFIX_BYTES + length :]


def build_full_checkpoint(tensors: dict[str, np.ndarray], shard_bytes: int) -> dict[str, bytes]:
    """{file name: bytes} for a full checkpoint: shards of at most `shard_bytes` tensor bytes (a larger tensor
    gets a shard of its own), in insertion order, plus the index."""
    if not tensors:
        raise ValueError("a full checkpoint needs at least one tensor")
    if shard_bytes <= 0:
        raise ValueError(f"shard_bytes must be positive, got {shard_bytes}")
    _check_names(tensors)
    # C order for safetensors; unlike ascontiguousarray, asarray keeps a 0-d tensor 0-d.
    arrays = {name: np.asarray(array, order="C") for name, array in tensors.items()}
    groups: list[list[str]] = [[]]
    filled = 0
    for name, array in arrays.items():
        if groups[-1] and filled + array.nbytes > shard_bytes:
            groups.append([])
            filled = 0
        groups[-1].append(name)
        filled += array.nbytes
    files: dict[str, bytes] = {}
    weight_map: dict[str, str] = {}
    for number, group in enumerate(groups, start=1):
        shard = full_shard_name(number, len(groups))
        part = {name: arrays[name] for name in group}
        files[shard] = canonical_shard(save(part, metadata={name: adler32_hex(_raw(a)) for name, a in part.items()}))
        weight_map.update(dict.fromkeys(group, shard))
    total = sum(a.nbytes for a in arrays.values())
    files[INDEX_NAME] = _index_bytes({"total_size": total, "checksum_format": CHECKSUM_FORMAT}, weight_map)
    return files


def build_xor_delta(
    base: dict[str, np.ndarray],
    new: dict[str, np.ndarray],
    version: str,
    base_version: str,
    *,
    sparse: bool = False,
) -> dict[str, bytes]:
    """{file name: bytes} for the delta turning `base` into `new`: one shard with the changed tensors (none if
    nothing changed) plus the index. Both need the same tensors with the same dtype and shape. Each changed tensor
    is an XOR frame, or with `sparse` a sparse patch where that is smaller (format version 2, `SparsePatch`); a
    delta without a patch stays format version 1, which ModelExpress reads."""
    if not version or not base_version or version == base_version:
        raise ValueError(f"version {version!r} and base_version {base_version!r} must be distinct and non-empty")
    _check_names(new)
    if set(base) != set(new):
        raise ValueError(
            "a delta cannot add or remove tensors: "
            f"added {sorted(set(new) - set(base))}, removed {sorted(set(base) - set(new))}"
        )
    compressor = zstandard.ZstdCompressor(level=ZSTD_LEVEL)  # writes the content size, which readers check
    frames: dict[str, np.ndarray] = {}
    checksums: dict[str, str] = {}
    patched = False
    for name, new_array in new.items():
        old_array = base[name]
        if old_array.dtype != new_array.dtype or old_array.shape != new_array.shape:
            raise ValueError(
                f"tensor {name!r} changed layout ({old_array.dtype}{old_array.shape} → "
                f"{new_array.dtype}{new_array.shape}); publish a FullCheckpoint instead"
            )
        old_raw, new_raw = _raw(old_array), _raw(new_array)
        if np.array_equal(old_raw, new_raw):
            continue
        patch = encode_sparse_patch(old_raw, new_raw, new_array.dtype.itemsize) if sparse else None
        frame = compressor.compress(np.bitwise_xor(old_raw, new_raw))
        if patch is not None and len(patch) < len(frame):
            frame, patched = patch, True
        frames[name] = np.frombuffer(frame, dtype=np.uint8)
        checksums[name] = adler32_hex(new_raw)
    files: dict[str, bytes] = {}
    weight_map: dict[str, str] = {}
    if frames:
        shard = delta_shard_name(0, 1)
        files[shard] = canonical_shard(save(frames, metadata=checksums))
        weight_map = dict.fromkeys(frames, shard)
    metadata: dict[str, Any] = {
        "version": version,
        "base_version": base_version,
        "delta_encoding": SPARSE_DELTA_ENCODING if patched else DELTA_ENCODING,
        "compression_format": "zstd",
        "checksum_format": CHECKSUM_FORMAT,
        "total_size": sum(f.nbytes for f in frames.values()),
    }
    if patched:
        metadata["format_version"] = FORMAT_VERSION
    files[INDEX_NAME] = _index_bytes(metadata, weight_map)
    return files


# ---------------------------------------------------------------- sparse patches (format version 2)

# A sparse patch is a zstd skippable frame (magic 0x184D2A5F) of `SPARSE_HEADER`, then one zstd frame (level 1,
# content size in its header) of the changed elements' positions and new values, each byte-shuffled
# (docs/checkpoint-format.md). A zstd frame starts with 0xFD2FB528, so the first 4 bytes tell the two apart.
SPARSE_MAGIC = struct.pack("<I", 0x184D2A5F)
SPARSE_HEADER = struct.Struct("<4sI4sBBBBQ")  # magic, 16, b"FSPR", version 1, index width, value width, 0, count
SPARSE_TAG = b"FSPR"
_SPARSE_VERSION = 1


def is_sparse_patch(frame: bytes | memoryview | np.ndarray) -> bool:
    return bytes(memoryview(frame)[:4]) == SPARSE_MAGIC


def _shuffle(array: np.ndarray, width: int) -> np.ndarray:
    """Byte planes: every element's first byte, then every second byte, ...: gaps and values compress far better."""
    return np.ascontiguousarray(array.view(np.uint8).reshape(-1, width).T).reshape(-1)


def _unshuffle(planes: np.ndarray, width: int, dtype: np.dtype) -> np.ndarray:
    return np.ascontiguousarray(planes.reshape(width, -1).T).reshape(-1).view(dtype)


def encode_sparse_patch(old_raw: np.ndarray, new_raw: np.ndarray, width: int) -> bytes | None:
    """The sparse patch turning `old_raw` into `new_raw` (flat uint8, equal size) element by element (`width`
    bytes each), or None when its uncompressed payload would not be smaller than the tensor."""
    if width not in (1, 2, 4, 8) or old_raw.size % width:
        width = 1
    element = np.dtype(f"<u{width}")
    old, new = old_raw.view(element), new_raw.view(element)
    changed = np.flatnonzero(old != new)
    index_width = 4 if old.size <= 1 << 32 else 8
    if changed.size * (index_width + width) >= old_raw.size:
        return None
    gaps = np.diff(changed, prepend=0).astype(f"<u{index_width}")  # the first is the first index itself
    payload = np.concatenate([_shuffle(gaps, index_width), _shuffle(new[changed], width)])
    header = SPARSE_HEADER.pack(SPARSE_MAGIC, 16, SPARSE_TAG, _SPARSE_VERSION, index_width, width, 0, changed.size)
    return header + zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(payload)


@dataclass(frozen=True)
class SparsePatch:
    """A decoded, checked sparse patch: `indices` (int64, ascending, distinct, in range) of `width`-byte elements
    and their new `values` (unsigned integers of that width)."""

    indices: np.ndarray
    values: np.ndarray
    width: int


def decode_sparse_patch(frame: bytes | memoryview | np.ndarray, nbytes: int) -> SparsePatch:
    """The patch of a tensor of `nbytes` bytes; ValueError saying why unless every rule of the format holds."""
    view = memoryview(frame).cast("B")
    if len(view) < SPARSE_HEADER.size:
        raise ValueError(f"sparse patch of {len(view)} bytes is shorter than its {SPARSE_HEADER.size}-byte header")
    magic, size, tag, version, index_width, width, reserved, count = SPARSE_HEADER.unpack(view[: SPARSE_HEADER.size])
    if magic != SPARSE_MAGIC or size != 16 or tag != SPARSE_TAG or reserved != 0:
        raise ValueError("sparse patch header is malformed")
    if version != _SPARSE_VERSION:
        raise ValueError(f"sparse patch version {version} is not {_SPARSE_VERSION}")
    if index_width not in (4, 8) or width not in (1, 2, 4, 8) or nbytes % width:
        raise ValueError(f"sparse patch of {index_width}-byte indices and {width}-byte values for {nbytes} bytes")
    numel = nbytes // width
    if count > numel:
        raise ValueError(f"sparse patch changes {count} elements of a tensor of {numel}")
    body = view[SPARSE_HEADER.size :]
    expected = count * (index_width + width)
    try:
        declared = zstandard.frame_content_size(body)
    except zstandard.ZstdError as exc:
        raise ValueError(f"sparse patch has no readable zstd frame: {exc}") from exc
    if declared != expected:
        raise ValueError(f"sparse patch declares {declared} bytes of payload, {count} elements need {expected}")
    decoder = zstandard.ZstdDecompressor().decompressobj()
    try:
        payload = decoder.decompress(body)
    except zstandard.ZstdError as exc:
        raise ValueError(f"sparse patch does not decode: {exc}") from exc
    if len(payload) != expected or decoder.unused_data:
        raise ValueError(
            f"sparse patch decodes to {len(payload)} bytes (+{len(decoder.unused_data)} trailing), want {expected}"
        )
    planes = np.frombuffer(payload, dtype=np.uint8)
    gaps = _unshuffle(planes[: count * index_width], index_width, np.dtype(f"<u{index_width}"))
    if count > 1 and not gaps[1:].all():
        raise ValueError("sparse patch names an element twice (its positions must ascend)")
    indices = np.cumsum(gaps, dtype=np.uint64)
    if count and indices[-1] >= numel:  # the gaps ascend, so no sum wrapped past the last one
        raise ValueError(f"sparse patch changes element {int(indices[-1])} of a tensor of {numel}")
    values = _unshuffle(planes[count * index_width :], width, np.dtype(f"<u{width}"))
    return SparsePatch(indices.astype(np.int64), values, width)


def apply_delta(base: np.ndarray, frame: bytes | memoryview | np.ndarray, checksum: str) -> np.ndarray:
    """Reference decoder of either kind of delta frame (an XOR frame, a sparse patch): the new tensor from its
    base; checks exact size and adler32."""
    if not is_sparse_patch(frame):
        return apply_xor_delta(base, frame, checksum)
    result = _raw(base).copy()
    got = apply_delta_into(result, frame)
    if got != checksum:
        raise ValueError(f"adler32 after applying the delta is {got}, expected {checksum}")
    return result.view(base.dtype).reshape(base.shape)


def apply_delta_into(target: np.ndarray, frame: bytes | memoryview | np.ndarray, base: np.ndarray | None = None) -> str:
    """`apply_xor_delta_into` for either kind of delta frame: a sparse patch copies `base` (when given) into
    `target`, then writes the changed elements. Returns the adler32 of the result; on error `target` may be
    partly changed."""
    if not is_sparse_patch(frame):
        return apply_xor_delta_into(target, frame, base)
    if target.dtype != np.uint8 or target.ndim != 1 or not target.flags.writeable:
        raise ValueError("the target must be a writable 1-D uint8 array")
    patch = decode_sparse_patch(frame, target.nbytes)
    if base is not None:
        if base.dtype != np.uint8 or base.shape != target.shape:
            raise ValueError(f"the base must be {target.nbytes} bytes of uint8, like the target")
        np.copyto(target, base)
    target.view(patch.values.dtype)[patch.indices] = patch.values
    return adler32_hex(target)


def apply_xor_delta(base: np.ndarray, frame: bytes | memoryview | np.ndarray, checksum: str) -> np.ndarray:
    """Reference decoder: the new tensor from its base and one delta frame; checks exact size and adler32."""
    expected = base.nbytes
    declared = zstandard.frame_content_size(frame)
    if declared != expected:
        raise ValueError(f"delta frame declares {declared} bytes, the base tensor has {expected}")
    decoder = zstandard.ZstdDecompressor().decompressobj()
    xor = decoder.decompress(frame)
    if len(xor) != expected or decoder.unused_data:
        raise ValueError(
            f"delta frame decodes to {len(xor)} bytes (+{len(decoder.unused_data)} trailing), want {expected}"
        )
    result = np.bitwise_xor(_raw(base), np.frombuffer(xor, dtype=np.uint8))
    if adler32_hex(result) != checksum:
        raise ValueError(f"adler32 after applying the delta is {adler32_hex(result)}, expected {checksum}")
    return result.view(base.dtype).reshape(base.shape)


class _Decoder(threading.local):
    """A thread's zstd decompressor and block buffer, reused across frames (a fresh buffer per block costs page
    faults that outweigh the decoding)."""

    def __init__(self) -> None:
        self.zstd = zstandard.ZstdDecompressor()
        self.block = np.empty(0, dtype=np.uint8)

    def buffer(self, nbytes: int) -> np.ndarray:
        if self.block.size < nbytes:
            self.block = np.empty(nbytes, dtype=np.uint8)
        return self.block[:nbytes]


_decoder = _Decoder()


def apply_xor_delta_into(
    target: np.ndarray,
    frame: bytes | memoryview | np.ndarray,
    base: np.ndarray | None = None,
    chunk_bytes: int = XOR_CHUNK_BYTES,
) -> str:
    """Streamed form of `apply_xor_delta`: `target` (a writable, flat uint8 array) becomes `base` (default: `target`
    itself, in place) XOR the decoded frame, block by block, so memory stays bounded whatever the compression
    ratio and each block is decoded, XORed and checksummed while it is in cache. Returns the adler32 (`%08x`) of
    the result, for the caller to check. ValueError unless the frame decodes to exactly `target.nbytes` bytes; on
    error `target` may be partly changed."""
    if target.dtype != np.uint8 or target.ndim != 1 or not target.flags.writeable:
        raise ValueError("the target must be a writable 1-D uint8 array")
    expected = target.nbytes
    if base is None:
        base = target
    elif base.dtype != np.uint8 or base.shape != target.shape:
        raise ValueError(f"the base must be {expected} bytes of uint8, like the target")
    try:
        declared = zstandard.frame_content_size(frame)
    except zstandard.ZstdError as exc:
        raise ValueError(f"delta frame has no readable zstd header: {exc}") from exc
    if declared != expected:
        raise ValueError(f"delta frame declares {declared} bytes, the base tensor has {expected}")
    block = _decoder.buffer(chunk_bytes)
    into = memoryview(block)
    done, checksum = 0, 1
    try:
        # Reading across frames makes trailing data visible: garbage fails to decode, a frame adds bytes.
        with _decoder.zstd.stream_reader(frame, read_across_frames=True) as reader:
            while n := reader.readinto(into):
                end = done + n
                if end > expected:
                    raise ValueError(f"delta frame decodes to more than the {expected} bytes of the base tensor")
                region = target[done:end]
                np.bitwise_xor(base[done:end], block[:n], out=region)
                checksum = adler32(region, checksum)
                done = end
    except zstandard.ZstdError as exc:
        raise ValueError(f"delta frame does not decode: {exc}") from exc
    if done != expected:
        raise ValueError(f"delta frame decodes to {done} bytes, want {expected}; it is truncated")
    return f"{checksum:08x}"
