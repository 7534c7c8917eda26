"""The operator's own WeightVersion list + watch (versionwatch.py) over a fake apiserver: the index it keeps, the
order and coalescing of the events it hands on, and a watch that expires (410 Gone) replaced by a new list."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import kopf
import pytest
from kubernetes.client.exceptions import ApiException

from ferry_operator import main, versionwatch
from ferry_operator.indexkeys import based_on, in_folder, named, of_model
from ferry_operator.versionwatch import VersionIndex, VersionWatch, view_of

pytestmark = pytest.mark.unit


def wv(name: str, rv: int, *, ns: str = "ns", base: str | None = None, ready: bool = False, uid: str = "") -> dict:
    spec: dict[str, Any] = {
        "modelName": "m",
        "format": "XorDelta" if base else "FullCheckpoint",
        "storage": {"uri": f"s3://bkt/m/{name}/model.safetensors.index.json"},
    }
    if base:
        spec["baseVersion"] = base
    status = {
        "conditions": [
            {
                "type": "Ready",
                "status": "True",
                "reason": "Verified",
                "message": "",
                "lastTransitionTime": "2026-12-04T10:00:00Z",
            }
        ]
    }
    return {
        "apiVersion": "ferry.dev/v1alpha1",
        "kind": "WeightVersion",
        "metadata": {"namespace": ns, "name": name, "uid": uid or f"uid-{name}", "resourceVersion": str(rv)},
        "spec": spec,
        **({"status": status} if ready else {}),
    }


def test_the_index_answers_each_key_and_forgets_replaced_keys():
    index = VersionIndex()
    index.put("ns", "v1", view_of(wv("v1", 1)))
    index.put("ns", "v2", view_of(wv("v2", 2, base="v1")))
    assert [v.name for v in index[named("ns", "v1")]] == ["v1"]
    assert sorted(v.name for v in index[of_model("ns", "m")]) == ["v1", "v2"]
    assert [v.name for v in index.get(based_on("ns", "v1"), ())] == ["v2"]
    assert [v.name for v in index[in_folder("bkt", "m/v2")]] == ["v2"]
    index.put("ns", "v2", view_of(wv("v2", 3, ready=True)))  # (not a delta any more: a new object of that name)
    assert index.get(based_on("ns", "v1")) is None and based_on("ns", "v1") not in index
    assert next(iter(index[named("ns", "v2")])).ready
    index.put("ns", "v1", None)
    assert named("ns", "v1") not in index and [v.name for v in index[of_model("ns", "m")]] == ["v2"]
    bad = wv("v3", 4)
    bad["spec"]["format"] = "Nonsense"
    index.put("ns", "v3", view_of(bad))  # a spec that does not validate: not there for the others
    assert named("ns", "v3") not in index


class FakeApi:
    """A list answer and a queue of watch streams; each stream is a list of events or an exception to raise."""

    def __init__(self, items: list[dict], rv: str) -> None:
        self.lists: list[tuple[list[dict], str]] = [(items, rv)]
        self.streams: asyncio.Queue[list[dict] | BaseException] = asyncio.Queue()
        self.watched_from: list[str] = []

    async def request(self, method: str, path: str, *, params: dict | None = None, **_: Any) -> dict:
        items, rv = self.lists[0] if len(self.lists) == 1 else self.lists.pop(0)
        return {"apiVersion": "ferry.dev/v1alpha1", "items": items, "metadata": {"resourceVersion": rv}}

    async def stream(self, path: str, params: dict, timeout: float) -> AsyncIterator[dict]:
        self.watched_from.append(params["resourceVersion"])
        events = await self.streams.get()
        if isinstance(events, BaseException):
            raise events
        for event in events:
            yield event


class Recorder:
    def __init__(self) -> None:
        self.seen: list[tuple[str | None, str, str]] = []
        self.running: set[str] = set()
        self.gate = asyncio.Event()
        self.overlap = False

    async def __call__(self, kind: str | None, body: dict, memo: kopf.Memo) -> None:
        name = body["metadata"]["name"]
        if name in self.running:
            self.overlap = True
        self.running.add(name)
        await self.gate.wait()
        self.seen.append((kind, name, body["metadata"].get("resourceVersion", "")))
        self.running.discard(name)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


def test_events_are_handled_in_order_one_object_at_a_time_and_coalesce(monkeypatch):
    async def scenario() -> Recorder:
        api = FakeApi([wv("v1", 5)], "10")
        monkeypatch.setattr(versionwatch, "API", api)
        recorder = Recorder()
        watch = VersionWatch(VersionIndex(), recorder, kopf.Memo(), workers=4)
        await watch.start()
        assert named("ns", "v1") in watch.index  # listed before start returns: the index is complete
        await api.streams.put(
            [
                {"type": "MODIFIED", "object": wv("v1", 11)},
                {"type": "MODIFIED", "object": wv("v1", 12)},
                {"type": "ADDED", "object": wv("v2", 13)},
                {"type": "DELETED", "object": wv("v2", 14)},
                {"type": "ADDED", "object": wv("v2", 15, uid="other")},
                {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "16"}}},
            ]
        )
        await settle()
        assert recorder.seen == []  # nothing is handled before `begin`
        watch.begin()
        recorder.gate.set()
        await settle()
        assert watch.index[named("ns", "v2")][0].uid == "other"
        return recorder

    recorder = asyncio.run(scenario())
    assert not recorder.overlap
    # v1: the listing coalesced with its two updates into the latest body; v2: the deletion is not folded away.
    assert [e for e in recorder.seen if e[1] == "v1"] == [("MODIFIED", "v1", "12")]
    assert [e for e in recorder.seen if e[1] == "v2"] == [
        ("ADDED", "v2", "13"),
        ("DELETED", "v2", "14"),
        ("ADDED", "v2", "15"),
    ]


def test_an_expired_watch_lists_again_and_a_version_gone_meanwhile_is_deleted(monkeypatch):
    async def run() -> tuple[Recorder, FakeApi, VersionWatch]:
        api = FakeApi([wv("v1", 5), wv("v2", 6)], "10")
        monkeypatch.setattr(versionwatch, "API", api)
        monkeypatch.setattr(versionwatch, "WATCH_BACKOFF", (0.0,))
        recorder = Recorder()
        recorder.gate.set()
        watch = VersionWatch(VersionIndex(), recorder, kopf.Memo(), workers=2)
        await watch.start()
        watch.begin()
        await settle()
        api.lists = [([wv("v1", 5)], "40")]  # v2 was deleted while no watch could resume
        await api.streams.put([{"type": "ERROR", "object": {"code": 410, "message": "too old resource version"}}])
        await settle()
        await api.streams.put([{"type": "MODIFIED", "object": wv("v1", 41)}])
        await settle()
        return recorder, api, watch

    recorder, api, watch = asyncio.run(run())
    assert api.watched_from[:2] == ["10", "40"]  # resumed from the new list's resourceVersion
    assert ("DELETED", "v2") in [(kind, name) for kind, name, _ in recorder.seen]
    assert named("ns", "v2") not in watch.index and named("ns", "v1") in watch.index
    assert recorder.seen[-1] == ("MODIFIED", "v1", "41")
    assert ("ns", "v2") not in watch.memos


def test_a_broken_watch_resumes_where_it_stopped(monkeypatch):
    async def run() -> FakeApi:
        import aiohttp

        api = FakeApi([], "10")
        monkeypatch.setattr(versionwatch, "API", api)
        monkeypatch.setattr(versionwatch, "WATCH_BACKOFF", (0.0,))
        watch = VersionWatch(VersionIndex(), Recorder(), kopf.Memo(), workers=1)
        await watch.start()
        await api.streams.put([{"type": "ADDED", "object": wv("v1", 11)}])
        await api.streams.put(aiohttp.ClientPayloadError("cut"))
        await api.streams.put(ApiException(status=500, reason="restarting"))
        await api.streams.put([])
        for _ in range(50):
            await asyncio.sleep(0)
        return api

    api = asyncio.run(run())
    assert api.watched_from[:4] == ["10", "11", "11", "11"]


def test_an_unexpected_failure_lists_again_instead_of_ending_the_watch(monkeypatch):
    """A watch that fails in a way nobody foresaw (here: a line that is not JSON) may have lost events: the watch
    lists again and goes on from that list, instead of ending for good while the operator looks healthy."""

    async def run() -> tuple[Recorder, FakeApi]:
        api = FakeApi([wv("v1", 5)], "10")
        monkeypatch.setattr(versionwatch, "API", api)
        monkeypatch.setattr(versionwatch, "WATCH_BACKOFF", (0.0,))
        recorder = Recorder()
        recorder.gate.set()
        watch = VersionWatch(VersionIndex(), recorder, kopf.Memo(), workers=1)
        await watch.start()
        watch.begin()
        api.lists = [([wv("v1", 5), wv("v2", 20)], "30")]  # v2 was created while the watch was broken
        await api.streams.put(ValueError("Expecting value: line 1 column 1 (char 0)"))
        await api.streams.put([{"type": "MODIFIED", "object": wv("v2", 31)}])
        for _ in range(50):
            await asyncio.sleep(0)
        return recorder, api

    recorder, api = asyncio.run(run())
    assert api.watched_from[:2] == ["10", "30"]
    assert ("v2", "31") in [(name, rv) for _, name, rv in recorder.seen]


def test_the_first_list_is_tried_until_the_apiserver_answers(monkeypatch):
    async def run() -> VersionWatch:
        api = FakeApi([wv("v1", 5)], "10")
        answers = api.request
        refusals = [ApiException(status=503, reason="starting"), TimeoutError()]

        async def request(*args: Any, **kwargs: Any) -> dict:
            if refusals:
                raise refusals.pop(0)
            return await answers(*args, **kwargs)

        api.request = request  # type: ignore[method-assign]
        monkeypatch.setattr(versionwatch, "API", api)
        monkeypatch.setattr(versionwatch, "WATCH_BACKOFF", (0.0,))
        watch = VersionWatch(VersionIndex(), Recorder(), kopf.Memo(), workers=1)
        await watch.start()
        return watch

    assert named("ns", "v1") in asyncio.run(run()).index


def test_events_older_than_our_last_status_write_are_skipped():
    memo = kopf.Memo()
    assert not main._older_than_written(wv("v1", 7), memo)  # nothing written yet
    memo["written"] = "9"
    assert main._older_than_written(wv("v1", 8), memo)  # the finalizer's event, before our status patch's
    assert "written" in memo
    assert not main._older_than_written(wv("v1", 9), memo)  # our write's own event: reconciled, and forgotten
    assert "written" not in memo
    memo["written"] = "not-a-number"
    assert not main._older_than_written(wv("v1", 3), memo)  # opaque resourceVersions are never taken as older
