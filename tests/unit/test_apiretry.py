"""The agent's API resilience: error classification, capped backoff, retried reads, kept status patches, and a
node agent whose loop, status writes and Lease renewals outlive an unreachable apiserver."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import urllib3.exceptions
from kubernetes.client.exceptions import ApiException

from ferry_agent.kube import apiretry
from ferry_agent.kube.apiretry import Backoff, StatusOutbox, call_with_retry, is_transient
from ferry_agent.node_agent import Served
from tests.support.kube_fakes import FakeLeases, FakeObjects, api_error, fake_agent, refused

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "exc",
    [
        refused(),
        urllib3.exceptions.ProtocolError("reset"),
        urllib3.exceptions.ReadTimeoutError(None, "/", "t"),
        ConnectionRefusedError(),
        TimeoutError(),
        api_error(503),
        api_error(500),
        api_error(429),
        api_error(410),
        api_error(0),
    ],
)
def test_transient_errors(exc):
    assert is_transient(exc)


@pytest.mark.parametrize("exc", [api_error(404), api_error(403), api_error(422), ValueError("bug"), KeyError("x")])
def test_permanent_errors(exc):
    assert not is_transient(exc)


def test_backoff_grows_is_capped_and_resets():
    b = Backoff(initial=1, cap=8, factor=2, jitter=0)
    assert [b.next() for _ in range(6)] == [1, 2, 4, 8, 8, 8]
    b.reset()
    assert b.next() == 1


def test_backoff_jitter_stays_within_bounds():
    b = Backoff(initial=10, cap=10, jitter=0.2)
    delays = [b.next() for _ in range(200)]
    assert all(8 <= d <= 10 for d in delays) and len(set(delays)) > 1


def test_backoff_rejects_nonsense():
    with pytest.raises(ValueError):
        Backoff(initial=5, cap=1)


def fast() -> Backoff:
    return Backoff(initial=0.001, cap=0.002)


def test_retry_passes_transient_errors():
    errors = [refused(), api_error(503)]

    def fn():
        if errors:
            raise errors.pop(0)
        return "ok"

    assert call_with_retry(fn, what="t", backoff=fast()) == "ok"


def test_retry_raises_permanent_errors_at_once():
    calls = []

    def fn():
        calls.append(1)
        raise api_error(404)

    with pytest.raises(ApiException):
        call_with_retry(fn, what="t", backoff=fast())
    assert len(calls) == 1


def test_retry_gives_up_after_its_bound():
    calls = []

    def fn():
        calls.append(1)
        raise refused()

    with pytest.raises(urllib3.exceptions.MaxRetryError):
        call_with_retry(fn, what="t", backoff=fast(), retry_for_s=0.05)
    assert len(calls) > 1


def test_retry_stops_when_told():
    stop = threading.Event()
    stop.set()
    calls = []

    def fn():
        calls.append(1)
        raise refused()

    with pytest.raises(urllib3.exceptions.MaxRetryError):
        call_with_retry(fn, what="t", stop=stop, backoff=fast())
    assert len(calls) == 1


class FlakyWriter:
    """Fails while `down`; records what it wrote."""

    def __init__(self) -> None:
        self.down = True
        self.error: Exception = refused()
        self.written: list[tuple[str, dict]] = []

    def __call__(self, key, body):
        if self.down:
            raise self.error
        self.written.append((key, dict(body)))


def test_outbox_keeps_merges_and_writes_in_order():
    write = FlakyWriter()
    outbox = StatusOutbox(write, backoff=fast)
    assert not outbox.patch("a", {"phase": "Loading", "bytesDone": 0})
    outbox.patch("a", {"bytesDone": 10})
    outbox.patch("a", {"phase": "Serving", "source": "s3"})
    assert outbox.pending("a") and not write.written
    write.down = False
    time.sleep(0.01)
    assert outbox.flush()
    assert write.written == [("a", {"phase": "Serving", "bytesDone": 10, "source": "s3"})]
    assert not outbox.pending("a") and outbox.next_try_in() is None


def test_a_staged_patch_is_written_only_with_the_next_one():
    write = FlakyWriter()
    write.down = False
    outbox = StatusOutbox(write, backoff=fast)
    outbox.stage("a", {"bytesDone": 10, "source": "s3"})
    assert outbox.pending("a") and not write.written
    assert outbox.patch("a", {"phase": "Serving", "bytesDone": 12})
    assert write.written == [("a", {"bytesDone": 12, "source": "s3", "phase": "Serving"})]
    outbox.stage("b", {"bytesDone": 1})
    assert outbox.flush() and write.written[-1] == ("b", {"bytesDone": 1})  # or with the next reconcile's flush


def test_outbox_backs_off_per_object():
    write = FlakyWriter()
    outbox = StatusOutbox(write, backoff=lambda: Backoff(initial=60, cap=60))
    outbox.patch("a", {"phase": "Serving"})
    write.down = False
    assert not outbox.patch("a", {"activeLeases": 1})  # still backing off: only queued
    assert not write.written and outbox.next_try_in() > 30
    assert outbox.patch("b", {"phase": "Loading"})  # another object is not held back
    assert write.written == [("b", {"phase": "Loading"})]


def test_outbox_drops_patches_of_a_deleted_object():
    write = FlakyWriter()
    write.error = api_error(404)
    outbox = StatusOutbox(write, backoff=fast)
    assert outbox.patch("a", {"phase": "Serving"})
    assert not outbox.pending("a")


def test_outbox_keeps_a_refused_patch():
    write = FlakyWriter()
    write.error = api_error(500)
    outbox = StatusOutbox(write, backoff=fast)
    outbox.patch("a", {"phase": "Serving"})
    assert outbox.pending("a")


def test_bound_requests_sets_a_default_timeout():
    seen = []
    api = SimpleNamespace(
        rest_client=SimpleNamespace(request=lambda *a, _request_timeout=None, **k: seen.append(_request_timeout))
    )
    apiretry.bound_requests(api, (1.0, 2.0))
    api.rest_client.request("GET", "/x")
    api.rest_client.request("GET", "/watch", _request_timeout=(1, 330))
    assert seen == [(1.0, 2.0), (1, 330)]


# ---------------------------------------------------------------- the node agent over an unreachable apiserver


def test_agent_loop_outlives_an_unreachable_apiserver():
    objects = FakeObjects()
    a = fake_agent(objects, FakeLeases(), poll_seconds=0.01)
    runner = threading.Thread(target=a.run)
    runner.start()
    try:
        deadline = time.monotonic() + 10
        while objects.lists < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert runner.is_alive() and objects.lists >= 3  # failed passes, retried with backoff
        objects.down = False
        lists = objects.lists
        while objects.lists == lists and time.monotonic() < deadline:
            time.sleep(0.01)
        assert objects.lists > lists
    finally:
        a.stop()
        runner.join(10)
    assert not runner.is_alive()


def test_agent_status_written_once_the_apiserver_is_back():
    objects = FakeObjects()
    a = fake_agent(objects, FakeLeases())
    a._patch_status(("ns", "wr"), {"phase": "Serving", "version": "v1"})  # does not raise
    assert a.replicas.pending(("ns", "wr"))
    objects.down = False
    a.replicas.outbox._retry.clear()  # skip the backoff
    a.reconcile_once()
    assert objects.patches == [{"phase": "Serving", "version": "v1"}]


def test_agent_recreates_a_deleted_lease_and_renews_through_an_outage():
    fake = FakeLeases()
    a = fake_agent(FakeObjects(), fake, lease_seconds=1)
    key = ("ns", "wr")
    a.leases.hold(key)
    name = "ferry-wr-wr"
    assert fake.leases[name]["spec"]["holderIdentity"] == a.agent_name
    try:
        del fake.leases[name]  # deleted by hand
        deadline = time.monotonic() + 10
        while name not in fake.leases and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fake.leases[name]["spec"]["holderIdentity"] == a.agent_name
        fake.down = True
        time.sleep(1.0)  # renewals fail meanwhile; the renewing thread lives on
        renewed = fake.leases[name]["spec"]["renewTime"]
        fake.down = False
        while fake.leases[name]["spec"]["renewTime"] == renewed and time.monotonic() < deadline:
            time.sleep(0.05)
        assert fake.leases[name]["spec"]["renewTime"] > renewed
    finally:
        a.leases.release(key)
    assert name not in fake.leases and not a.leases.held(key)


def test_agent_publishes_its_phase_again_when_the_object_says_otherwise():
    """The phase is the agent's: an object that says anything else about a served replica (a write lost to an
    outage, an older operator's Stale) gets the Serving status back, and nothing is reloaded."""
    objects = FakeObjects(down=False)
    a = fake_agent(objects, FakeLeases())
    handle = SimpleNamespace(active_leases=lambda: 2, failure=lambda: None)
    a._served[("ns", "wr")] = Served("v1", handle, {"phase": "Serving", "version": "v1", "source": "s3"})
    listed = {
        "metadata": {"namespace": "ns", "name": "wr"},
        "spec": {"nodeName": "n1", "version": "v1"},
        "status": {"phase": "Stale", "version": "v1"},
    }
    objects.items = [listed]
    a.reconcile_once()
    assert objects.patches == [{"phase": "Serving", "version": "v1", "source": "s3", "activeLeases": 2}]
    listed["status"] = objects.patches[0]
    a.reconcile_once()
    assert len(objects.patches) == 1, "written once"
    assert ("ns", "wr") in a._served
