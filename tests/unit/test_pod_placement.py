"""The operator's per-namespace pod view (`ferry_operator.pod_placement`): which pod changes wake which ModelLoad.

The watch thread is not started: its list and watch events are fed by hand (`_replace`, `_put`), as the thread
would after the apiserver's answers; wakes are recorded instead of run."""

from __future__ import annotations

import pytest

from ferry_operator import pod_placement
from ferry_operator.modelloads import PodFacts

pytestmark = pytest.mark.unit

ENGINE = {"matchLabels": {"app": "engine"}}
OTHER = {"matchLabels": {"app": "other"}}


def facts(name: str, node: str | None, app: str = "engine") -> PodFacts:
    return PodFacts(name=name, uid=f"uid-{name}", labels={"app": app}, node=node)


@pytest.fixture
def wakes(monkeypatch) -> list[str]:
    seen: list[str] = []
    monkeypatch.setattr(pod_placement.NamespacePods, "start", lambda self: self)
    monkeypatch.setattr(pod_placement.WAKEUPS, "wake_threadsafe", lambda plural, ns, name: seen.append(name))
    for state in ("_namespaces", "_selectors", "_woken"):
        monkeypatch.setattr(pod_placement, state, {})
    return seen


def test_pod_changes_wake_only_the_modelloads_whose_nodes_move(wakes):
    assert pod_placement.pod_nodes("ns", "engines", ENGINE) is None  # not listed yet: nothing is known
    assert pod_placement.pod_nodes("ns", "others", OTHER) is None
    view = pod_placement._namespaces["ns"]
    view._replace({"uid-a": facts("a", "n1")})
    assert sorted(wakes) == ["engines", "others"]  # the first list: each ModelLoad of the namespace once
    assert pod_placement.pod_nodes("ns", "engines", ENGINE) == {"n1"}
    assert pod_placement.pod_nodes("ns", "others", OTHER) == set()

    wakes.clear()
    view._put("uid-b", facts("b", "n1"))  # a second engine pod on a node already followed
    view._put("uid-c", facts("c", None))  # not bound yet
    view._put("uid-o", facts("o", "n2", app="other"))  # another ModelLoad's
    assert wakes == ["others"]
    view._put("uid-c", facts("c", "n3"))  # bound by the scheduler
    assert wakes == ["others", "engines"] and pod_placement.pod_nodes("ns", "engines", ENGINE) == {"n1", "n3"}
    view._put("uid-c", facts("c", None))  # terminating
    view._put("uid-a", None)  # deleted: b still holds n1
    assert wakes == ["others", "engines", "engines"]
    assert pod_placement.pod_nodes("ns", "engines", ENGINE) == {"n1"}


def test_the_last_modelload_without_a_selector_stops_the_watch(wakes):
    pod_placement.pod_nodes("ns", "a", ENGINE)
    pod_placement.pod_nodes("ns", "b", ENGINE)
    view = pod_placement._namespaces["ns"]
    assert pod_placement.pod_nodes("ns", "a", None) == set()
    assert pod_placement._namespaces["ns"] is view and not view._stopping.is_set()
    assert pod_placement.pod_nodes("ns", "b", None) == set()
    assert "ns" not in pod_placement._namespaces and view._stopping.is_set()
    view._put("uid-x", facts("x", "n1"))  # a late event of the stopped watch
    assert wakes == []
