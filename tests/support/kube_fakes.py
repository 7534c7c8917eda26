"""Fakes of the Kubernetes APIs a node agent talks to, for unit tests of its reconcile: WeightReplicas (list and
status patches) and Leases, each of which can be "down" (connection refused, as an unreachable apiserver)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import urllib3.exceptions
from kubernetes.client.exceptions import ApiException

from ferry_agent.config import AgentConfig
from ferry_agent.kube.lease import ReplicaLeases
from ferry_agent.kube.replicas import NodeReplicas
from ferry_agent.node_agent import NodeAgent


def refused() -> urllib3.exceptions.MaxRetryError:
    return urllib3.exceptions.MaxRetryError(None, "/apis", ConnectionRefusedError(111, "Connection refused"))


def api_error(status: int) -> ApiException:
    return ApiException(status=status, reason="test")


class FakeObjects:
    """The WeightReplicas of `items` (what every list returns), and the status patches written, in order."""

    def __init__(self, *, down: bool = True) -> None:
        self.down = down
        self.lists = 0
        self.items: list[dict[str, Any]] = []
        self.patches: list[dict[str, Any]] = []

    def list_cluster_custom_object(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        self.lists += 1
        if self.down:
            raise refused()
        return {"items": self.items}

    def patch_namespaced_custom_object_status(self, group, version, namespace, plural, name, body) -> None:  # type: ignore[no-untyped-def]
        if self.down:
            raise refused()
        self.patches.append(body["status"])


class FakeLeases:
    """Leases by name; `down` refuses every write but the deletion."""

    def __init__(self) -> None:
        self.leases: dict[str, dict[str, Any]] = {}
        self.down = False

    def patch_namespaced_lease(self, name: str, namespace: str, body: dict[str, Any]) -> None:
        if self.down:
            raise refused()
        if name not in self.leases:
            raise api_error(404)
        self.leases[name]["spec"].update(body["spec"])

    def create_namespaced_lease(self, namespace: str, body: dict[str, Any]) -> None:
        if self.down:
            raise refused()
        self.leases[body["metadata"]["name"]] = body

    def delete_namespaced_lease(self, name: str, namespace: str) -> None:
        del self.leases[name]


def agent_config(node: str = "n1", **overrides: Any) -> AgentConfig:
    """The agent's settings as `python -m ferry_agent --node NODE` parses them, with `overrides`."""
    return AgentConfig.from_args(["--node", node, "--socket-dir", ""]).model_copy(update=overrides)


def fake_agent(objects: FakeObjects, leases: FakeLeases, *, peer: Any = None, **overrides: Any) -> NodeAgent:
    """A NodeAgent of node n1 (settings: `agent_config(**overrides)`) over the fakes, with no watch thread."""
    peer = peer or SimpleNamespace(name="n1-peer", shutdown=lambda: None, deregister=lambda resident: None)
    config = agent_config(**overrides)
    agent = NodeAgent(SimpleNamespace(), config, peer_factory=lambda name: peer)  # type: ignore[arg-type]
    agent.replicas = NodeReplicas(objects, config.node)  # type: ignore[arg-type]
    agent.replicas.watch = lambda wake, stopping: None  # type: ignore[method-assign]
    agent.leases = ReplicaLeases(  # type: ignore[arg-type]
        leases, holder=agent.agent_name, node=config.node, lease_seconds=config.lease_seconds
    )
    return agent
