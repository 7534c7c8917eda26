"""A blocked release is woken by the change that frees it (`recheck_releases`), not polled: the events of a
namespace wake exactly its blocked releases whose blockers changed. And the operator's own finalizer patches."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from ferry.chain import VersionView
from ferry_operator import kubeaio, kubeapi
from ferry_operator.handlers import weightversion
from ferry_operator.indexes import Indexes
from ferry_operator.indexkeys import based_on

pytestmark = pytest.mark.unit


class Woken:
    def __init__(self) -> None:
        self.woken: list[tuple[str, str, str]] = []

    def wake(self, plural: str, namespace: str, name: str) -> None:
        self.woken.append((plural, namespace, name))


def indexes(dependents: dict[str, list[str]], desired: dict[str, list[str]]) -> Indexes:
    versions = {
        based_on("ns", base): [
            VersionView(d, "m", "XorDelta", base, None, ready=True, deleting=False, has_storage=True, namespace="ns")
            for d in names
        ]
        for base, names in dependents.items()
    }
    return Indexes(
        versions=versions,
        desired={("ns", version): loads for version, loads in desired.items()},
        leases={},
        attachments={},
        nodes={},
        replicas={},
        replica_leases={},
        retention_loads={},
        retention_holds={},
    )


@pytest.fixture
def woken(monkeypatch) -> Woken:
    fake = Woken()
    monkeypatch.setattr(weightversion, "WAKEUPS", fake)
    monkeypatch.setattr(weightversion, "_blocked", {"ns": {"v1": ("WeightVersion/v2", "ModelLoad/serve")}})
    return fake


def test_nothing_changed_wakes_nothing(woken):
    weightversion.recheck_releases("ns", indexes({"v1": ["v2"]}, {"v1": ["serve"]}))
    weightversion.recheck_releases("other", indexes({}, {}))  # no blocked release there
    assert woken.woken == []


def test_a_blocker_gone_wakes_the_release(woken):
    weightversion.recheck_releases("ns", indexes({}, {"v1": ["serve"]}))  # the delta v2 is gone
    assert woken.woken == [("weightversions", "ns", "v1")]


def test_a_new_blocker_wakes_it_too(woken):
    weightversion.recheck_releases("ns", indexes({"v1": ["v2", "v3"]}, {"v1": ["serve"]}))
    assert woken.woken == [("weightversions", "ns", "v1")]


def test_the_finalizer_patches_are_json_patches(monkeypatch):
    """A client sends a list body as a merge patch unless told: the apiserver would refuse it. The addition goes
    on the event loop (kubeaio), as does the removal."""
    sent: list[tuple[str, list]] = []
    api = client.ApiClient(client.Configuration(host="http://127.0.0.1:1"))

    def request(method: str, url: str, headers: dict | None = None, body: Any = None, **_: Any) -> Any:
        sent.append((headers["Content-Type"], body))
        refused = ApiException(status=422, reason="test failed")
        refused.body = b""
        raise refused

    async def request_async(method: str, path: str, *, body: Any = None, content_type: str = "", **_: Any) -> Any:
        sent.append((content_type, body))
        raise ApiException(status=422, reason="test failed")

    monkeypatch.setattr(api, "request", request)
    monkeypatch.setattr(kubeapi, "api_client", lambda: api)
    monkeypatch.setattr(kubeaio.API, "request", request_async)
    assert not asyncio.run(kubeaio.add_finalizer("weightversions", "ns", "v1", "u1", [], "ferry.dev/release"))
    assert not asyncio.run(kubeaio.add_finalizer("weightversions", "ns", "v1", "u1", ["a/b"], "ferry.dev/release"))
    assert not asyncio.run(
        kubeaio.remove_finalizer("weightversions", "ns", "v1", "u1", ["a/b", "ferry.dev/release"], "ferry.dev/release")
    )
    assert {content for content, _ in sent} == {"application/json-patch+json"}
    assert sent[0][1] == [
        {"op": "test", "path": "/metadata/uid", "value": "u1"},
        {"op": "test", "path": "/metadata/finalizers", "value": None},
        {"op": "add", "path": "/metadata/finalizers", "value": ["ferry.dev/release"]},
    ]
    assert sent[1][1][1:] == [
        {"op": "test", "path": "/metadata/finalizers", "value": ["a/b"]},
        {"op": "add", "path": "/metadata/finalizers/-", "value": "ferry.dev/release"},
    ]
    assert sent[2][1][1:] == [
        {"op": "test", "path": "/metadata/finalizers/1", "value": "ferry.dev/release"},
        {"op": "remove", "path": "/metadata/finalizers/1"},
    ]
