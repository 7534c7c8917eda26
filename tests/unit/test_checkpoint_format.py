"""The canonical checkpoint format: writers round-trip, readers reject what the agent must never trust."""

from __future__ import annotations

import json
import struct
import zlib

import numpy as np
import pytest
import zstandard
from safetensors.numpy import load, save

from ferry import checkpoint_format as ckpt

pytestmark = pytest.mark.unit


def tensors(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "embed.weight": rng.standard_normal((16, 8)).astype(np.float32),
        "layers.0.attn.weight": rng.standard_normal((8, 8)).astype(np.float16),
        "layers.0.bias": rng.integers(-100, 100, size=(8,), dtype=np.int64),
        "layers.0.mask": rng.integers(0, 2, size=(3, 5)).astype(bool),
        "scalar": np.array(3.5, dtype=np.float64),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }


def load_all(files: dict[str, bytes]) -> tuple[dict, dict[str, np.ndarray], dict[str, str]]:
    """(index, tensors by name, checksums by name) read back through the real safetensors reader."""
    index = json.loads(files[ckpt.INDEX_NAME])
    out: dict[str, np.ndarray] = {}
    sums: dict[str, str] = {}
    for shard in set(index["weight_map"].values()):
        out.update(load(files[shard]))
        _, header = ckpt.parse_safetensors_header(files[shard])
        sums.update(header["__metadata__"])
    return index, out, sums


def test_adler32_hex() -> None:
    assert ckpt.adler32_hex(b"") == "00000001"
    assert ckpt.adler32_hex(b"Wikipedia") == "11e60398"
    assert ckpt.adler32_hex(memoryview(b"Wikipedia")) == "11e60398"
    data = bytes(range(256)) * 1000
    assert ckpt.adler32_hex(data) == f"{zlib.adler32(data):08x}"
    assert len(ckpt.adler32_hex(b"\x00")) == 8


@pytest.mark.parametrize(
    ("name", "safe"),
    [
        ("model-00001-of-00002.safetensors", True),
        ("a.safetensors", True),
        ("A_b-c.d.safetensors", True),
        ("../model.safetensors", False),
        ("sub/model.safetensors", False),
        ("/abs.safetensors", False),
        (".safetensors", False),
        ("..safetensors", False),
        (".hidden.safetensors", False),
        ("model.safetensors\n", False),
        ("model.bin", False),
        ("model.safetensors.index.json", False),
        ("", False),
        (None, False),
        ("a b.safetensors", False),
        ("a\\b.safetensors", False),
    ],
)
def test_safe_shard_names(name: object, safe: bool) -> None:
    assert ckpt.is_safe_shard_name(name) is safe


def test_full_checkpoint_round_trip_and_layout() -> None:
    src = tensors()
    files = ckpt.build_full_checkpoint(src, shard_bytes=600)
    index, back, sums = load_all(files)

    shards = sorted(n for n in files if n != ckpt.INDEX_NAME)
    total = len(shards)
    assert total > 1
    assert shards == [f"model-{i:05d}-of-{total:05d}.safetensors" for i in range(1, total + 1)]
    assert index["metadata"] == {"total_size": sum(a.nbytes for a in src.values()), "checksum_format": "adler32"}
    assert set(index["weight_map"]) == set(src)
    for name, array in src.items():
        assert back[name].dtype == array.dtype and back[name].shape == array.shape
        np.testing.assert_array_equal(back[name], array)
        assert sums[name] == ckpt.adler32_hex(np.ascontiguousarray(array).tobytes())
    # Each shard's metadata covers exactly its own tensors.
    for shard in shards:
        _, header = ckpt.parse_safetensors_header(files[shard])
        mine = {n for n, s in index["weight_map"].items() if s == shard}
        assert set(header["__metadata__"]) == mine == set(ckpt.tensor_infos(header))


def test_full_checkpoint_shard_packing() -> None:
    src = {f"t{i}": np.zeros(25, dtype=np.float32) for i in range(4)}  # 100 bytes each
    files = ckpt.build_full_checkpoint(src, shard_bytes=200)
    index = json.loads(files[ckpt.INDEX_NAME])
    assert index["weight_map"] == {
        "t0": "model-00001-of-00002.safetensors",
        "t1": "model-00001-of-00002.safetensors",
        "t2": "model-00002-of-00002.safetensors",
        "t3": "model-00002-of-00002.safetensors",
    }
    # A tensor bigger than the shard budget gets a shard of its own; one huge budget gives one shard.
    big = {"small": np.zeros(1, np.uint8), "huge": np.zeros(1000, np.uint8), "tail": np.zeros(1, np.uint8)}
    assert len(json.loads(ckpt.build_full_checkpoint(big, 10)[ckpt.INDEX_NAME])["weight_map"].values()) == 3
    assert set(json.loads(ckpt.build_full_checkpoint(big, 10)[ckpt.INDEX_NAME])["weight_map"].values()) == {
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
    }
    assert list(ckpt.build_full_checkpoint(big, 10**9)) == ["model-00001-of-00001.safetensors", ckpt.INDEX_NAME]


def test_full_checkpoint_handles_non_contiguous_arrays() -> None:
    array = np.arange(64, dtype=np.int32).reshape(8, 8).T  # Fortran-ordered view
    files = ckpt.build_full_checkpoint({"t": array}, 1 << 20)
    _, back, sums = load_all(files)
    np.testing.assert_array_equal(back["t"], array)
    assert sums["t"] == ckpt.adler32_hex(np.ascontiguousarray(array).tobytes())


@pytest.mark.parametrize(
    ("src", "shard_bytes"),
    [({}, 10), ({"a": np.zeros(1)}, 0), ({"__metadata__": np.zeros(1)}, 10), ({"": np.zeros(1)}, 10)],
)
def test_full_checkpoint_rejects_bad_input(src: dict, shard_bytes: int) -> None:
    with pytest.raises(ValueError):
        ckpt.build_full_checkpoint(src, shard_bytes)


def test_index_is_deterministic() -> None:
    # Shard bytes are not: safetensors serializes __metadata__ from an unordered map.
    full = ckpt.build_full_checkpoint(tensors(), 500)
    assert full[ckpt.INDEX_NAME] == ckpt.build_full_checkpoint(tensors(), 500)[ckpt.INDEX_NAME]
    delta = ckpt.build_xor_delta(tensors(0), tensors(1), "v2", "v1")
    assert delta[ckpt.INDEX_NAME] == ckpt.build_xor_delta(tensors(0), tensors(1), "v2", "v1")[ckpt.INDEX_NAME]


def test_xor_delta_round_trip() -> None:
    base = tensors(0)
    new = {name: array.copy() for name, array in base.items()}
    new["embed.weight"][3, :] += 1.0
    new["layers.0.bias"][0] = 12345
    files = ckpt.build_xor_delta(base, new, version="v2", base_version="v1")

    assert set(files) == {"model-00000-of-00001.safetensors", ckpt.INDEX_NAME}
    index, frames, sums = load_all(files)
    assert index["metadata"] == {
        "version": "v2",
        "base_version": "v1",
        "delta_encoding": "xor",
        "compression_format": "zstd",
        "checksum_format": "adler32",
        "total_size": sum(f.nbytes for f in frames.values()),
    }
    assert set(index["weight_map"]) == {"embed.weight", "layers.0.bias"}  # unchanged tensors are omitted
    for name, frame in frames.items():
        assert frame.dtype == np.uint8 and frame.ndim == 1
        raw = zstandard.ZstdDecompressor().decompress(frame.tobytes())
        assert len(raw) == base[name].nbytes  # full-size XOR, not a sparse patch
        assert sums[name] == ckpt.adler32_hex(new[name].tobytes())
        rebuilt = ckpt.apply_xor_delta(base[name], frame, sums[name])
        assert rebuilt.dtype == new[name].dtype and rebuilt.shape == new[name].shape
        np.testing.assert_array_equal(rebuilt, new[name])
    ckpt.parse_index(files[ckpt.INDEX_NAME])  # the canonical reader accepts what the writer produced


def test_xor_delta_chain_replays_to_the_final_version() -> None:
    v1 = tensors(0)
    v2 = {n: a.copy() for n, a in v1.items()}
    v2["embed.weight"] *= 2
    v3 = {n: a.copy() for n, a in v2.items()}
    v3["layers.0.attn.weight"][0, 0] = 7
    current = v1
    for new, version, base_version in ((v2, "v2", "v1"), (v3, "v3", "v2")):
        _, frames, sums = load_all(ckpt.build_xor_delta(current, new, version, base_version))
        current = {n: ckpt.apply_xor_delta(a, frames[n], sums[n]) if n in frames else a for n, a in current.items()}
    for name in v3:
        np.testing.assert_array_equal(current[name], v3[name])


def test_identical_versions_give_an_empty_delta() -> None:
    files = ckpt.build_xor_delta(tensors(), tensors(), "v2", "v1")
    assert list(files) == [ckpt.INDEX_NAME]
    index = ckpt.parse_index(files[ckpt.INDEX_NAME])
    assert index.weight_map == {} and index.metadata["total_size"] == 0 and index.shards == ()


def test_xor_delta_rejects_layout_changes() -> None:
    base = {"w": np.zeros((2, 2), np.float32)}
    with pytest.raises(ValueError, match="layout"):
        ckpt.build_xor_delta(base, {"w": np.zeros((4,), np.float32)}, "v2", "v1")
    with pytest.raises(ValueError, match="layout"):
        ckpt.build_xor_delta(base, {"w": np.zeros((2, 2), np.int32)}, "v2", "v1")
    with pytest.raises(ValueError, match="added"):
        ckpt.build_xor_delta(base, {"w": base["w"], "x": base["w"]}, "v2", "v1")
    with pytest.raises(ValueError, match="removed"):
        ckpt.build_xor_delta({**base, "x": base["w"]}, base, "v2", "v1")
    with pytest.raises(ValueError):
        ckpt.build_xor_delta(base, base, "v1", "v1")


def test_apply_xor_delta_rejects_corruption() -> None:
    base = np.arange(16, dtype=np.float32)
    new = base + 1
    frame = zstandard.ZstdCompressor(level=1).compress(np.bitwise_xor(base.view(np.uint8), new.view(np.uint8)))
    good = ckpt.adler32_hex(new.tobytes())
    np.testing.assert_array_equal(ckpt.apply_xor_delta(base, frame, good), new)
    with pytest.raises(ValueError, match="adler32"):
        ckpt.apply_xor_delta(base, frame, "00000000")
    with pytest.raises(ValueError, match="trailing"):
        ckpt.apply_xor_delta(base, frame + b"junk", good)
    with pytest.raises(ValueError, match="declares"):
        ckpt.apply_xor_delta(np.arange(8, dtype=np.float32), frame, good)
    unsized = zstandard.ZstdCompressor(level=1, write_content_size=False).compress(b"\x00" * 64)
    with pytest.raises(ValueError, match="declares"):
        ckpt.apply_xor_delta(base, unsized, good)


# ---------------------------------------------------------------- safetensors headers


def test_parse_safetensors_header() -> None:
    blob = save({"a": np.zeros((2, 3), np.float32), "b": np.ones(4, np.uint8)}, metadata={"a": "x"})
    length, header = ckpt.parse_safetensors_header(blob)
    assert length == struct.unpack("<Q", blob[:8])[0]
    assert header["__metadata__"] == {"a": "x"}
    infos = ckpt.tensor_infos(header)
    assert infos["a"].dtype == "F32" and infos["a"].shape == (2, 3) and infos["a"].nbytes == 24
    assert len(blob) == 8 + length + ckpt.data_length(infos)
    assert ckpt.shard_checksums(header) == {"a": "x"}
    # Only the header is needed, not the data.
    assert ckpt.parse_safetensors_header(blob[: 8 + length]) == (length, header)


def test_header_readers_reject_garbage() -> None:
    with pytest.raises(ckpt.InvalidShard, match="8 bytes"):
        ckpt.header_length(b"\x01\x00")
    with pytest.raises(ckpt.InvalidShard, match="allowed"):
        ckpt.header_length(struct.pack("<Q", 1 << 40))
    with pytest.raises(ckpt.InvalidShard, match="need"):
        ckpt.parse_safetensors_header(struct.pack("<Q", 100) + b"{}")
    with pytest.raises(ckpt.InvalidShard, match="JSON"):
        ckpt.parse_safetensors_header(struct.pack("<Q", 4) + b"nope")
    with pytest.raises(ckpt.InvalidShard, match="object"):
        ckpt.parse_safetensors_header(struct.pack("<Q", 2) + b"[]")


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ("x", "not an object"),
        ({"shape": [1], "data_offsets": [0, 4]}, "dtype"),
        ({"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}, "shape"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [0]}, "data_offsets"),
        ({"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}, "before"),
        ({"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}, "needs 8 bytes"),
    ],
)
def test_tensor_infos_reject_bad_entries(entry: object, match: str) -> None:
    with pytest.raises(ckpt.InvalidShard, match=match):
        ckpt.tensor_infos({"t": entry})


@pytest.mark.parametrize("dtype", ["F128", "F4", "f32"])
def test_dtypes_that_are_not_fixed_width_ones_ferry_loads_are_refused(dtype: str) -> None:
    """The agent loads none of them (no torch dtype, or no width to check the span against)."""
    with pytest.raises(ckpt.InvalidShard, match=rf"tensor 't': dtype '{dtype}' is not one of .* \(rule dtype-known\)"):
        ckpt.tensor_infos({"t": {"dtype": dtype, "shape": [3], "data_offsets": [0, 48]}})
    assert ckpt.data_length({}) == 0


# ---------------------------------------------------------------- index


def full_index(**changes: object) -> dict:
    doc = {
        "metadata": {"total_size": 8, "checksum_format": "adler32"},
        "weight_map": {"a": "model-00001-of-00001.safetensors"},
    }
    doc.update(changes)
    return doc


def delta_index(**metadata: object) -> dict:
    meta = {
        "version": "v2",
        "base_version": "v1",
        "delta_encoding": "xor",
        "compression_format": "zstd",
        "checksum_format": "adler32",
    }
    meta.update(metadata)
    return {"metadata": {k: v for k, v in meta.items() if v is not None}, "weight_map": {}}


def test_parse_index_accepts_canonical_indexes() -> None:
    full = ckpt.parse_index(json.dumps(full_index()))
    assert not full.is_delta and full.shards == ("model-00001-of-00001.safetensors",)
    assert full.tensors_in("model-00001-of-00001.safetensors") == {"a"}
    delta = ckpt.parse_index(json.dumps(delta_index()).encode())
    assert delta.is_delta
    ckpt.check_delta_identity(delta, version="v2", base_version="v1")
    # ModelExpress deltas carry no total_size; full indexes may carry extra Hugging Face metadata.
    ckpt.parse_index(json.dumps(full_index(metadata={"total_size": 8, "format": "pt"})))


@pytest.mark.parametrize(
    ("doc", "match"),
    [
        ("{not json", "not valid JSON"),
        ("[]", "top level"),
        (json.dumps({"weight_map": {}}), '"metadata"'),
        (json.dumps({"metadata": {}}), '"weight_map"'),
        (json.dumps(full_index(weight_map={})), "empty"),
        (json.dumps(full_index(weight_map={"a": "../x.safetensors"})), "plain"),
        (json.dumps(full_index(weight_map={"a": "dir/x.safetensors"})), "plain"),
        (json.dumps(full_index(weight_map={"a": "x.bin"})), "plain"),
        (json.dumps(full_index(weight_map={"a": 3})), "plain"),
        (json.dumps(full_index(weight_map={"": "x.safetensors"})), "empty tensor name"),
        (json.dumps(full_index(metadata={"checksum_format": "adler32"})), "total_size is missing"),
        (json.dumps(full_index(metadata={"total_size": -1})), "total_size"),
        (json.dumps(full_index(metadata={"total_size": True})), "total_size"),
        (json.dumps(full_index(metadata={"total_size": 1, "checksum_format": "crc32"})), "checksum_format"),
        (json.dumps(delta_index(delta_encoding="add")), "delta_encoding"),
        (json.dumps(delta_index(compression_format="lz4")), "compression_format"),
        (json.dumps(delta_index(compression_format=None)), "compression_format"),
        (json.dumps(delta_index(checksum_format="sha256")), "checksum_format"),
        (json.dumps(delta_index(version="")), "version"),
        (json.dumps(delta_index(base_version=None)), "base_version"),
        (json.dumps(delta_index(extra="x")), "unexpected keys"),
        (b"\xff\xfe", "not valid JSON"),
    ],
)
def test_parse_index_rejects(doc: str | bytes, match: str) -> None:
    with pytest.raises(ckpt.InvalidIndex, match=match):
        ckpt.parse_index(doc)


def test_check_delta_identity() -> None:
    delta = ckpt.parse_index(json.dumps(delta_index()))
    with pytest.raises(ckpt.InvalidIndex, match="version is 'v2', expected 'v9'"):
        ckpt.check_delta_identity(delta, version="v9", base_version="v1")
    with pytest.raises(ckpt.InvalidIndex, match="base_version is 'v1', expected 'v0'"):
        ckpt.check_delta_identity(delta, version="v2", base_version="v0")
    with pytest.raises(ckpt.InvalidIndex, match="full checkpoint"):
        ckpt.check_delta_identity(ckpt.parse_index(json.dumps(full_index())), version="v2", base_version="v1")


def test_dtype_tables_agree() -> None:
    """Every safetensors dtype Ferry knows has a torch dtype of its width, and a numpy dtype (or carrier) of the
    same width, so publish, the operator and the agent accept exactly the same checkpoints."""
    import torch

    assert set(ckpt.TORCH_DTYPES) == set(ckpt.DTYPE_SIZES) == {*ckpt.NUMPY_DTYPES, *ckpt.CARRIERS}
    assert not set(ckpt.NUMPY_DTYPES) & set(ckpt.CARRIERS)
    for dtype, name in ckpt.TORCH_DTYPES.items():
        torch_dtype = getattr(torch, name)
        assert isinstance(torch_dtype, torch.dtype) and torch_dtype.itemsize == ckpt.DTYPE_SIZES[dtype], dtype
        numpy_dtype = ckpt.NUMPY_DTYPES.get(dtype) or ckpt.CARRIERS[dtype]
        assert np.dtype(numpy_dtype).itemsize == ckpt.DTYPE_SIZES[dtype], dtype


# ---------------------------------------------------------------- the one validation: every rule, named


def raw_shard(header_json: str, data_bytes: int) -> bytes:
    """A shard with exactly this header text (so a key may be written twice) and `data_bytes` of data."""
    text = header_json.encode()
    return struct.pack("<Q", len(text)) + text + b"\x00" * data_bytes


def entry(begin: int, end: int, dtype: str = "U8") -> dict:
    return {"dtype": dtype, "shape": [end - begin], "data_offsets": [begin, end]}


def shard_of(entries: dict[str, dict], data_bytes: int | None = None, checksums: bool = True) -> bytes:
    header: dict = {"__metadata__": dict.fromkeys(entries, "00000001")} if checksums else {}
    header.update(entries)
    end = max((e["data_offsets"][1] for e in entries.values()), default=0)
    return raw_shard(json.dumps(header), end if data_bytes is None else data_bytes)


def refusal(
    shard: bytes, expected: set[str] | None = None, *, delta: bool = False, size: int | None = None
) -> ckpt.InvalidShard:
    """check_shard's refusal of `shard`, checked against `expected` (default: the tensors its header names)."""
    names = expected
    if names is None:
        names = {n for n in ckpt.parse_safetensors_header(shard)[1] if n != ckpt.METADATA_KEY}
    with pytest.raises(ckpt.InvalidShard) as refused:
        ckpt.check_shard(shard, len(shard) if size is None else size, names, delta=delta)
    return refused.value


def test_every_shard_a_writer_builds_keeps_every_rule() -> None:
    """Zero-size and 0-d tensors included: what Ferry publishes, Ferry verifies and loads."""
    files = ckpt.build_full_checkpoint(tensors(), shard_bytes=600)
    index = ckpt.parse_index(files[ckpt.INDEX_NAME])
    for shard in index.shards:
        ckpt.check_shard(files[shard], len(files[shard]), index.tensors_in(shard))
    changed = {k: (a + 1 if k == "embed.weight" else a) for k, a in tensors().items()}
    delta = ckpt.build_xor_delta(tensors(), changed, "v2", "v1")
    index = ckpt.parse_index(delta[ckpt.INDEX_NAME])
    for shard in index.shards:
        ckpt.check_shard(delta[shard], len(delta[shard]), index.tensors_in(shard), delta=True)


def test_overlapping_data_offsets_are_refused_naming_both_tensors() -> None:
    exc = refusal(shard_of({"a": entry(0, 16), "b": entry(8, 24)}))
    assert (exc.rule, exc.tensor) == (ckpt.Rule.OFFSETS_DISJOINT, "b")
    assert str(exc) == "tensor 'b': data_offsets [8, 24] overlap tensor 'a''s [0, 16] (rule offsets-disjoint)"
    # The same bytes twice, and an empty tensor inside another's bytes, overlap too.
    assert refusal(shard_of({"a": entry(0, 16), "b": entry(0, 16)})).rule == ckpt.Rule.OFFSETS_DISJOINT
    assert refusal(shard_of({"a": entry(0, 16), "z": entry(4, 4)})).tensor == "z"


def test_data_offsets_that_leave_a_gap_are_refused() -> None:
    exc = refusal(shard_of({"a": entry(0, 16), "b": entry(20, 36)}))
    assert (exc.rule, exc.tensor) == (ckpt.Rule.OFFSETS_CONTIGUOUS, "b")
    assert "begin at 20 but tensor 'a' ends at 16: bytes [16, 20] belong to no tensor" in str(exc)
    exc = refusal(shard_of({"a": entry(4, 20)}))
    assert exc.tensor == "a" and "but the data starts at 0" in str(exc)


def test_a_dtype_ferry_cannot_load_is_refused_by_check_shard() -> None:
    exc = refusal(shard_of({"a": entry(0, 16), "big": {"dtype": "F128", "shape": [2], "data_offsets": [16, 48]}}))
    assert (exc.rule, exc.tensor) == (ckpt.Rule.DTYPE_KNOWN, "big")


def test_a_span_other_than_the_shape_says_is_refused() -> None:
    exc = refusal(shard_of({"w": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 20]}}))
    assert (exc.rule, exc.tensor) == (ckpt.Rule.SIZE_MATCHES_SHAPE, "w") and "needs 24 bytes" in str(exc)


def test_a_name_written_twice_is_refused_not_silently_dropped() -> None:
    """json.loads keeps the last of two equal keys: the first tensor would vanish from the checks."""
    first, second = json.dumps(entry(0, 8)), json.dumps(entry(8, 16))
    header = '{"__metadata__":{"a":"00000001"},"a":' + first + ',"a":' + second + "}"
    exc = refusal(raw_shard(header, 16), {"a"})
    assert exc.rule == ckpt.Rule.NAME_UNIQUE and "'a' appears twice" in str(exc)
    doc = '{"metadata":{"total_size":16},"weight_map":{"a":"s.safetensors","a":"t.safetensors"}}'
    with pytest.raises(ckpt.InvalidIndex, match=r"'a' appears twice in one object \(rule name-unique\)"):
        ckpt.parse_index(doc)


def test_the_shard_and_the_index_must_agree() -> None:
    shard = shard_of({"a": entry(0, 8), "b": entry(8, 16)})
    exc = refusal(shard, {"a", "b", "c"})
    assert (exc.rule, exc.tensor) == (ckpt.Rule.INDEX_MATCHES, "c") and "lacks tensors" in str(exc)
    exc = refusal(shard, {"a"})
    assert (exc.rule, exc.tensor) == (ckpt.Rule.INDEX_MATCHES, "b") and "not in the index" in str(exc)


def test_the_shard_size_must_be_what_its_header_describes() -> None:
    shard = shard_of({"a": entry(0, 8)})
    assert refusal(shard, {"a"}, size=len(shard) - 1).rule == ckpt.Rule.SHARD_SIZE
    assert "longer than its header describes" in str(refusal(shard, {"a"}, size=len(shard) + 1))


def test_every_tensor_needs_its_checksum() -> None:
    exc = refusal(shard_of({"a": entry(0, 8)}, checksums=False))
    assert (exc.rule, exc.tensor) == (ckpt.Rule.CHECKSUM, "a")
    many = {f"t{i}": entry(i, i + 1) for i in range(9)}
    assert "for tensors ['t0', 't1', 't2', 't3', 't4'] and 4 more" in str(refusal(shard_of(many, checksums=False)))


def test_a_delta_stores_every_tensor_as_a_one_dimensional_byte_frame() -> None:
    shard = shard_of({"w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}})
    ckpt.check_shard(shard, len(shard), {"w"})  # fine in a full checkpoint
    exc = refusal(shard, {"w"}, delta=True)
    assert (exc.rule, exc.tensor) == (ckpt.Rule.DELTA_FRAME, "w") and "not as a 1-D U8 zstd frame" in str(exc)


def test_a_refusal_reads_as_one_sentence_about_its_shard() -> None:
    overlap = refusal(shard_of({"a": entry(0, 16), "b": entry(8, 24)}))
    assert overlap.describe("s3://b/m/x.safetensors") == (
        "shard s3://b/m/x.safetensors has a malformed header: tensor 'b': data_offsets [8, 24] overlap tensor 'a''s "
        "[0, 16] (rule offsets-disjoint)"
    )
    shard = shard_of({"a": entry(0, 8)})
    short = refusal(shard, {"a"}, size=len(shard) - 1)
    assert short.describe("x.safetensors").startswith(f"shard x.safetensors is {len(shard) - 1} bytes but its header")


# ---------------------------------------------------------------- sparse patches (format version 2)


def sprinkled(base: dict[str, np.ndarray], fraction: float, seed: int = 5) -> dict[str, np.ndarray]:
    from tests.support.s3 import sprinkle

    return sprinkle(base, seed, fraction)


def big_tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {
        "w.bf16": rng.integers(0, 1 << 16, 50_000, dtype=np.uint16).reshape(250, 200),  # a BF16 carrier
        "w.f32": rng.standard_normal((100, 300)).astype(np.float32),
        "w.i8": rng.integers(-128, 128, 40_000, dtype=np.int8),
    }


def test_sparse_delta_round_trip_is_chosen_per_tensor_and_declares_format_version_2() -> None:
    base = big_tensors()
    new = sprinkled(base, 0.02)
    new["w.f32"] = (base["w.f32"] + 1).astype(np.float32)  # every element: the XOR frame is the smaller one
    files = ckpt.build_xor_delta(base, new, "v2", "v1", sparse=True)
    index, frames, sums = load_all(files)
    assert index["metadata"]["delta_encoding"] == "xor+sparse" and index["metadata"]["format_version"] == 2
    kinds = {name: ckpt.is_sparse_patch(frame) for name, frame in frames.items()}
    assert kinds == {"w.bf16": True, "w.f32": False, "w.i8": True}
    for name, frame in frames.items():
        np.testing.assert_array_equal(ckpt.apply_delta(base[name], frame, sums[name]), new[name])
        # each stored frame is the smaller of the two encodings
        xor = zstandard.ZstdCompressor(level=1).compress(
            np.bitwise_xor(base[name].view(np.uint8), new[name].view(np.uint8)).tobytes()
        )
        patch = ckpt.encode_sparse_patch(
            base[name].view(np.uint8).reshape(-1), new[name].view(np.uint8).reshape(-1), base[name].itemsize
        )
        assert frame.nbytes == min(len(xor), len(patch) if patch is not None else len(xor) + 1)
    ckpt.parse_index(files[ckpt.INDEX_NAME])
    # the streamed form, from a base into a separate target and in place
    for name, frame in frames.items():
        flat = base[name].reshape(-1).view(np.uint8)
        target = np.zeros_like(flat)
        assert ckpt.apply_delta_into(target, frame, flat) == sums[name]
        assert target.tobytes() == new[name].tobytes()
        inplace = flat.copy()
        assert ckpt.apply_delta_into(inplace, frame) == sums[name] and inplace.tobytes() == new[name].tobytes()


def test_a_sparse_patch_is_much_smaller_than_the_changed_elements_raw_and_xor_only_stays_version_1() -> None:
    base = big_tensors()
    new = sprinkled(base, 0.02)
    patch = ckpt.encode_sparse_patch(
        base["w.bf16"].view(np.uint8).reshape(-1), new["w.bf16"].view(np.uint8).reshape(-1), 2
    )
    assert patch is not None and ckpt.decode_sparse_patch(patch, base["w.bf16"].nbytes).indices.size == 1000
    assert len(patch) < 1000 * (4 + 2) * 1.2  # at most 1.2x the minimal index + value bytes
    xor_only = json.loads(ckpt.build_xor_delta(base, new, "v2", "v1")[ckpt.INDEX_NAME])
    assert xor_only["metadata"]["delta_encoding"] == "xor" and "format_version" not in xor_only["metadata"]
    # nothing sparse to gain: version 1 even when allowed
    dense = {n: (a + 1).astype(a.dtype) for n, a in base.items()}
    assert (
        "format_version"
        not in json.loads(ckpt.build_xor_delta(base, dense, "v2", "v1", sparse=True)[ckpt.INDEX_NAME])["metadata"]
    )


def test_readers_refuse_a_format_version_they_do_not_know_or_a_mislabelled_encoding() -> None:
    ckpt.parse_index(json.dumps(delta_index(delta_encoding="xor+sparse", format_version=2)))
    ckpt.parse_index(json.dumps(delta_index(format_version=1)))
    with pytest.raises(ckpt.InvalidIndex, match="format_version 3 is newer than this reader's 2"):
        ckpt.parse_index(json.dumps(delta_index(delta_encoding="xor+sparse", format_version=3)))
    with pytest.raises(ckpt.InvalidIndex, match="'xor\\+sparse' is not 'xor'"):
        ckpt.parse_index(json.dumps(delta_index(delta_encoding="xor+sparse")))  # a version-1 index cannot hold patches
    with pytest.raises(ckpt.InvalidIndex, match="'xor' is not 'xor\\+sparse'"):
        ckpt.parse_index(json.dumps(delta_index(format_version=2)))
    with pytest.raises(ckpt.InvalidIndex, match="format_version"):
        ckpt.parse_index(json.dumps(delta_index(delta_encoding="xor+sparse", format_version="2")))


def _patch() -> tuple[np.ndarray, bytes, str]:
    base = big_tensors()["w.bf16"]
    new = sprinkled({"t": base}, 0.02)["t"]
    patch = ckpt.encode_sparse_patch(base.view(np.uint8).reshape(-1), new.view(np.uint8).reshape(-1), 2)
    assert patch is not None
    return base, patch, ckpt.adler32_hex(new.tobytes())


@pytest.mark.parametrize(
    ("corrupt", "match"),
    [
        (lambda b: b[:10], "shorter than its"),
        (lambda b: b[:8] + b"XXXX" + b[12:], "header is malformed"),
        (lambda b: b[:12] + b"\x02" + b[13:], "patch version 2"),
        (lambda b: b[:14] + b"\x03" + b[15:], "3-byte values"),
        (lambda b: b[:16] + struct.pack("<Q", 10**9) + b[24:], "changes 1000000000 elements"),
        (lambda b: b[:16] + struct.pack("<Q", 999) + b[24:], "declares 6000 bytes of payload, 999 elements need 5994"),
        (lambda b: b[:-3], "does not decode|decodes to"),
        (lambda b: b + b"\x00", "trailing|does not decode"),
    ],
)
def test_a_corrupt_sparse_patch_is_refused(corrupt, match: str) -> None:
    base, patch, checksum = _patch()
    with pytest.raises(ValueError, match=match):
        ckpt.apply_delta(base, corrupt(patch), checksum)


def test_a_sparse_patch_with_a_flipped_value_fails_the_checksum_of_the_result() -> None:
    base, patch, checksum = _patch()
    body = ckpt.decode_sparse_patch(patch, base.nbytes)
    values = body.values.copy()
    values[7] ^= 1
    forged = ckpt.SPARSE_HEADER.pack(
        ckpt.SPARSE_MAGIC, 16, ckpt.SPARSE_TAG, 1, 4, 2, 0, values.size
    ) + zstandard.ZstdCompressor().compress(
        np.concatenate(
            [ckpt._shuffle(np.diff(body.indices, prepend=0).astype("<u4"), 4), ckpt._shuffle(values, 2)]
        ).tobytes()
    )
    with pytest.raises(ValueError, match="adler32 after applying the delta"):
        ckpt.apply_delta(base, forged, checksum)
    repeated = body.indices.copy()
    repeated[5] = repeated[4]
    forged = ckpt.SPARSE_HEADER.pack(
        ckpt.SPARSE_MAGIC, 16, ckpt.SPARSE_TAG, 1, 4, 2, 0, values.size
    ) + zstandard.ZstdCompressor().compress(
        np.concatenate(
            [ckpt._shuffle(np.diff(repeated, prepend=0).astype("<u4"), 4), ckpt._shuffle(body.values, 2)]
        ).tobytes()
    )
    with pytest.raises(ValueError, match="names an element twice"):
        ckpt.apply_delta(base, forged, checksum)
