"""Retention policy (which versions go) and the deletion of exactly one version's objects, without a cluster."""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
from typing import Any

import numpy as np
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError

from ferry import checkpoint_format as ckpt
from ferry.api.models import ModelLoadSpec, RetentionReason
from ferry.chain import VersionView
from ferry.storage import delete_checkpoint
from ferry_operator.handlers import retention as retention_handlers
from ferry_operator.indexes import Indexes
from ferry_operator.indexkeys import of_model, version_keys
from ferry_operator.retention import (
    LoadFacts,
    held_versions,
    model_policies,
    newest_first,
    plan_retirements,
)

pytestmark = pytest.mark.unit


def wv(
    name: str,
    base: str | None = None,
    *,
    model: str = "m",
    ready: bool = True,
    deleting: bool = False,
    created: str = "2026-01-01T00:00:00Z",
) -> VersionView:
    return VersionView(
        name,
        model,
        "XorDelta" if base else "FullCheckpoint",
        base,
        None,
        ready,
        deleting,
        True,
        uid=f"uid-{name}",
        created=created,
        ready_time=created if ready else "",
    )


def ml(name: str, desired: str, keep: int | None = None, *, model: str = "m", storage: bool = False) -> LoadFacts:
    return LoadFacts(name, f"uid-{name}", model, desired, keep, storage)


def chain(*names: str, keyframes: tuple[str, ...] = ()) -> list[VersionView]:
    """names[0] full, each next a delta on the previous unless it is a keyframe (a full checkpoint)."""
    out, previous = [], None
    for name in names:
        out.append(wv(name, None if previous is None or name in keyframes else previous))
        previous = name
    return out


def retired(versions, loads, held=()) -> list[str]:
    return [r.version for r in plan_retirements(versions, loads, held)]


def test_a_linear_chain_keeps_every_base_of_the_newest():
    # v5 replays v1..v4: nothing of a single chain can go while its head stays.
    assert retired(chain("v1", "v2", "v3", "v4", "v5"), [ml("serve", "v5", 2)]) == []


def test_a_keyframe_frees_the_old_chain_newest_first():
    versions = chain("v1", "v2", "v3", "v4", "v5", "v6", keyframes=("v4",))
    plan = plan_retirements(versions, [ml("serve", "v6", 2, storage=True)], ())
    assert [r.version for r in plan] == ["v3", "v2", "v1"]
    assert {(r.owner, r.keep_last, r.delete_storage, r.uid) for r in plan[:1]} == {("serve", 2, True, "uid-v3")}
    assert "newest 2 Ready versions of model m" in plan[0].message


def test_a_reader_holding_an_old_version_keeps_it_and_its_bases():
    versions = chain("v1", "v2", "v3", "v4", "v5", "v6", keyframes=("v4",))
    assert retired(versions, [ml("serve", "v6", 2)], held={"v2"}) == ["v3"]
    assert retired(versions, [ml("serve", "v6", 2)], held={"v3"}) == []


def test_keep_last_boundary():
    versions = [wv(f"v{i}") for i in range(1, 6)]  # five full checkpoints
    assert retired(versions, [ml("serve", "v5", 5)]) == []
    assert retired(versions, [ml("serve", "v5", 4)]) == ["v1"]
    assert retired(versions, [ml("serve", "v5", 1)]) == ["v4", "v3", "v2", "v1"]


def test_desired_versions_of_any_modelload_stay():
    versions = [wv(f"v{i}") for i in range(1, 6)] + [wv("o1", model="other")]
    loads = [ml("serve", "v5", 1), ml("eval", "v2"), ml("foreign", "v3", model="other")]
    assert retired(versions, loads) == ["v4", "v1"]


def test_only_ready_live_versions_count_and_go():
    versions = [wv("v1"), wv("v2"), wv("v3", ready=False), wv("v4", deleting=True), wv("v5")]
    # Ready: v1, v2, v5; keep the newest two. v3 may still become Ready, v4 is already on its way out.
    assert retired(versions, [ml("serve", "v5", 2)]) == ["v1"]


def test_a_version_not_ready_yet_keeps_its_base():
    versions = [wv("v1"), wv("v2"), wv("v3"), wv("d", "v1", ready=False)]
    assert retired(versions, [ml("serve", "v3", 1)]) == ["v2"]


def test_a_deleting_dependent_does_not_keep_its_base():
    versions = [wv("v1"), wv("d", "v1", deleting=True), wv("v2"), wv("v3")]
    assert retired(versions, [ml("serve", "v3", 2)]) == ["v1"]


def test_several_policies_of_one_model_most_conservative_wins():
    versions = [wv(f"v{i}") for i in range(1, 6)]
    loads = [ml("a", "v5", 1, storage=True), ml("b", "v5", 3, storage=False), ml("c", "v5", 3, storage=True)]
    assert model_policies(loads)["m"].keep_last == 3 and model_policies(loads)["m"].owner == "b"
    plan = plan_retirements(versions, loads, ())
    assert [r.version for r in plan] == ["v2", "v1"] and not any(r.delete_storage for r in plan)
    assert all(r.delete_storage for r in plan_retirements(versions, [ml("a", "v5", 3, storage=True)], ()))


def test_policies_are_per_model_and_modelloads_without_one_take_no_part():
    versions = [wv("m1"), wv("m2"), wv("o1", model="other"), wv("o2", model="other")]
    loads = [ml("serve", "m2", 1), ml("plain", "o2", model="other")]
    assert retired(versions, loads) == ["m1"]
    assert retired(versions, [ml("plain", "m2")]) == []


def test_order_is_by_creation_then_name_naturally():
    a = wv("step-9", created="2026-01-01T00:00:05Z")
    b = wv("step-10", created="2026-01-01T00:00:05Z")
    c = wv("step-2", created="2026-01-01T00:00:09Z")  # published last: newest, whatever its name
    assert [v.name for v in newest_first([a, b, c])] == ["step-2", "step-10", "step-9"]
    assert retired([a, b, c], [ml("serve", "step-2", 2)]) == ["step-9"]


def test_a_cyclic_or_dangling_chain_terminates():
    # Such chains never resolve (not Ready), so they stay; walking their bases must still end.
    versions = [wv("a", "b", ready=False), wv("b", "a", ready=False), wv("x", "missing", ready=False)]
    versions += [wv("n1"), wv("n2")]
    assert retired(versions, [ml("serve", "n2", 1)]) == ["n1"]


def test_replicas_hold_their_assigned_and_reported_versions():
    body = {"spec": {"version": "v3"}, "status": {"version": "v2", "phase": "Serving"}}
    assert held_versions(body) == {"v2", "v3"}
    assert held_versions({"spec": {"version": "v1"}}) == {"v1"}


def test_facts_from_bodies():
    body = {
        "metadata": {"name": "v2", "uid": "u", "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"modelName": "m", "format": "XorDelta", "baseVersion": "v1"},
        "status": {"conditions": [{"type": "Ready", "status": "True"}], "readyTime": "2026-01-01T00:00:01Z"},
    }
    view = VersionView.from_body(body)
    assert (view.created, view.ready_time) == ("2026-01-01T00:00:00Z", "2026-01-01T00:00:01Z")
    load = {"metadata": {"name": "s", "uid": "w"}, "spec": {"modelName": "m", "desiredVersion": "v2"}}
    assert LoadFacts.from_body(load).keep_last is None
    load["spec"]["retention"] = {"keepLast": 3, "deleteStorage": True}
    assert LoadFacts.from_body(load) == LoadFacts("s", "w", "m", "v2", 3, True)
    assert LoadFacts.from_body(load).reference("ns")["metadata"] == {"name": "s", "namespace": "ns", "uid": "w"}


def test_api_validates_the_policy():
    spec = {"modelName": "m", "desiredVersion": "v1"}
    assert ModelLoadSpec.model_validate(spec).retention is None
    policy = ModelLoadSpec.model_validate({**spec, "retention": {"keepLast": 2}}).retention
    assert policy is not None and policy.keepLast == 2 and policy.deleteStorage is False
    with pytest.raises(ValueError):
        ModelLoadSpec.model_validate({**spec, "retention": {"keepLast": 0}})
    assert [r.value for r in RetentionReason] == [
        "VersionRetired",
        "RetirementFailed",
        "StorageDeleted",
        "StorageNotDeleted",
    ]


# ---------------------------------------------------------------- deleting one version's objects

BUCKET = "weights"


class FakeS3:
    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects = dict(objects)
        self.fail_delete: dict[str, Exception] = {}
        self.deleted: list[str] = []

    def get_object(self, *, Bucket: str, Key: str, Range: str | None = None) -> dict[str, Any]:
        if Key not in self.objects:
            raise ClientError({"Error": {"Code": "NoSuchKey"}, "ResponseMetadata": {"HTTPStatusCode": 404}}, "get")
        data = self.objects[Key]

        class Body:
            def read(self) -> bytes:
                return data

            def close(self) -> None:
                pass

        return {"ContentLength": len(data), "Body": Body()}

    def delete_object(self, *, Bucket: str, Key: str) -> dict:
        if Key in self.fail_delete:
            raise self.fail_delete.pop(Key)
        self.objects.pop(Key, None)  # S3 answers 204 for an absent key too
        self.deleted.append(Key)
        return {}


def stored(version: str, seed: int) -> dict[str, bytes]:
    rng = np.random.default_rng(seed)
    weights = {f"w{i}": rng.standard_normal((8, 8)).astype(np.float32) for i in range(4)}
    return {f"{version}/{n}": d for n, d in ckpt.build_full_checkpoint(weights, shard_bytes=300).items()}


def digest(objects: dict[str, bytes], version: str) -> str:
    return hashlib.sha256(objects[f"{version}/{ckpt.INDEX_NAME}"]).hexdigest()


def test_deletes_exactly_the_versions_objects_index_last():
    objects = {**stored("v1", 1), **stored("v2", 2), "v1/notes.txt": b"not named by the index"}
    fake = FakeS3(objects)
    report = delete_checkpoint(fake, f"s3://{BUCKET}/v1/{ckpt.INDEX_NAME}", index_digest=digest(objects, "v1"))
    assert report.ok, report.message
    v1 = {k for k in stored("v1", 1)}
    assert set(fake.deleted) == v1 and fake.deleted[-1] == f"v1/{ckpt.INDEX_NAME}"
    assert set(fake.objects) == set(stored("v2", 2)) | {"v1/notes.txt"}
    assert len(report.deleted) == len(v1)


def test_refuses_an_index_that_is_not_the_verified_one():
    objects = stored("v1", 1)
    fake = FakeS3(objects)
    uri = f"s3://{BUCKET}/v1/{ckpt.INDEX_NAME}"
    for wrong in ("0" * 64, None):
        report = delete_checkpoint(fake, uri, index_digest=wrong)
        assert not report.ok and not report.transient and fake.deleted == []


def test_an_interrupted_deletion_resumes_and_a_gone_index_is_done():
    objects = stored("v1", 1)
    fake = FakeS3(objects)
    uri, good = f"s3://{BUCKET}/v1/{ckpt.INDEX_NAME}", digest(objects, "v1")
    shard = sorted(k for k in objects if k.endswith(".safetensors"))[1]
    fake.fail_delete[shard] = EndpointConnectionError(endpoint_url="http://s3")
    first = delete_checkpoint(fake, uri, index_digest=good)
    assert not first.ok and first.transient and f"v1/{ckpt.INDEX_NAME}" in fake.objects
    second = delete_checkpoint(fake, uri, index_digest=good)
    assert second.ok and fake.objects == {}
    third = delete_checkpoint(fake, uri, index_digest=good)
    assert third.ok and "already gone" in third.message


def test_a_denied_delete_is_not_transient():
    objects = stored("v1", 1)
    fake = FakeS3(objects)
    shard = sorted(k for k in objects if k.endswith(".safetensors"))[0]
    fake.fail_delete[shard] = ClientError(
        {"Error": {"Code": "AccessDenied"}, "ResponseMetadata": {"HTTPStatusCode": 403}}, "delete"
    )
    report = delete_checkpoint(fake, f"s3://{BUCKET}/v1/{ckpt.INDEX_NAME}", index_digest=digest(objects, "v1"))
    assert not report.ok and not report.transient and "denied" in report.message


class RecordingIndex(dict):
    """A kopf index stand-in that records every key looked up."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.asked: list[Any] = []

    def get(self, key: Any, default: Any = None) -> Any:
        self.asked.append(key)
        return super().get(key, default)


def indexes_of(versions: list[VersionView], loads: list[LoadFacts], holds: dict[tuple, list]) -> Indexes:
    index = RecordingIndex()
    for version in versions:
        for key, view in version_keys(dataclasses.replace(version, namespace="ns")).items():
            index.setdefault(key, []).append(view)
    load_index = RecordingIndex()
    for load in loads:
        load_index.setdefault(("ns", load.model), []).append(load)
    return Indexes(
        versions=index,
        desired=RecordingIndex({("ns", load.desired): [load.name] for load in loads}),
        leases={},
        attachments={},
        nodes={},
        replicas={},
        replica_leases={},
        retention_loads=load_index,
        retention_holds=RecordingIndex(holds),
    )


def test_a_policy_run_looks_only_at_its_models_versions(monkeypatch):
    ours = chain("m1", "m2", "m3", "m4", keyframes=("m3",))
    theirs = [wv(f"o{i}", model="other") for i in range(1, 6)] + [wv("cross", "m1", model="other")]
    loads = [ml("serve", "m4", 1), ml("serve-other", "o5", 1, model="other")]
    indexes = indexes_of(ours + theirs, loads, {("ns", "m"): [frozenset()], ("ns", "other"): [frozenset({"o1"})]})
    retired_now: list[str] = []
    monkeypatch.setattr(
        retention_handlers.kubeapi, "retire_version", lambda ns, name, uid, annotations: retired_now.append(name)
    )
    monkeypatch.setattr(retention_handlers, "EVENTS", type("Quiet", (), {"post": lambda *a, **k: None})())

    inputs = retention_handlers.policy_inputs("ns", "m", indexes)
    # m's versions, and the delta of another model that replays from one of them: no other of that model's.
    assert sorted(v.name for v in inputs.versions) == ["cross", "m1", "m2", "m3", "m4"]
    assert inputs.protected == {"m4"}

    asyncio.run(retention_handlers._apply_policy("ns", "m", indexes))
    # m4 stays (newest, desired) and so does its base m3; m1 as the base of the other model's delta; m2 goes.
    assert retired_now == ["m2"]
    looked_up = indexes.versions.asked + indexes.retention_loads.asked + indexes.retention_holds.asked
    assert of_model("ns", "m") in looked_up
    assert not [k for k in looked_up if "other" in k or any(str(part).startswith("o") for part in k[1:])], looked_up
