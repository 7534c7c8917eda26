"""The weights to publish: read from safetensors files or a torch state dict, and built into the canonical
checkpoint files (`ferry.checkpoint_format`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ferry import checkpoint_format as ckpt
from ferry.publish.errors import InvalidPublish, PublishNotFound

DEFAULT_SHARD_BYTES = 4 << 30  # as ModelExpress's full-checkpoint batches
_FROM_TORCH = {name: dtype for dtype, name in ckpt.TORCH_DTYPES.items()}  # torch dtype name → safetensors dtype


@dataclass
class Weights:
    """Tensors as numpy arrays (carriers for dtypes numpy lacks) plus each tensor's safetensors dtype."""

    arrays: dict[str, np.ndarray]
    dtypes: dict[str, str]

    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        return {name: (self.dtypes[name], tuple(a.shape)) for name, a in self.arrays.items()}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays.values())

    def add(self, name: str, dtype: str, array: np.ndarray, where: str) -> None:
        if name in self.arrays:
            raise InvalidPublish(f"tensor {name!r} appears twice (again in {where})")
        self.arrays[name] = array
        self.dtypes[name] = dtype


def _numpy_dtype(dtype: str, where: str) -> type[np.generic]:
    found = ckpt.NUMPY_DTYPES.get(dtype) or ckpt.CARRIERS.get(dtype)
    if found is None:
        supported = sorted({*ckpt.NUMPY_DTYPES, *ckpt.CARRIERS})
        raise InvalidPublish(f"{where}: dtype {dtype} is not supported (supported: {supported})")
    return found


def read_safetensors(data: np.ndarray | bytes, where: str, into: Weights) -> dict[str, str]:
    """Add a safetensors file's tensors (zero-copy views of `data`); returns its `__metadata__` checksums."""
    buf = np.frombuffer(data, dtype=np.uint8) if isinstance(data, bytes) else data
    try:
        prefix = bytes(buf[: ckpt.HEADER_PREFIX_BYTES])
        length = ckpt.header_length(prefix)
        _, header = ckpt.parse_safetensors_header(bytes(buf[: ckpt.HEADER_PREFIX_BYTES + length]))
        infos = ckpt.tensor_infos(header)
        checksums = ckpt.shard_checksums(header)
    except ckpt.InvalidShard as exc:
        raise InvalidPublish(f"{where} is not a valid safetensors file: {exc}") from exc
    start = ckpt.HEADER_PREFIX_BYTES + length
    if start + ckpt.data_length(infos) > len(buf):
        raise InvalidPublish(f"{where} is truncated: its header describes more data than the file holds")
    for name, info in infos.items():
        raw = buf[start + info.begin : start + info.end]
        into.add(name, info.dtype, raw.view(_numpy_dtype(info.dtype, f"{where}: {name}")).reshape(info.shape), where)
    return checksums


def _read_torch(path: Path, into: Weights) -> None:
    import torch  # heavy: only for .pt inputs

    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise InvalidPublish(f"{path} is not a loadable torch state dict: {exc}") from exc
    if not isinstance(state, Mapping):
        raise InvalidPublish(f"{path} holds a {type(state).__name__}, not a state dict (name → tensor)")
    for name, tensor in state.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise InvalidPublish(f"{path}: entry {name!r} is not a tensor")
    add_tensors(state, str(path), into)


def add_tensors(tensors: Mapping[str, Any], where: str, into: Weights) -> None:
    """Add CPU torch tensors (views where they are contiguous: a trainer's sealed chunks are not copied)."""
    import torch

    for name, tensor in tensors.items():
        dtype = _FROM_TORCH.get(str(tensor.dtype).removeprefix("torch."))
        if dtype is None:
            raise InvalidPublish(f"{where}: tensor {name!r} has unsupported dtype {tensor.dtype}")
        raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        into.add(name, dtype, raw.view(_numpy_dtype(dtype, name)).reshape(tuple(tensor.shape)), where)


def load_weights(path: Path) -> Weights:
    """Tensors from a directory of *.safetensors, one .safetensors file, or a torch state dict (.pt/.pth/.bin)."""
    weights = Weights({}, {})
    if path.is_dir():
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise InvalidPublish(f"{path} has no *.safetensors files")
    elif path.is_file():
        files = [path]
    else:
        raise PublishNotFound(f"{path} does not exist")
    for file in files:
        if file.suffix in {".pt", ".pth", ".bin"}:
            _read_torch(file, weights)
        elif file.suffix == ".safetensors":
            if file.stat().st_size == 0:
                raise InvalidPublish(f"{file} is empty")
            read_safetensors(np.memmap(file, dtype=np.uint8, mode="r"), str(file), weights)
        else:
            raise InvalidPublish(f"{file}: expected a .safetensors file or a torch state dict (.pt, .pth, .bin)")
    if not weights.arrays:
        raise InvalidPublish(f"{path} holds no tensors")
    return weights


def check_same_layout(base: Weights, new: Weights, base_version: str) -> None:
    """A delta keeps every tensor name, dtype and shape (docs/checkpoint-format.md); else publish a full one."""
    old, cur = base.layout(), new.layout()
    problems = [f"missing {n}" for n in sorted(old.keys() - cur.keys())]
    problems += [f"new {n}" for n in sorted(cur.keys() - old.keys())]
    problems += [
        f"{n}: {old[n][0]}{list(old[n][1])} → {cur[n][0]}{list(cur[n][1])}"
        for n in sorted(old.keys() & cur.keys())
        if old[n] != cur[n]
    ]
    if problems:
        shown = "; ".join(problems[:8]) + (f"; and {len(problems) - 8} more" if len(problems) > 8 else "")
        raise InvalidPublish(
            f"the tensors do not match base {base_version!r} ({shown}); a delta cannot change the layout, "
            "publish a FullCheckpoint instead"
        )


def build_files(
    weights: Weights, *, version: str, shard_bytes: int, base: tuple[str, Weights] | None = None
) -> dict[str, bytes]:
    """{file name: bytes}: a full checkpoint, or the XOR delta from `base` = (base version, its weights)."""
    if base is None:
        files = ckpt.build_full_checkpoint(weights.arrays, shard_bytes)
        dtypes: Mapping[str, str] | None = weights.dtypes
    else:
        base_version, base_weights = base
        check_same_layout(base_weights, weights, base_version)
        files = ckpt.build_xor_delta(
            base_weights.arrays, weights.arrays, version=version, base_version=base_version, sparse=True
        )
        dtypes = None  # delta shards hold uint8 frames; the layout check above compared the real dtypes
    return {n: d if n == ckpt.INDEX_NAME else ckpt.canonical_shard(d, dtypes) for n, d in files.items()}
