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


def test_unknown_dtypes_are_accepted_without_size_check() -> None:
    infos = ckpt.tensor_infos({"t": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}})
    assert infos["t"].nbytes == 2 and ckpt.data_length(infos) == 2
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
