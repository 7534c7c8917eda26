"""Storage verification's backoff (`ferry_operator.verification`): counted in the version's memo, doubling up to
the cap, a retry scheduled per failure, and a recorded success never re-verified."""

from __future__ import annotations

import asyncio

import kopf
import pytest

from ferry.api.models import WeightVersionSpec
from ferry.storage import StorageReason, StorageReport
from ferry_operator import verification
from ferry_operator.deadlines import Deadlines
from ferry_operator.verification import Backoff

pytestmark = pytest.mark.unit

SPEC = WeightVersionSpec.model_validate(
    {"modelName": "m", "format": "FullCheckpoint", "storage": {"uri": "s3://bucket/ns/v1/model.index.json"}}
)
MISSING = StorageReport(ok=False, reason=StorageReason.ObjectMissing, message="no index")


def test_backoff_doubles_up_to_the_cap():
    backoff, delays = Backoff(), []
    for _ in range(5):
        backoff, delay = backoff.after_failure(100.0, initial=2.0, maximum=10.0)
        delays.append(delay)
    assert delays == [2.0, 4.0, 8.0, 10.0, 10.0]
    assert backoff == Backoff(attempts=5, not_before=110.0)


def test_failures_back_off_in_the_memo_and_schedule_a_retry(monkeypatch):
    deadlines = Deadlines()
    monkeypatch.setattr(verification, "DEADLINES", deadlines)
    reports = [MISSING, StorageReport(ok=True, reason=StorageReason.Verified, message="ok", index_digest="d")]
    checked = []

    async def verify(namespace: str, name: str, spec: WeightVersionSpec) -> StorageReport:
        checked.append(name)
        return reports[len(checked) - 1]

    monkeypatch.setattr(verification, "verify_storage", verify)

    async def retry() -> None:
        pass

    async def scenario() -> None:
        memo = kopf.Memo()
        first = await verification.storage_report("uid", "ns", "v1", SPEC, None, memo, retry)
        assert first is MISSING and memo["verify_backoff"].attempts == 1 and len(deadlines) == 1
        # Within the backoff, the recorded outcome stands: no new attempt.
        assert await verification.storage_report("uid", "ns", "v1", SPEC, MISSING, memo, retry) is MISSING
        assert checked == ["v1"]
        memo["verify_backoff"] = Backoff(attempts=1, not_before=0.0)  # the backoff ran out
        ok = await verification.storage_report("uid", "ns", "v1", SPEC, MISSING, memo, retry)
        assert ok.ok and "verify_backoff" not in memo and len(deadlines) == 0
        # Verified once, with its index digest recorded: never again.
        assert await verification.storage_report("uid", "ns", "v1", SPEC, ok, memo, retry) is ok
        assert checked == ["v1", "v1"]

    asyncio.run(scenario())
