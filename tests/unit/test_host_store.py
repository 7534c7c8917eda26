"""The agent's host store: one copy in sealed memfd chunks, read-only in the agent too, counted, within a budget."""

from __future__ import annotations

import fcntl
import gc
import hashlib
import mmap
import os
import zlib

import pytest
import torch

from ferry.client.protocol import REQUIRED_SEALS
from ferry_agent.attach.memstore import (
    SHMEM_HUGE_PAGES,
    HostStore,
    MemoryBudgetExceeded,
    parse_bytes,
    sealed_of,
    shmem_huge_pages,
)
from ferry_agent.store.resident import TensorSpec

pytestmark = pytest.mark.unit

KEY = ("ns", "ml-node")


def specs() -> list[TensorSpec]:
    return [
        TensorSpec("a.weight", "torch.float32", (64, 32), 64 * 32 * 4),
        TensorSpec("b.bias", "torch.bfloat16", (7,), 14),
        TensorSpec("c.empty", "torch.float32", (0, 4), 0),
    ]


def filled(store: HostStore, seed: int = 1):
    resident = store.allocate(KEY, specs(), "ns/m/v1")
    gen = torch.Generator().manual_seed(seed)
    for t in resident.tensors.values():
        if t.numel():
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    return resident


def mapping_perms(addr: int) -> str:
    with open("/proc/self/maps") as maps:
        for line in maps:
            span, perms = line.split()[:2]
            lo, hi = (int(x, 16) for x in span.split("-"))
            if lo <= addr < hi:
                return perms
    raise AssertionError(f"{addr:#x} is not mapped")


def test_sealing_keeps_the_tensors_in_place_and_makes_the_agents_own_mapping_read_only():
    store = HostStore()
    resident = filled(store)
    before = {n: (t.data_ptr(), t.clone()) for n, t in resident.tensors.items()}
    assert mapping_perms(resident.tensors["a.weight"].data_ptr()) == "rw-s"
    sealed = store.seal(resident, "ns/m/v1", "v1")
    assert sealed_of(resident) is sealed and store.seal(resident, "ns/m/v1") is sealed
    for name, tensor in resident.tensors.items():
        ptr, value = before[name]
        assert tensor.data_ptr() == ptr and torch.equal(tensor, value)  # the same memory, no copy
    assert mapping_perms(resident.tensors["a.weight"].data_ptr()) == "r--s"  # the agent cannot write it either
    for e in sealed.entries:
        expected = resident.tensors[e.name].reshape(-1).view(torch.uint8).numpy().tobytes()
        assert os.pread(sealed.fds[e.chunk], e.nbytes, e.offset) == expected  # what attach hands out is it too
        assert e.adler32 == zlib.adler32(expected) and e.sha256 == hashlib.sha256(expected).hexdigest()
    for fd in sealed.fds:
        assert fcntl.fcntl(fd, fcntl.F_GET_SEALS) & REQUIRED_SEALS == REQUIRED_SEALS
        with pytest.raises(PermissionError):
            os.pwrite(fd, b"x", 0)
        with pytest.raises(PermissionError):
            mmap.mmap(fd, 256, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)


def test_registered_weights_are_not_sealed():
    store = HostStore()
    resident = filled(store)
    resident.registration = object()  # as NixlPeer.register leaves it
    with pytest.raises(RuntimeError, match="deregister"):
        store.seal(resident, "x")


def test_accounting_counts_tensor_bytes_until_the_last_hold_goes():
    store = HostStore()
    resident = filled(store)
    total = sum(s.nbytes for s in specs())
    assert store.resident_bytes() == total  # being loaded counts already
    sealed = store.seal(resident, "ns/m/v1", "v1")
    assert store.resident_bytes(KEY) == store.resident_bytes() == total
    assert [v.version for v in store.versions(KEY)] == ["v1"]
    sealed.lease()
    sealed.unref()  # the replica let go; a pod still holds it
    assert store.resident_bytes(KEY) == total
    freed = []
    store.on_change = lambda: freed.append(True)
    sealed.unlease()
    assert sealed.closed and store.resident_bytes() == 0 and store.versions(KEY) == [] and freed


def test_a_load_that_fails_before_sealing_gives_its_memory_back():
    store = HostStore()
    resident = filled(store)
    assert store.resident_bytes() > 0
    del resident
    gc.collect()
    assert store.resident_bytes() == 0


def test_the_budget_refuses_what_does_not_fit_and_says_how_much():
    total = sum(s.nbytes for s in specs())
    store = HostStore(budget_bytes=total + 10)
    store.seal(filled(store), "ns/m/v1", "v1")
    allocate = store.allocator(KEY, "ns/m/v2")
    with pytest.raises(MemoryBudgetExceeded) as refused:
        allocate(specs(), "cpu")
    assert (refused.value.needed, refused.value.available) == (total, 10)
    assert f"needs {total} bytes" in str(refused.value) and "10 of the" in str(refused.value)
    assert store.take_refusal(KEY) is refused.value and store.take_refusal(KEY) is None
    assert store.resident_bytes() == total  # nothing of the refused load was taken


@pytest.mark.parametrize(
    ("text", "value"), [("64Gi", 64 << 30), ("500M", 500 * 10**6), ("1073741824", 1 << 30), ("8Ki", 8192)]
)
def test_byte_quantities(text, value):
    assert parse_bytes(text) == value


@pytest.mark.parametrize("text", ["", "Gi", "1.5Gi", "-1", "12 apples"])
def test_bad_byte_quantities(text):
    with pytest.raises(ValueError):
        parse_bytes(text)


def test_a_delta_shares_the_held_versions_chunks_for_what_it_does_not_change():
    store = HostStore()
    v1 = filled(store)
    base = store.seal(v1, "ns/m/v1", "v1", "uid-1")
    asked = []

    def unchanged(version):
        asked.append(version.version)
        return ["a.weight", "c.empty"]  # b.bias changed; an empty tensor is never worth sharing

    v2 = store.allocate(KEY, specs(), "ns/m/v2", unchanged)
    assert asked == ["v1"] and v2.shared == {"a.weight"}
    assert v2.shared_from is base  # held while loading: a delta may replay on the base's other tensors
    assert torch.equal(v2.tensors["a.weight"], v1.tensors["a.weight"])  # the base's bytes, mapped again
    assert mapping_perms(v2.tensors["a.weight"].data_ptr()) == "r--s"  # and never writable
    v2.tensors["b.bias"].fill_(3)
    sealed = store.seal(v2, "ns/m/v2", "v2", "uid-2")
    assert v2.shared_from is None
    by_name = {e.name: e for e in sealed.entries}
    assert by_name["a.weight"].sha256 == next(e.sha256 for e in base.entries if e.name == "a.weight")
    assert os.pread(sealed.fds[by_name["a.weight"].chunk], 16, by_name["a.weight"].offset) == os.pread(
        base.fds[0], 16, next(e.offset for e in base.entries if e.name == "a.weight")
    )
    assert len(sealed.fds) == 2  # its own chunk (b.bias, c.empty) and the base's
    total, bias = sum(s.nbytes for s in specs()), 14
    assert store.resident_bytes(KEY) == total + bias  # the shared chunk once
    base.unref()  # v1 released: its chunk stays, v2 reads from it
    assert [v.version for v in store.versions(KEY)] == ["v2"] and store.resident_bytes(KEY) == total + bias
    sealed.unref()
    assert store.resident_bytes() == 0


def test_sharing_needs_the_same_dtype_and_shape_and_a_held_version():
    store = HostStore()
    store.seal(filled(store), "ns/m/v1", "v1").unref()  # not held any more
    assert store.allocate(KEY, specs(), "ns/m/v2", lambda v: ["a.weight"]).shared == frozenset()
    held = store.seal(filled(store), "ns/m/v1", "v1")
    other = [TensorSpec("a.weight", "torch.float16", (64, 32), 64 * 32 * 2)]
    assert store.allocate(KEY, other, "ns/m/v3", lambda v: ["a.weight"]).shared == frozenset()
    held.unref()


def test_a_shared_refit_fits_a_budget_a_second_copy_would_not():
    total = sum(s.nbytes for s in specs())
    store = HostStore(budget_bytes=total + 100)
    store.seal(filled(store), "ns/m/v1", "v1")
    with pytest.raises(MemoryBudgetExceeded):
        store.allocate(KEY, specs(), "ns/m/v2")
    v2 = store.allocate(KEY, specs(), "ns/m/v2", lambda v: ["a.weight"])
    assert v2.shared == {"a.weight"} and store.resident_bytes() == total + 14


@pytest.mark.parametrize(
    ("text", "mode", "huge"),
    [
        ("always within_size advise [never] deny force\n", "never", False),
        ("always within_size [advise] never deny force\n", "advise", True),
        ("always [within_size] advise never deny force\n", "within_size", True),
        ("always within_size advise never [deny] force\n", "deny", False),
        ("[always] within_size advise never deny force\n", "always", True),
    ],
)
def test_the_hosts_shmem_huge_page_mode_is_read_from_its_setting(tmp_path, text, mode, huge):
    (setting := tmp_path / "shmem_enabled").write_text(text)
    assert shmem_huge_pages(setting) == (mode, huge)
    assert shmem_huge_pages(tmp_path / "absent") == (None, False)  # a kernel without THP


def test_the_agent_says_whether_its_chunks_get_huge_pages(monkeypatch, caplog):
    from ferry_agent import metrics, node_agent

    monkeypatch.setattr(node_agent, "shmem_huge_pages", lambda: ("never", False))
    with caplog.at_level("INFO", logger="ferry.agent"):
        node_agent.report_huge_pages()
    assert metrics.SHMEM_HUGE_PAGES._value.get() == 0
    assert any(r.levelname == "WARNING" and "is never" in r.getMessage() for r in caplog.records)
    caplog.clear()
    monkeypatch.setattr(node_agent, "shmem_huge_pages", lambda: ("advise", True))
    with caplog.at_level("INFO", logger="ferry.agent"):
        node_agent.report_huge_pages()
    assert metrics.SHMEM_HUGE_PAGES._value.get() == 1
    assert [r.levelname for r in caplog.records] == ["INFO"]


def pmd_mapped_kib(addr: int) -> int:
    """ShmemPmdMapped of the mapping holding `addr`: its bytes mapped as 2 MiB pages."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= addr < hi
            elif inside and head == "ShmemPmdMapped:":
                return int(line.split()[1])
    raise AssertionError(f"{addr:#x} is not mapped")


@pytest.fixture
def shmem_setting():
    """Sets the host's shmem huge-page mode for a test (root only) and puts the old one back."""
    mode, _ = shmem_huge_pages()
    if mode is None or not os.access(SHMEM_HUGE_PAGES, os.W_OK):
        pytest.skip(f"needs root and a writable {SHMEM_HUGE_PAGES}")
    yield lambda value: SHMEM_HUGE_PAGES.write_text(value)
    SHMEM_HUGE_PAGES.write_text(mode)


def test_chunks_get_huge_pages_where_the_host_allows_them_for_shmem(shmem_setting):
    store = HostStore()
    spec = [TensorSpec("w", "torch.uint8", (8 << 20,), 8 << 20)]
    for mode, huge in (("never", False), ("advise", True)):
        shmem_setting(mode)
        resident = store.allocate(KEY, spec, f"ns/m/{mode}")
        tensor = resident.tensors["w"]
        tensor.fill_(7)  # faults every page in, under the mode in force now
        kib = pmd_mapped_kib(tensor.data_ptr())
        assert (kib >= 4096) if huge else (kib == 0), f"{mode}: {kib} KiB in 2 MiB pages"
        assert int(tensor.sum()) == 7 * (8 << 20)
        del resident, tensor
        gc.collect()
