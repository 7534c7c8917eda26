"""Replay-chain resolution: every reason, the 64/65 boundary, cycles, deep chains."""

from __future__ import annotations

import time

import pytest

from ferry.chain import ChainReason, ChainResult, VersionView, dependents, resolve_chain

pytestmark = pytest.mark.unit


def view(
    name: str,
    fmt: str = "XorDelta",
    base: str | None = None,
    *,
    model: str = "llama",
    layout: str | None = None,
    ready: bool = True,
    deleting: bool = False,
    storage: bool = True,
) -> VersionView:
    return VersionView(name, model, fmt, base, layout, ready, deleting, storage)


class Store:
    """A lookup over a dict that counts calls, to prove walks are bounded."""

    def __init__(self, *views: VersionView) -> None:
        self.views = {v.name: v for v in views}
        self.calls = 0

    def add(self, *views: VersionView) -> Store:
        self.views.update((v.name, v) for v in views)
        return self

    def __call__(self, name: str) -> VersionView | None:
        self.calls += 1
        return self.views.get(name)


def linear(n: int, **kw: object) -> Store:
    """v0 (FullCheckpoint) ← v1 ← … ← v{n-1}: a chain of n versions."""
    store = Store(view("v0", "FullCheckpoint"))
    for i in range(1, n):
        store.add(view(f"v{i}", base=f"v{i - 1}", **kw))  # type: ignore[arg-type]
    return store


def test_reasons_are_a_fixed_camelcase_list() -> None:
    assert [r.value for r in ChainReason] == [r.name for r in ChainReason]
    assert set(ChainReason) == {
        "Resolved",
        "BaseNotFound",
        "BaseNotReady",
        "ModelMismatch",
        "ChainCycle",
        "ChainTooLong",
        "LayoutMismatch",
        "UnsupportedFormat",
    }


@pytest.mark.parametrize("fmt", ["FullCheckpoint", "PeerOnly"])
def test_self_contained_formats_are_their_own_chain(fmt: str) -> None:
    result = resolve_chain("solo", Store(view("solo", fmt, storage=fmt != "PeerOnly")))
    assert result == ChainResult(True, ChainReason.Resolved, result.message, ("solo",))
    assert result.depth == 1
    assert "solo" in result.message


def test_full_checkpoint_readiness_does_not_matter_to_its_own_chain() -> None:
    assert resolve_chain("v0", Store(view("v0", "FullCheckpoint", ready=False, deleting=True))).ok


def test_delta_chain_root_first() -> None:
    result = resolve_chain("v3", linear(4))
    assert result.ok and result.reason == ChainReason.Resolved
    assert result.chain == ("v0", "v1", "v2", "v3")
    assert result.depth == 4
    assert "v0 → v1 → v2 → v3" in result.message


def test_missing_target() -> None:
    result = resolve_chain("ghost", Store())
    assert (result.ok, result.reason, result.chain, result.depth) == (False, ChainReason.BaseNotFound, (), 0)
    assert "ghost" in result.message


def test_missing_direct_base_names_it() -> None:
    result = resolve_chain("v1", Store(view("v1", base="v0")))
    assert result.reason == ChainReason.BaseNotFound and not result.ok
    assert result.message == "Base version v0 of v1 does not exist."


def test_missing_base_deep_in_chain_names_it_and_the_path() -> None:
    store = linear(4)
    del store.views["v0"]
    result = resolve_chain("v3", store)
    assert result.reason == ChainReason.BaseNotFound
    assert "Base version v0 of v1 does not exist" in result.message
    assert "v3 → v2 → v1 → v0" in result.message


def test_model_mismatch_names_both_models() -> None:
    store = linear(3).add(view("v0", "FullCheckpoint", model="mistral"))
    result = resolve_chain("v2", store)
    assert result.reason == ChainReason.ModelMismatch and result.chain == ()
    assert "'llama'" in result.message and "'mistral'" in result.message and "v0" in result.message


@pytest.mark.parametrize(
    ("views", "path"),
    [
        ([view("a", base="a")], "a → a"),
        ([view("a", base="b"), view("b", base="a")], "a → b → a"),
        ([view("a", base="b"), view("b", base="c"), view("c", base="a")], "a → b → c → a"),
    ],
    ids=["length-1", "length-2", "length-3"],
)
def test_cycles(views: list[VersionView], path: str) -> None:
    store = Store(*views)
    result = resolve_chain("a", store)
    assert result.reason == ChainReason.ChainCycle and not result.ok
    assert path in result.message
    assert store.calls == len(views)  # each version looked up once


def test_cycle_behind_the_target_shows_only_the_loop() -> None:
    store = Store(view("t", base="a"), view("a", base="b"), view("b", base="a"))
    result = resolve_chain("t", store)
    assert result.reason == ChainReason.ChainCycle
    assert result.message.endswith("cycle: a → b → a.")


def test_long_cycle_is_cut_short_and_message_stays_small() -> None:
    n = 60
    store = Store(*(view(f"c{i}", base=f"c{(i + 1) % n}") for i in range(n)))
    result = resolve_chain("c0", store)
    assert result.reason == ChainReason.ChainCycle
    assert "more" in result.message and len(result.message) < 300
    assert store.calls == n


def test_chain_of_exactly_max_length_is_allowed() -> None:
    result = resolve_chain("v63", linear(64))
    assert result.ok and result.depth == 64 and result.chain[0] == "v0"


def test_chain_one_longer_than_max_is_too_long() -> None:
    store = linear(65)
    result = resolve_chain("v64", store)
    assert result.reason == ChainReason.ChainTooLong and result.chain == ()
    assert "64" in result.message
    assert store.calls == 64  # never looked beyond the limit


def test_custom_max_length_boundary() -> None:
    assert resolve_chain("v2", linear(3), max_length=3).ok
    assert resolve_chain("v3", linear(4), max_length=3).reason == ChainReason.ChainTooLong
    assert resolve_chain("v0", linear(1), max_length=1).ok
    with pytest.raises(ValueError):
        resolve_chain("v0", linear(1), max_length=0)


def test_cycle_longer_than_max_is_reported_as_too_long_without_looping() -> None:
    n = 1000
    store = Store(*(view(f"c{i}", base=f"c{(i + 1) % n}") for i in range(n)))
    result = resolve_chain("c0", store)
    assert result.reason == ChainReason.ChainTooLong
    assert store.calls == 64


def test_deep_chains_are_fast() -> None:
    store = linear(1000)
    started = time.perf_counter()
    too_long = resolve_chain("v999", store)
    resolved = resolve_chain("v999", store, max_length=1000)
    elapsed = time.perf_counter() - started
    assert too_long.reason == ChainReason.ChainTooLong
    assert resolved.ok and resolved.depth == 1000 and resolved.chain[0] == "v0" and resolved.chain[-1] == "v999"
    assert len(resolved.message) < 300  # the path is elided
    assert elapsed < 0.5


def test_layout_mismatch_names_both_signatures() -> None:
    store = Store(
        view("v0", "FullCheckpoint", layout="sig-a"),
        view("v1", base="v0"),  # empty signatures are compatible with anything
        view("v2", base="v1", layout="sig-b"),
    )
    result = resolve_chain("v2", store)
    assert result.reason == ChainReason.LayoutMismatch
    assert "'sig-a'" in result.message and "'sig-b'" in result.message


def test_matching_or_empty_layouts_resolve() -> None:
    store = Store(
        view("v0", "FullCheckpoint", layout="sig"),
        view("v1", base="v0"),
        view("v2", base="v1", layout="sig"),
    )
    assert resolve_chain("v2", store).ok


def test_layout_mismatch_below_the_target() -> None:
    store = Store(
        view("v0", "FullCheckpoint", layout="x"),
        view("v1", base="v0", layout="y"),
        view("v2", base="v1"),
    )
    assert resolve_chain("v2", store).reason == ChainReason.LayoutMismatch


def test_peer_only_base_is_unsupported() -> None:
    result = resolve_chain("v1", Store(view("v0", "PeerOnly", storage=False), view("v1", base="v0")))
    assert result.reason == ChainReason.UnsupportedFormat
    assert "PeerOnly" in result.message and "v0" in result.message


def test_full_checkpoint_with_a_base_is_unsupported() -> None:
    store = Store(view("v0", "FullCheckpoint"), view("v1", "FullCheckpoint", base="v0"), view("v2", base="v1"))
    for name in ("v1", "v2"):
        result = resolve_chain(name, store)
        assert result.reason == ChainReason.UnsupportedFormat and "root" in result.message


def test_unknown_format_is_unsupported() -> None:
    assert resolve_chain("x", Store(view("x", "Lora"))).reason == ChainReason.UnsupportedFormat
    result = resolve_chain("v1", Store(view("v0", "Mystery"), view("v1", base="v0")))
    assert result.reason == ChainReason.UnsupportedFormat and "'Mystery'" in result.message


def test_delta_without_base_is_unsupported() -> None:
    assert resolve_chain("d", Store(view("d"))).reason == ChainReason.UnsupportedFormat


def test_links_without_storage_cannot_be_replayed() -> None:
    assert resolve_chain("v1", Store(view("v0", "FullCheckpoint", storage=False), view("v1", base="v0"))).reason == (
        ChainReason.UnsupportedFormat
    )
    assert resolve_chain("v1", Store(view("v0", "FullCheckpoint"), view("v1", base="v0", storage=False))).reason == (
        ChainReason.UnsupportedFormat
    )


def test_direct_base_not_ready() -> None:
    store = linear(3).add(view("v1", base="v0", ready=False))
    result = resolve_chain("v2", store)
    assert result.reason == ChainReason.BaseNotReady and result.chain == ()
    assert result.message == "Base version v1 is not Ready yet."


def test_direct_base_being_released() -> None:
    store = linear(3).add(view("v1", base="v0", deleting=True))
    result = resolve_chain("v2", store)
    assert result.reason == ChainReason.BaseNotReady
    assert "v1" in result.message and "released" in result.message


def test_only_the_direct_base_must_be_ready() -> None:
    store = linear(3).add(view("v0", "FullCheckpoint", ready=False))
    assert resolve_chain("v2", store).ok


def test_structural_checks_come_before_readiness() -> None:
    store = Store(
        view("v0", "FullCheckpoint", model="other"), view("v1", base="v0", ready=False), view("v2", base="v1")
    )
    assert resolve_chain("v2", store).reason == ChainReason.ModelMismatch
    store = Store(view("v1", base="v0", ready=False), view("v2", base="v1"))
    assert resolve_chain("v2", store).reason == ChainReason.BaseNotFound


T = "2026-01-01T00:00:00Z"


def test_from_body() -> None:
    body = {
        "apiVersion": "ferry.dev/v1alpha1",
        "kind": "WeightVersion",
        "metadata": {"name": "v2", "deletionTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {
            "modelName": "llama",
            "format": "XorDelta",
            "baseVersion": "v1",
            "layoutSignature": "sig",
            "storage": {"uri": "s3://bucket/v2/model.safetensors.index.json"},
        },
        "status": {
            "conditions": [
                {"type": "ChainResolved", "status": "True", "reason": "Resolved", "lastTransitionTime": T},
                {"type": "Ready", "status": "True", "reason": "Verified", "lastTransitionTime": T},
            ]
        },
    }
    assert VersionView.from_body(body) == VersionView(
        "v2",
        "llama",
        "XorDelta",
        "v1",
        "sig",
        True,
        True,
        True,
        storage_uri="s3://bucket/v2/model.safetensors.index.json",
    )


def test_from_body_minimal() -> None:
    body = {"metadata": {"name": "p"}, "spec": {"modelName": "m", "format": "PeerOnly"}}
    assert VersionView.from_body(body) == VersionView("p", "m", "PeerOnly", None, None, False, False, False)
    body["status"] = {
        "conditions": [{"type": "Ready", "status": "False", "reason": "BaseNotReady", "lastTransitionTime": T}]
    }
    assert not VersionView.from_body(body).ready


def test_dependents() -> None:
    views = [
        view("v0", "FullCheckpoint"),
        view("v2", base="v0"),
        view("v1", base="v0"),
        view("gone", base="v0", deleting=True),
        view("v3", base="v1"),
    ]
    assert dependents("v0", views) == ["v1", "v2"]
    assert dependents("v1", views) == ["v3"]
    assert dependents("v3", views) == []
