"""The agent's Lease writes (`kube.lease.ReplicaLeases`) against a fake CoordinationV1Api that answers as the chart's
admission policy does: an agent may update only a Lease labelled with its node, and delete one with no node label at
all."""

from __future__ import annotations

import copy
import itertools
from typing import Any

import pytest
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from ferry.api.models import LABEL_NODE
from ferry_agent.kube.lease import ReplicaLeases
from ferry_agent.kube.registry import lease_name

pytestmark = pytest.mark.unit

NS, REPLICA, NODE = "team-a", "serve-node-a-0123456789", "node-a"


class PolicyLeases:
    """Leases by name, with the policy's decisions for the agent of `node`."""

    def __init__(self, node: str) -> None:
        self.node = node
        self.leases: dict[str, dict[str, Any]] = {}
        self.versions = itertools.count(1)
        self.calls: list[str] = []

    def put(self, name: str, labels: dict[str, str], holder: str) -> None:
        meta = {"name": name, "labels": labels, "resourceVersion": str(next(self.versions))}
        self.leases[name] = {"metadata": meta, "spec": {"holderIdentity": holder}}

    def _own(self, lease: dict[str, Any]) -> bool:
        return lease["metadata"]["labels"].get(LABEL_NODE) == self.node

    def read_namespaced_lease(self, name: str, namespace: str) -> client.V1Lease:
        self.calls.append("read")
        if name not in self.leases:
            raise ApiException(status=404)
        lease = self.leases[name]
        meta = client.V1ObjectMeta(
            name=name, labels=dict(lease["metadata"]["labels"]), resource_version=lease["metadata"]["resourceVersion"]
        )
        return client.V1Lease(metadata=meta)

    def patch_namespaced_lease(self, name: str, namespace: str, body: dict[str, Any]) -> None:
        self.calls.append("patch")
        if name not in self.leases:
            raise ApiException(status=404)
        old = self.leases[name]
        new = copy.deepcopy(old)
        new["metadata"]["labels"].update((body.get("metadata") or {}).get("labels") or {})
        new["spec"].update(body["spec"])
        if not (self._own(old) and self._own(new)):  # the policy checks the object before and after
            raise ApiException(status=403, reason="Forbidden")
        self.put(name, new["metadata"]["labels"], new["spec"]["holderIdentity"])

    def delete_namespaced_lease(self, name: str, namespace: str, body: client.V1DeleteOptions) -> None:
        self.calls.append("delete")
        if name not in self.leases:
            raise ApiException(status=404)
        lease = self.leases[name]
        if LABEL_NODE in lease["metadata"]["labels"] and not self._own(lease):
            raise ApiException(status=403, reason="Forbidden")
        if body.preconditions.resource_version != lease["metadata"]["resourceVersion"]:
            raise ApiException(status=409)
        del self.leases[name]

    def create_namespaced_lease(self, namespace: str, body: dict[str, Any]) -> None:
        self.calls.append("create")
        if body["metadata"]["name"] in self.leases:
            raise ApiException(status=409)
        if body["metadata"]["labels"].get(LABEL_NODE) != self.node:
            raise ApiException(status=403, reason="Forbidden")
        self.put(body["metadata"]["name"], body["metadata"]["labels"], body["spec"]["holderIdentity"])


def agent_with(leases: PolicyLeases) -> ReplicaLeases:
    """The Leases of the agent `node-a-0` on node a."""
    return ReplicaLeases(leases, holder=f"{NODE}-0", node=NODE, lease_seconds=15)  # type: ignore[arg-type]


@pytest.mark.parametrize("acquire", [True, False], ids=["acquire", "renewal"])
def test_an_unlabelled_lease_is_deleted_and_written_again_labelled(acquire: bool) -> None:
    """An agent older than the node label wrote it; the policy refuses every update of it, for good."""
    leases = PolicyLeases(NODE)
    leases.put(lease_name(REPLICA), {"ferry.dev/replica": REPLICA}, "old-agent")
    agent = agent_with(leases)
    agent.write((NS, REPLICA), acquire=acquire)
    lease = leases.leases[lease_name(REPLICA)]
    assert lease["metadata"]["labels"][LABEL_NODE] == NODE and lease["spec"]["holderIdentity"] == agent.holder
    assert leases.calls == ["patch", "read", "delete", "create"]
    agent.write((NS, REPLICA), acquire=False)  # and from then on renewed in place
    assert leases.calls[-1] == "patch" and leases.leases[lease_name(REPLICA)]["spec"]["holderIdentity"] == agent.holder


def test_another_nodes_lease_is_neither_deleted_nor_overwritten() -> None:
    """Node b squatted the name: the agent's write fails (the operator deletes such a Lease) and nothing changes."""
    leases = PolicyLeases(NODE)
    leases.put(lease_name(REPLICA), {"ferry.dev/replica": REPLICA, LABEL_NODE: "node-b"}, "squatter")
    agent = agent_with(leases)
    with pytest.raises(ApiException) as refused:
        agent.write((NS, REPLICA), acquire=True)
    assert refused.value.status == 403
    assert leases.calls == ["patch", "read"]
    assert leases.leases[lease_name(REPLICA)]["spec"]["holderIdentity"] == "squatter"
    del leases.leases[lease_name(REPLICA)]  # what the operator does
    agent.write((NS, REPLICA), acquire=False)
    assert leases.leases[lease_name(REPLICA)]["metadata"]["labels"][LABEL_NODE] == NODE


def test_an_unlabelled_lease_changed_since_it_was_read_is_not_deleted() -> None:
    leases = PolicyLeases(NODE)
    leases.put(lease_name(REPLICA), {"ferry.dev/replica": REPLICA}, "old-agent")
    read = leases.read_namespaced_lease

    def read_then_renewed(name: str, namespace: str) -> client.V1Lease:
        seen = read(name, namespace)
        leases.put(name, {"ferry.dev/replica": REPLICA}, "old-agent")  # the old agent renewed it meanwhile
        return seen

    leases.read_namespaced_lease = read_then_renewed  # type: ignore[method-assign]
    with pytest.raises(ApiException) as conflict:
        agent_with(leases).write((NS, REPLICA), acquire=True)
    assert conflict.value.status == 409 and lease_name(REPLICA) in leases.leases
