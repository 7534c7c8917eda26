"""Sealed memfd chunks: the bytes, the layout, and that nobody can change them after sealing."""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import zlib

import pytest
import torch

from ferry.client.protocol import REQUIRED_SEALS
from ferry_agent.attach.memstore import ALIGN, seal_tensors

pytestmark = pytest.mark.unit


def sample() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return {
        "a.weight": torch.randn((64, 33), generator=gen),
        "b.bias": torch.randn(7, generator=gen).to(torch.bfloat16),
        "c.ids": torch.arange(5, dtype=torch.int64),
        "d.empty": torch.empty(0, 4),
        "e.flag": torch.tensor([True, False, True]),
    }


def read(fd: int, offset: int, nbytes: int) -> bytes:
    return os.pread(fd, nbytes, offset)


def test_bytes_manifest_and_seals():
    tensors = sample()
    sealed = seal_tensors(tensors, "ns/m/v1")
    assert [e.name for e in sealed.entries] == sorted(tensors)
    for e in sealed.entries:
        src = tensors[e.name]
        expected = src.reshape(-1).view(torch.uint8).numpy().tobytes() if src.numel() else b""
        assert read(sealed.fds[e.chunk], e.offset, e.nbytes) == expected
        assert e.adler32 == zlib.adler32(expected) and e.sha256 == hashlib.sha256(expected).hexdigest()
        assert e.offset % ALIGN == 0 and e.dtype == str(src.dtype).removeprefix("torch.")
        assert e.shape == tuple(src.shape)
    for fd in sealed.fds:
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & REQUIRED_SEALS == REQUIRED_SEALS
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        with pytest.raises(PermissionError):
            os.ftruncate(fd, 1 << 20)
        with pytest.raises(PermissionError):
            mmap.mmap(fd, ALIGN, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        with pytest.raises(PermissionError):
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, 0)  # F_SEAL_SEAL: not even the agent can loosen them
    sealed.unref()
    assert sealed.closed


def test_chunks_split_at_the_limit_and_a_big_tensor_gets_its_own():
    tensors = {f"t{i}": torch.full((256,), float(i)) for i in range(5)}  # 1 KiB each
    tensors["big"] = torch.ones(2048)  # 8 KiB, over the limit
    sealed = seal_tensors(tensors, "x", chunk_bytes=2048)
    by_name = {e.name: e for e in sealed.entries}
    assert len(sealed.fds) == len(sealed.chunk_sizes) == 4  # big | t0 t1 | t2 t3 | t4
    assert sealed.chunk_sizes[by_name["big"].chunk] == 8192
    assert by_name["t0"].chunk == by_name["t1"].chunk != by_name["t2"].chunk
    for e in sealed.entries:
        assert e.offset + e.nbytes <= sealed.chunk_sizes[e.chunk]
        assert read(sealed.fds[e.chunk], e.offset, e.nbytes) == tensors[e.name].numpy().tobytes()
    sealed.unref()


def test_leases_keep_the_memory_after_the_offer_goes():
    sealed = seal_tensors({"w": torch.ones(4)}, "x")
    sealed.lease()
    sealed.unref()  # the agent's own reference (withdrawn)
    assert not sealed.closed and sealed.leases == 1
    sealed.unlease()
    assert sealed.closed
    with pytest.raises(RuntimeError):
        sealed.lease()


def test_non_contiguous_is_refused():
    with pytest.raises(ValueError, match="contiguous"):
        seal_tensors({"w": torch.ones(4, 4).t()}, "x")


def test_more_chunks_than_one_reply_can_carry_are_refused():
    tensors = {f"t{i:03d}": torch.ones(64) for i in range(254)}  # one 256-B chunk each
    with pytest.raises(ValueError, match="253"):
        seal_tensors(tensors, "x", chunk_bytes=ALIGN)
