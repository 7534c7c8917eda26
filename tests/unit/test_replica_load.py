"""Node seeds: keyed by namespace/model/version, used only for a Ready WeightVersion of the model whose recorded
tensor count and size the file matches; the read guard of a loaded rank names what it loaded; and when a replica
holding a version of the target's chain loads the small deltas after it from S3 before peers."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ferry_agent.replica_load import deltas_first, read_guard
from ferry_agent.strategies.chain import LoadContext, StrategyFailed
from ferry_agent.strategies.local_file import LocalFileStrategy, SeedKey, parse_seed
from ferry_agent.transport.worker_auth import WorkerAuth

pytestmark = pytest.mark.unit

TENSORS = {"a": torch.arange(8, dtype=torch.float32), "b": torch.ones(4, dtype=torch.float16)}  # 32 + 8 bytes


def version(model: str = "m", ready: str = "True", **status) -> dict:
    return {
        "metadata": {"name": "v1", "uid": "uid-1"},
        "spec": {"modelName": model},
        "status": {"conditions": [{"type": "Ready", "status": ready}], **status},
    }


@pytest.fixture
def seed(tmp_path: Path) -> Path:
    path = tmp_path / "v1.safetensors"
    save_file(TENSORS, str(path))
    return path


def strategy(seed: Path, body: dict | None, namespace: str = "team-a") -> LocalFileStrategy:
    return LocalFileStrategy({SeedKey("team-a", "org/m", "v1"): seed}, namespace, lambda name: body)


def ctx(model: str = "org/m") -> LoadContext:
    return LoadContext(model=model, version="v1", rank=0, target_id="wr")


def test_parse_seed_takes_namespace_model_with_slashes_and_version() -> None:
    assert parse_seed("team-a/org/m/v1=/x/y.safetensors") == (
        SeedKey("team-a", "org/m", "v1"),
        Path("/x/y.safetensors"),
    )
    for bad in ("v1=/x", "team-a/v1=/x", "team-a/m/v1", "team-a/m/=/x", "/m/v1=/x"):
        with pytest.raises(ValueError, match="NAMESPACE/MODEL/VERSION=PATH"):
            parse_seed(bad)


def test_a_seed_serves_only_its_namespace_and_model(seed: Path) -> None:
    assert strategy(seed, version("org/m")).is_available(ctx())
    assert not strategy(seed, version("org/m"), namespace="team-b").is_available(ctx())
    assert not strategy(seed, version("other")).is_available(ctx("other"))


def test_a_matching_seed_loads_and_names_the_version_object(seed: Path) -> None:
    c = ctx()
    loaded = strategy(seed, version("org/m", tensorCount=2, totalBytes=40)).load(c)
    assert sorted(loaded.resident.tensors) == ["a", "b"] and loaded.bytes_moved == 40
    assert c.version_uid == "uid-1"


@pytest.mark.parametrize(
    ("body", "why"),
    [
        (None, "does not exist"),
        (version("org/m", ready="False"), "is not Ready"),
        (version("org/x"), "is for model"),
        (version("org/m", tensorCount=3), "tensorCount 2, the WeightVersion has 3"),
        (version("org/m", totalBytes=41), "totalBytes 40, the WeightVersion has 41"),
    ],
)
def test_a_seed_is_refused_for_a_version_it_does_not_hold(seed: Path, body: dict | None, why: str) -> None:
    c = ctx()
    with pytest.raises(StrategyFailed, match=why) as failed:
        strategy(seed, body).load(c)
    assert not failed.value.mutated and c.version_uid is None


def test_the_read_guard_serves_the_version_the_rank_loaded() -> None:
    auth = WorkerAuth(
        reviewer=None, assignments=None, allowed_identities=["system:serviceaccount:ferry-system:ferry-agent"]
    )  # type: ignore[arg-type]
    c = ctx()
    c.version = "v9"  # what the ranks agreed on and loaded, whatever the spec says by now
    guard = read_guard(auth, "team-a", c)
    assert guard is not None and (guard.served.namespace, guard.served.model, guard.served.version) == (
        "team-a",
        "org/m",
        "v9",
    )
    assert read_guard(None, "team-a", c) is None


# ---------------------------------------------------------------- deltas first


@dataclass
class Held:
    """What `deltas_first` reads of a sealed version in host memory."""

    version: str
    uid: str
    total_bytes: int = 1000


def chain(*sizes: int) -> dict[str, dict]:
    """v0 (a full checkpoint of 1000 bytes) and deltas v1..vn of the given stored sizes, each with its chain."""
    names = [f"v{i}" for i in range(len(sizes) + 1)]
    return {
        name: {
            "metadata": {"name": name, "uid": f"uid-{name}"},
            "status": {"chain": names[: i + 1], "totalBytes": ([1000, *sizes])[i]},
        }
        for i, name in enumerate(names)
    }


@pytest.mark.parametrize(
    ("held", "sizes", "expected"),
    [
        ([Held("v0", "uid-v0")], (100,), ("v0", 100, 1000)),
        ([Held("v0", "uid-v0"), Held("v2", "uid-v2")], (100, 100, 200), ("v2", 200, 1000)),  # the newest held
        ([Held("v0", "uid-v0")], (100, 100, 100), None),  # 300 of 1000: copying from a peer is not worse
        ([Held("v0", "uid-of-a-deleted-v0")], (100,), None),  # another WeightVersion object of that name
        ([Held("v1", "uid-v1")], (100,), None),  # the target itself: nothing to replay
        ([], (100,), None),
    ],
)
def test_deltas_first_when_the_replica_holds_a_version_of_the_chain_and_the_deltas_are_small(
    held: list[Held], sizes: tuple[int, ...], expected: tuple[str, int, int] | None
) -> None:
    versions = chain(*sizes)
    looked: list[str] = []

    def lookup(name: str) -> dict | None:
        looked.append(name)
        return versions.get(name)

    assert deltas_first(f"v{len(sizes)}", lookup, held) == expected
    assert len(looked) == len(set(looked)), looked  # each version read from the API once


def test_deltas_first_needs_every_delta_sized_and_the_chain_recorded() -> None:
    versions = chain(100, 100)
    del versions["v2"]["status"]["totalBytes"]  # not verified yet
    assert deltas_first("v2", versions.get, [Held("v0", "uid-v0")]) is None
    versions = chain(100)
    del versions["v1"]["status"]["chain"]
    assert deltas_first("v1", versions.get, [Held("v0", "uid-v0")]) is None
    assert deltas_first("nope", versions.get, [Held("v0", "uid-v0")]) is None
