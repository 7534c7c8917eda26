"""The WeightVersion status planner: conditions, phase and release blockers, without a cluster."""

from __future__ import annotations

import pytest

from ferry.api.models import InvalidObject, WeightVersion
from ferry.chain import ChainReason, ChainResult
from ferry.storage import StorageReason, StorageReport
from ferry_operator.versions import plan_version_status, release_blockers, storage_from_status
from tests.support.typed import weight_version

pytestmark = pytest.mark.unit

T0, T1 = "2026-01-01T00:00:00Z", "2026-01-01T00:01:00Z"
CHAIN_OK = ChainResult(ok=True, reason=ChainReason.Resolved, message="chain of 2", chain=("v1", "v2"))
STORAGE_OK = StorageReport(ok=True, reason=StorageReason.Verified, message="ok", total_bytes=2048, tensor_count=3)


def body(status=None, deleting=False, generation=1):
    return weight_version("v2", status=status, deleting=deleting, generation=generation)


def conds(plan):
    return {c.type: c for c in plan.status.conditions}


def test_ready_when_chain_and_storage_are_good():
    plan = plan_version_status(body(), CHAIN_OK, STORAGE_OK, now=T0)
    c = conds(plan)
    assert plan.status.phase == "Ready"
    assert (c["Ready"].status, c["Ready"].reason) == ("True", "Verified")
    assert plan.status.chain == ["v1", "v2"] and plan.status.chainDepth == 2
    assert plan.status.totalBytes == 2048 and plan.status.size == "2Ki" and plan.status.tensorCount == 3
    assert plan.status.readyTime == T0 and plan.became_ready
    assert all(x.observedGeneration == 1 for x in c.values())


def test_last_transition_time_and_ready_time_are_stable():
    first = plan_version_status(body(), CHAIN_OK, STORAGE_OK, now=T0)
    again = plan_version_status(body(first.status), CHAIN_OK, STORAGE_OK, now=T1)
    assert [c.lastTransitionTime for c in again.status.conditions] == [T0, T0, T0]
    assert again.status.readyTime == T0
    assert not again.became_ready
    assert not again.differs_from(first.status)


def test_flip_moves_last_transition_time():
    first = plan_version_status(body(), CHAIN_OK, STORAGE_OK, now=T0)
    broken = ChainResult(ok=False, reason=ChainReason.BaseNotReady, message="base v1 is not Ready yet.")
    plan = plan_version_status(body(first.status), broken, STORAGE_OK, now=T1)
    c = conds(plan)
    assert c["ChainResolved"].lastTransitionTime == T1 and c["StorageVerified"].lastTransitionTime == T0
    assert plan.status.phase == "Pending"
    assert (c["Ready"].status, c["Ready"].reason, c["Ready"].lastTransitionTime) == (
        "False",
        "BaseNotReady",
        T1,
    )
    assert plan.status.chain == ["v1", "v2"], "the last resolved chain is kept for reference"


@pytest.mark.parametrize(
    "reason", [ChainReason.ChainCycle, ChainReason.ChainTooLong, ChainReason.ModelMismatch, ChainReason.LayoutMismatch]
)
def test_permanent_chain_defects_fail(reason):
    plan = plan_version_status(body(), ChainResult(ok=False, reason=reason, message="x"), STORAGE_OK, now=T0)
    assert plan.status.phase == "Failed"
    assert conds(plan)["Ready"].reason == str(reason)


def test_unverified_storage_is_verifying():
    plan = plan_version_status(body(), CHAIN_OK, None, now=T0)
    c = conds(plan)
    assert plan.status.phase == "Verifying"
    assert c["StorageVerified"].status == "Unknown"


def test_transient_storage_error_keeps_last_good_state():
    good = plan_version_status(body(), CHAIN_OK, STORAGE_OK, now=T0)
    flaky = StorageReport(ok=False, reason=StorageReason.EndpointUnreachable, message="timeout", transient=True)
    plan = plan_version_status(body(good.status), CHAIN_OK, flaky, now=T1)
    assert plan.status.phase == "Ready"
    assert conds(plan)["StorageVerified"].status == "True"


def test_transient_error_before_any_success_is_pending():
    flaky = StorageReport(ok=False, reason=StorageReason.EndpointUnreachable, message="timeout", transient=True)
    plan = plan_version_status(body(), CHAIN_OK, flaky, now=T0)
    assert plan.status.phase == "Pending"
    assert conds(plan)["Ready"].reason == "EndpointUnreachable"


def test_deleting_with_blockers_is_releasing():
    blockers = release_blockers(["v3"], ["serve"], ["node-a"])
    assert blockers == ["WeightVersion/v3", "ModelLoad/serve", "WeightReplica/node-a"]
    plan = plan_version_status(body(deleting=True), CHAIN_OK, STORAGE_OK, release_blockers=blockers, now=T0)
    ready = conds(plan)["Ready"]
    assert plan.status.phase == "Releasing"
    assert (ready.status, ready.reason) == ("False", "ReleaseBlocked")
    assert "WeightVersion/v3" in ready.message and "ModelLoad/serve" in ready.message
    assert plan.status.releaseBlockers == blockers


def test_recorded_storage_outcome_is_read_back():
    plan = plan_version_status(body(), CHAIN_OK, STORAGE_OK, now=T0)
    report = storage_from_status(body(plan.status))
    assert report.ok and report.total_bytes == 2048
    assert storage_from_status(body(plan.status, generation=2)) is None, "a new generation is verified again"
    missing = StorageReport(ok=False, reason=StorageReason.ObjectMissing, message="gone")
    failed = plan_version_status(body(), CHAIN_OK, missing, now=T0)
    back = storage_from_status(body(failed.status))
    assert not back.ok and back.reason == StorageReason.ObjectMissing and not back.transient


def test_index_digest_is_recorded_and_read_back():
    digest = "ab" * 32
    report = StorageReport(ok=True, reason=StorageReason.Verified, message="ok", total_bytes=1, index_digest=digest)
    plan = plan_version_status(body(), CHAIN_OK, report, now=T0)
    assert plan.status.indexDigest == digest
    assert storage_from_status(body(plan.status)).index_digest == digest


def test_the_status_patch_sets_what_the_plan_sets_and_clears_what_it_dropped():
    blocked = plan_version_status(body(deleting=True), CHAIN_OK, STORAGE_OK, release_blockers=["ModelLoad/s"], now=T0)
    patch = blocked.patch(None)
    assert patch["releaseBlockers"] == ["ModelLoad/s"] and patch["phase"] == "Releasing"
    chain_resolved = {"type": "ChainResolved", "status": "True", "reason": "Resolved", "message": "chain of 2"}
    assert patch["conditions"][0] == chain_resolved | {"observedGeneration": 1, "lastTransitionTime": T0}
    released = plan_version_status(body(blocked.status, deleting=True), CHAIN_OK, STORAGE_OK, now=T1)
    patch = released.patch(body(blocked.status).status)
    assert patch["releaseBlockers"] is None, "a merge patch removes the field with null"
    assert patch["totalBytes"] == 2048 and "readyTime" not in patch


def test_a_status_from_an_older_operator_is_read_as_far_as_it_validates():
    good = plan_version_status(body(), CHAIN_OK, STORAGE_OK, now=T0).patch(None)
    old = good | {"metadataEndpoint": "", "chainDepth": -1}
    old["conditions"] = [*good["conditions"], {"type": "Loaded", "status": "Maybe", "reason": "Old"}]
    version = body(old)
    assert version.status.chainDepth is None and version.status.totalBytes == 2048
    assert [c.type for c in version.status.conditions] == ["ChainResolved", "StorageVerified", "Ready"]
    assert storage_from_status(version).ok
    again = plan_version_status(version, CHAIN_OK, STORAGE_OK, now=T1)
    assert again.status.readyTime == T0 and not again.became_ready


def test_an_unknown_storage_reason_is_verified_again():
    status = plan_version_status(body(), CHAIN_OK, STORAGE_OK, now=T0).patch(None)
    status["conditions"][1]["reason"] = "SomethingOlder"
    assert storage_from_status(body(status)) is None


def test_a_spec_that_does_not_validate_is_an_invalid_object():
    with pytest.raises(InvalidObject, match="spec does not validate"):
        WeightVersion.from_body({"metadata": {"name": "v"}, "spec": {"modelName": "m", "format": "Zip"}})
