"""A staged refit (`stage_refit` + `apply`): only the differing elements, all or nothing; through the agent's
AttachService, which compares each version with the replica's previous one."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from ferry.client import AttachError, attach
from ferry.client import protocol as p
from ferry_agent.attach.server import Pod
from ferry_agent.attach.service import AttachService
from ferry_agent.store.resident import ResidentWeights

pytestmark = pytest.mark.unit

KEY, SPEC = ("ns", "ml-node"), {"modelLoad": "ml", "modelName": "m"}


def model() -> torch.nn.Module:
    net = torch.nn.ModuleDict({"a": torch.nn.Linear(32, 64), "b": torch.nn.Linear(64, 8)})
    net.register_buffer("scale", torch.zeros(16, dtype=torch.bfloat16))
    return net


def versions() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """v1, v2 and how many elements v2 changes. v2 changes a few elements of `a.weight` (one of them 0.0 to -0.0,
    equal as floats), all of `a.bias`, some of `b.weight` and `scale`; `b.bias` not at all. A NaN both versions
    have at the same place is no change, though NaN != NaN."""
    gen = torch.Generator().manual_seed(7)
    v1 = {n: torch.randn(t.shape, generator=gen).to(t.dtype) for n, t in model().state_dict().items()}
    v1["a.weight"][0, 0] = 0.0
    v1["a.weight"][1, 1] = float("nan")
    v2 = {n: t.clone() for n, t in v1.items()}
    v2["a.weight"][0, 0] = -0.0
    v2["a.weight"][5, :3] += 1
    v2["a.bias"] += 1
    v2["b.weight"][:, :10] *= 2
    v2["scale"][3] = 4.0
    return v1, v2, 1 + 3 + 64 + 8 * 10 + 1


def sha256(module: torch.nn.Module) -> dict[str, str]:
    return {
        n: hashlib.sha256(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
        for n, t in module.state_dict().items()
    }


def ptrs(module: torch.nn.Module) -> dict[str, int]:
    return {n: t.data_ptr() for n, t in module.state_dict().items()}


@pytest.fixture
def served() -> Iterator[tuple[Path, AttachService, dict, dict, int]]:
    """v1 served for the ModelLoad `ml` (`holding_v1` loads it, then serves v2); a pod's directory."""
    root = Path(tempfile.mkdtemp(prefix="ferry-t-", dir="/tmp"))  # sun_path is short: no pytest tmp_path
    service = AttachService(None, "node", root)  # no API: pods are added by hand
    service.server.start()
    try:
        pod = Pod(str(uuid.uuid4()), "ns", "engine")
        service.server.add_pod(pod)
        path = service.server.pods_dir / pod.uid
        assert (path / p.SOCKET_NAME).exists()
        v1, v2, changed = versions()
        service.serve(KEY, {**SPEC, "version": "v1"}, ResidentWeights(v1), "uid-1")
        yield path, service, v1, v2, changed
    finally:
        service.server.stop()
        shutil.rmtree(root, ignore_errors=True)


def holding_v1(served) -> torch.nn.Module:
    """A module loaded with v1; then v2 is served, compared with v1."""
    pod, service, _, v2, _ = served
    module = model()
    with attach("ml", socket_dir=pod, timeout=5, version="v1") as w1:
        w1.load_into(module)
    service.withdraw(KEY)
    service.serve(KEY, {**SPEC, "version": "v2"}, ResidentWeights(v2), "uid-2")
    return module


def whole_v2(pod: Path) -> dict[str, str]:
    fresh = model()
    with attach("ml", socket_dir=pod, timeout=5, version="v2") as w2:
        assert w2.load_into(fresh).loaded == sorted(fresh.state_dict())
    return sha256(fresh)


def test_a_staged_refit_writes_only_the_differing_elements_and_equals_a_whole_load(served):
    pod, *_, changed = served
    module = holding_v1(served)
    before, addresses = sha256(module), ptrs(module)
    with attach("ml", socket_dir=pod, timeout=5, version="v2") as w2:
        assert w2.base_uid == "uid-1"
        staged = w2.stage_refit(module)
        assert sha256(module) == before and ptrs(module) == addresses  # staging changes nothing
        assert staged.names == ["a.bias", "a.weight", "b.weight", "scale"] and staged.elements == changed
        result = staged.apply()
        with pytest.raises(AttachError, match="RefitFailed"):
            staged.apply()  # once
    assert result.loaded == ["a.bias", "a.weight", "b.weight", "scale"] and result.skipped == ["b.bias"]
    assert result.sparse == ["a.weight", "b.weight", "scale"]  # a.bias changed whole: written whole
    assert result.elements_changed == changed
    assert result.bytes_applied == (changed - 1) * 4 + 2
    assert sha256(module) == whole_v2(pod) and ptrs(module) == addresses
    assert sha256(module) != before


def test_load_into_only_changed_refits_sparsely_to_the_same_bytes(served):
    pod, _, _, _, changed = served
    module = holding_v1(served)
    addresses = ptrs(module)
    with attach("ml", socket_dir=pod, timeout=5, version="v2") as w2:
        result = w2.load_into(module, only_changed=True)
    assert result.sparse == ["a.weight", "b.weight", "scale"] and result.elements_changed == changed
    assert sha256(module) == whole_v2(pod) and ptrs(module) == addresses
    # A module that does not hold the base: staged, and loaded, whole.
    fresh = model()
    with attach("ml", socket_dir=pod, timeout=5, version="v2") as w2:
        staged = w2.stage_refit(fresh)
        assert staged.elements == sum(t.numel() for t in fresh.state_dict().values())
        result = staged.apply()
    assert result.sparse == [] and result.loaded == sorted(fresh.state_dict())
    assert sha256(fresh) == sha256(module)


def test_a_failure_part_way_restores_every_tensor_and_the_module_still_holds_the_base(served):
    pod, _, _, _, _ = served
    module = holding_v1(served)
    before, addresses = sha256(module), ptrs(module)
    seen: list[str] = []

    def fail_at_b_weight(name: str) -> None:
        seen.append(name)
        if name == "b.weight":
            raise RuntimeError("injected")

    with attach("ml", socket_dir=pod, timeout=5, version="v2") as w2:
        with pytest.raises(AttachError, match=r"'b\.weight': injected") as failed:
            w2.stage_refit(module).apply(before_tensor=fail_at_b_weight)
        assert failed.value.code == "RefitFailed"
        assert seen == ["a.bias", "a.weight", "b.weight"]  # two written before it, then undone
        assert sha256(module) == before and ptrs(module) == addresses
        # Still the base, so the next try refits again.
        result = w2.load_into(module, only_changed=True)
    assert result.skipped == ["b.bias"] and sha256(module) == whole_v2(pod)


def test_a_tensor_swapped_after_staging_fails_the_refit_and_restores_the_others(served):
    pod, _, _, _, _ = served
    module = holding_v1(served)
    before = sha256(module)
    with attach("ml", socket_dir=pod, timeout=5, version="v2") as w2:
        staged = w2.stage_refit(module)
        module["b"].weight = torch.nn.Parameter(torch.zeros(8, 63))  # the engine swapped it: a wrong shape
        with pytest.raises(AttachError, match=r"RefitFailed: tensor 'b\.weight'.*now \(8, 63\)"):
            staged.apply()
    after = sha256(module)
    assert {n: h for n, h in after.items() if n != "b.weight"} == {n: h for n, h in before.items() if n != "b.weight"}


def test_staging_checks_shapes_first_and_changes_nothing(served):
    pod, _, _, _, _ = served
    module = holding_v1(served)
    module["b"] = torch.nn.Linear(64, 9)
    before = sha256(module)
    with (
        attach("ml", socket_dir=pod, timeout=5, version="v2") as w2,
        pytest.raises(AttachError, match="ShapeMismatch"),
    ):
        w2.stage_refit(module)
    assert sha256(module) == before
