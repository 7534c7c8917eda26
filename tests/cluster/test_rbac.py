"""The chart's RBAC and admission policy against the real apiserver, with the tokens agents really hold.

The chart's ServiceAccounts, roles, bindings and ValidatingAdmissionPolicy are rendered by the real `helm template`
and applied. Agent Pod objects with `spec.nodeName` stand in for the DaemonSet's pods (there is no kubelet): a
TokenRequest bound to such a Pod gives what the kubelet would mount, a token whose userInfo carries the node
(`authentication.kubernetes.io/node-name`). Every request below is made with a plain client and that bearer token.

- An agent writes the status of its own node's WeightReplicas and its own node's Leases, nothing of another node's
  (no rewritten `ranks`, no deleted or relabelled Lease), and nothing at all with a token not bound to a node.
- Secrets: agent and operator read them in tenant namespaces only, never in another namespace or kube-system; in a
  namespace listed with its own secretNames, only those.
- Leases: only in tenant namespaces, only named like a replica's Lease and labelled with the agent's node; an agent
  may also delete a replica's Lease without the node label (an older agent's), and then write it labelled. The
  operator may delete Leases in tenant namespaces, and write none but its leader-election Lease: create it in the
  release namespace, and get and update that one name only.
- A namespace enabled later with the chart README's two RoleBindings gets the same rights.
- Nodes: the operator changes only warm-node labels (`warm.ferry.dev/*`: a patch, held to those labels by its own
  admission policy); no other label, annotation, finalizer or spec field, and it creates or deletes none. Agents
  write no Node.
- Pods: the operator lists and watches them only in tenant namespaces (a ModelLoad's podSelector).
- Worker tokens: an agent mints tokens for its own ServiceAccount, bound to its own Pod, for ferry.dev/worker/<node>
  audiences only; not bound to another agent's Pod (that would pose as the other node), not an API token, not for
  another ServiceAccount.
"""

from __future__ import annotations

import base64
import datetime as dt
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import yaml
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from ferry.api import models
from ferry_agent.kube.registry import lease_body, lease_name
from ferry_dev.localcluster import LocalCluster, wait_until
from tests.support.helm import render

pytestmark = pytest.mark.cluster

APPLIED_KINDS = {
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
}
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
SECRET = "s3-creds"
UNLISTED = "other-creds"
ATTACKER = "203.0.113.66:50051"


@dataclass
class Setup:
    cluster: LocalCluster
    release_ns: str
    tenant: str  # listed in tenantNamespaces by name: any Secret there
    restricted: str  # listed with secretNames [SECRET]
    restricted2: str  # listed with secretNames [UNLISTED]
    other: str  # not listed
    node_a: str
    node_b: str
    release: str
    agent_sa: str
    clients: dict[str, client.ApiClient]  # agent-a, agent-b, agent-unbound, operator: one bearer token each
    tokens: dict[str, str]  # those, and agent-a-worker, agent-b-worker: audience worker_audience(node_a)
    pods: dict[str, dict]  # agent-a, agent-b: the agents' Pods

    def custom(self, who: str) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.clients[who])

    def core(self, who: str) -> client.CoreV1Api:
        return client.CoreV1Api(self.clients[who])

    def leases(self, who: str) -> client.CoordinationV1Api:
        return client.CoordinationV1Api(self.clients[who])


def bearer_client(cluster: LocalCluster, token: str) -> client.ApiClient:
    cfg = client.Configuration()
    cfg.host = cluster.server
    cfg.ssl_ca_cert = str(cluster.pki.ca_cert)
    cfg.api_key = {"authorization": f"Bearer {token}"}
    return client.ApiClient(cfg)


def pod_bound_token(admin: client.ApiClient, namespace: str, sa: str, pod: dict, audiences: list[str] | None = None):
    """A TokenRequest bound to `pod`, as the kubelet requests it for a projected ServiceAccount token volume."""
    ref = client.V1BoundObjectReference(
        kind="Pod", api_version="v1", name=pod["metadata"]["name"], uid=pod["metadata"]["uid"]
    )
    spec = client.V1TokenRequestSpec(audiences=audiences or [], bound_object_ref=ref, expiration_seconds=3600)
    req = client.CoreV1Api(admin).create_namespaced_service_account_token(
        sa, namespace, client.AuthenticationV1TokenRequest(spec=spec)
    )
    return req.status.token


def forbidden(call: Callable[[], object]) -> ApiException:
    with pytest.raises(ApiException) as caught:
        call()
    assert caught.value.status == 403, caught.value.body
    return caught.value


def by_policy(exc: ApiException) -> bool:
    """Denied by the chart's ValidatingAdmissionPolicy (not by RBAC)."""
    return "-agent-node-scope' denied request: the agent" in exc.body


def by_rbac(exc: ApiException) -> bool:
    return "cannot" in exc.body and "ValidatingAdmissionPolicy" not in exc.body


def replica(name: str, node: str) -> dict:
    return {
        "apiVersion": models.API_VERSION,
        "kind": "WeightReplica",
        "metadata": {"name": name, "labels": {models.LABEL_NODE: node}},
        "spec": {"modelLoad": "m", "modelName": "m", "version": "v1", "nodeName": node},
    }


def serving_status(agent: str, endpoint: str) -> dict:
    rank = {"rank": 0, "agentName": agent, "grpcEndpoint": endpoint, "tensorCount": 3, "manifestDigest": "d"}
    return {"status": {"phase": "Serving", "version": "v1", "ranks": [rank]}}


def endpoints(wr: dict) -> list[tuple[str, str]]:
    return [(r["agentName"], r["grpcEndpoint"]) for r in wr["status"]["ranks"]]


def now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@pytest.fixture(scope="module")
def setup(cluster: LocalCluster, kube: client.ApiClient, helm_env, tmp_path_factory) -> Iterator[Setup]:
    suffix = uuid.uuid4().hex[:6]
    kinds = ("sys", "tenant", "restricted", "restricted2", "other")
    release_ns, tenant, restricted, restricted2, other = (f"rbac-{kind}-{suffix}" for kind in kinds)
    release = f"ferry-{suffix}"
    node_a, node_b = f"rbac-node-a-{suffix}", f"rbac-node-b-{suffix}"
    core = client.CoreV1Api(kube)
    clients: dict[str, client.ApiClient] = {}
    try:
        for ns in (release_ns, tenant, restricted, restricted2, other):
            core.create_namespace({"metadata": {"name": ns}})
        values = tmp_path_factory.mktemp("values") / "values.yaml"
        values.write_text(
            yaml.safe_dump(
                {
                    "tenantNamespaces": [
                        tenant,
                        {"name": restricted, "secretNames": [SECRET]},
                        {"name": restricted2, "secretNames": [UNLISTED]},
                    ]
                }
            )
        )
        docs = render(helm_env, "-f", str(values), namespace=release_ns, release=release)
        rbac = [d for d in docs if d["kind"] in APPLIED_KINDS]
        assert {d["kind"] for d in rbac} == APPLIED_KINDS
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(rbac))  # each names its namespace
        agent_sa, operator_sa = f"{release}-agent", f"{release}-operator"

        # The same Secret names in the tenant namespaces, another namespace and kube-system.
        for ns in (tenant, restricted, restricted2, other, "kube-system"):
            data = {"AWS_ACCESS_KEY_ID": base64.b64encode(ns.encode()).decode()}
            for secret in (SECRET, UNLISTED):
                core.create_namespaced_secret(ns, {"metadata": {"name": secret}, "data": data})

        tokens, pods = {}, {}
        for label, node in (("agent-a", node_a), ("agent-b", node_b)):
            core.create_node({"metadata": {"name": node}})
            pod = {
                "metadata": {"name": f"{label}-{suffix}"},
                "spec": {
                    "serviceAccountName": agent_sa,
                    "nodeName": node,
                    "containers": [{"name": "agent", "image": "ferry:0.1.0"}],
                },
            }
            pods[label] = pod = kube.sanitize_for_serialization(core.create_namespaced_pod(release_ns, pod))
            tokens[label] = pod_bound_token(kube, release_ns, agent_sa, pod)
            audience = models.worker_audience(node_a)  # what a reader mints for a source on node a
            tokens[f"{label}-worker"] = pod_bound_token(kube, release_ns, agent_sa, pod, [audience])
        # A token of the agent's ServiceAccount not bound to any Pod (`kubectl create token`): no node name.
        plain = client.AuthenticationV1TokenRequest(spec=client.V1TokenRequestSpec(audiences=[]))
        for label, sa in (("agent-unbound", agent_sa), ("operator", operator_sa)):
            tokens[label] = core.create_namespaced_service_account_token(sa, release_ns, plain).status.token
        clients = {label: bearer_client(cluster, token) for label, token in tokens.items() if "worker" not in label}

        s = Setup(
            cluster,
            release_ns,
            tenant,
            restricted,
            restricted2,
            other,
            node_a,
            node_b,
            release,
            agent_sa,
            clients,
            tokens,
            pods,
        )
        # RBAC and the policy take effect once the apiserver's informers see them: wait for an allowed read and for
        # the first denial of a write that RBAC alone allows (a probe replica of the other node).
        wait_until(lambda: s.core("agent-a").read_namespaced_secret(SECRET, tenant) is not None, 30, "RBAC")
        objects = client.CustomObjectsApi(kube)
        objects.create_namespaced_custom_object(
            models.GROUP, models.VERSION, tenant, "weightreplicas", replica("probe", node_b)
        )

        def probe_denied() -> bool:
            try:
                s.custom("agent-a").patch_namespaced_custom_object_status(
                    models.GROUP, models.VERSION, tenant, "weightreplicas", "probe", {"status": {"phase": "Pending"}}
                )
            except ApiException as exc:
                return exc.status == 403 and by_policy(exc)
            return False

        wait_until(probe_denied, 30, "the admission policy's first denial")
        yield s
    finally:
        for api in clients.values():
            api.close()
        selector = f"app.kubernetes.io/instance={release}"
        kinds = "clusterrole,clusterrolebinding,validatingadmissionpolicy,validatingadmissionpolicybinding"
        cluster.kubectl("delete", kinds, "-l", selector, "--ignore-not-found", check=False)
        cluster.kubectl("delete", "node", node_a, node_b, "--ignore-not-found", check=False)
        cluster.kubectl("delete", "secret", SECRET, UNLISTED, "-n", "kube-system", "--ignore-not-found", check=False)
        for ns in (release_ns, tenant, restricted, restricted2, other):
            cluster.kubectl("delete", "namespace", ns, "--wait=false", "--ignore-not-found", check=False)


def test_the_agents_token_names_its_node(setup):
    """The premise of the policy: a Pod-bound token carries the Pod's node; `kubectl create token` does not."""

    def whoami(who: str) -> client.V1UserInfo:
        review = client.AuthenticationV1Api(setup.clients[who]).create_self_subject_review(client.V1SelfSubjectReview())
        return review.status.user_info

    user = whoami("agent-a")
    assert user.username == f"system:serviceaccount:{setup.release_ns}:{setup.agent_sa}"
    assert user.extra[NODE_NAME_EXTRA] == [setup.node_a]
    assert whoami("agent-b").extra[NODE_NAME_EXTRA] == [setup.node_b]
    assert NODE_NAME_EXTRA not in (whoami("agent-unbound").extra or {})


@pytest.mark.parametrize("who", ["agent-a", "operator"])
def test_secrets_are_readable_only_in_tenant_namespaces(setup, who):
    core = setup.core(who)
    secret = core.read_namespaced_secret(SECRET, setup.tenant)
    assert base64.b64decode(secret.data["AWS_ACCESS_KEY_ID"]).decode() == setup.tenant
    for ns in (setup.other, "kube-system"):
        assert by_rbac(forbidden(lambda ns=ns: core.read_namespaced_secret(SECRET, ns)))
    assert by_rbac(forbidden(lambda: core.list_namespaced_secret(setup.tenant)))
    assert by_rbac(forbidden(lambda: core.list_secret_for_all_namespaces()))


@pytest.mark.parametrize("who", ["agent-a", "operator"])
def test_each_tenant_namespace_follows_its_own_secret_names(setup, who):
    """`{name, secretNames}` entries: in that namespace only those Secrets; a plain name: any Secret there."""
    core = setup.core(who)

    def readable(ns: str, name: str) -> bool:
        try:
            secret = core.read_namespaced_secret(name, ns)
        except ApiException as exc:
            assert exc.status == 403 and by_rbac(exc), exc.body
            return False
        assert base64.b64decode(secret.data["AWS_ACCESS_KEY_ID"]).decode() == ns
        return True

    assert readable(setup.restricted, SECRET) and not readable(setup.restricted, UNLISTED)
    assert readable(setup.restricted2, UNLISTED) and not readable(setup.restricted2, SECRET)
    assert readable(setup.tenant, SECRET) and readable(setup.tenant, UNLISTED)
    for ns in (setup.restricted, setup.restricted2):
        assert by_rbac(forbidden(lambda ns=ns: core.list_namespaced_secret(ns)))


def test_a_restricted_namespace_keeps_the_lease_rules(setup):
    """Its Role holds the same Lease rules as the tenant ClusterRole; the admission policy still applies."""
    leases = setup.leases("agent-a")
    ns = setup.restricted
    leases.create_namespaced_lease(ns, lease_body("r-a", "agent-a-1", now(), 15, node=setup.node_a))
    leases.patch_namespaced_lease(lease_name("r-a"), ns, {"spec": {"renewTime": now()}})
    theirs = lease_body("r-b", "agent-a-1", now(), 15, node=setup.node_b)
    assert by_policy(forbidden(lambda: leases.create_namespaced_lease(ns, theirs)))
    leases.delete_namespaced_lease(lease_name("r-a"), ns)


def test_agent_writes_status_only_of_its_own_nodes_replicas(setup, kube):
    admin = client.CustomObjectsApi(kube)
    wr = (models.GROUP, models.VERSION, setup.tenant, "weightreplicas")
    for name, node in (("m-a", setup.node_a), ("m-b", setup.node_b)):
        admin.create_namespaced_custom_object(*wr, replica(name, node))
    honest = serving_status("agent-b", "10.0.0.2:50051")
    setup.custom("agent-b").patch_namespaced_custom_object_status(*wr, "m-b", honest)

    # Own node: allowed, through the agent's own call (a PATCH on /status).
    mine = serving_status("agent-a", "10.0.0.1:50051")
    setup.custom("agent-a").patch_namespaced_custom_object_status(*wr, "m-a", mine)
    assert endpoints(admin.get_namespaced_custom_object(*wr, "m-a")) == [("agent-a", "10.0.0.1:50051")]

    # Another node's replica: readers must not be pointed at an attacker's endpoint, by patch or by update.
    agent_a, unbound = setup.custom("agent-a"), setup.custom("agent-unbound")
    hijack = serving_status("agent-b", ATTACKER)
    assert by_policy(forbidden(lambda: agent_a.patch_namespaced_custom_object_status(*wr, "m-b", hijack)))
    current = agent_a.get_namespaced_custom_object(*wr, "m-b")
    current["status"] = hijack["status"]
    assert by_policy(forbidden(lambda: agent_a.replace_namespaced_custom_object_status(*wr, "m-b", current)))
    # A token of the agent's ServiceAccount not bound to a node may not even write its "own".
    assert by_policy(forbidden(lambda: unbound.patch_namespaced_custom_object_status(*wr, "m-a", mine)))
    assert endpoints(admin.get_namespaced_custom_object(*wr, "m-b")) == [("agent-b", "10.0.0.2:50051")]


def test_agent_holds_only_its_own_nodes_leases(setup):
    leases_a, leases_b, leases_unbound = (setup.leases(w) for w in ("agent-a", "agent-b", "agent-unbound"))
    ns = setup.tenant

    # Own Lease, the way the agent writes it (lease_body), renews it (a spec patch) and releases it.
    mine = lease_body("own-a", "agent-a-1", now(), 15, node=setup.node_a)
    created = leases_a.create_namespaced_lease(ns, mine)
    assert created.metadata.labels[models.LABEL_NODE] == setup.node_a
    renewed = leases_a.patch_namespaced_lease(lease_name("own-a"), ns, {"spec": {"renewTime": now()}})
    assert renewed.spec.renew_time > created.spec.renew_time
    leases_a.delete_namespaced_lease(lease_name("own-a"), ns)

    # Node b's Lease, written by node b's agent: node a may neither delete, renew nor relabel it as its own.
    theirs = lease_body("m-b", "agent-b-1", now(), 15, node=setup.node_b)
    leases_b.create_namespaced_lease(ns, theirs)
    name_b = lease_name("m-b")
    assert by_policy(forbidden(lambda: leases_a.delete_namespaced_lease(name_b, ns)))
    assert by_policy(forbidden(lambda: leases_a.patch_namespaced_lease(name_b, ns, {"spec": {"holderIdentity": "x"}})))
    relabel = {"metadata": {"labels": {models.LABEL_NODE: setup.node_a}}, "spec": {"holderIdentity": "x"}}
    assert by_policy(forbidden(lambda: leases_a.patch_namespaced_lease(name_b, ns, relabel)))
    kept = leases_b.read_namespaced_lease(name_b, ns)
    assert kept.spec.holder_identity == "agent-b-1" and kept.metadata.labels[models.LABEL_NODE] == setup.node_b

    # Creating: not labelled for another node, not unlabelled, not under another name, not without a node.
    unlabelled = lease_body("x-a", "agent-a-1", now(), 15, node=setup.node_a)
    del unlabelled["metadata"]["labels"][models.LABEL_NODE]
    foreign = {**lease_body("y-a", "agent-a-1", now(), 15, node=setup.node_a)}
    foreign["metadata"] = {**foreign["metadata"], "name": "kube-scheduler"}
    for body in (lease_body("z-a", "agent-a-1", now(), 15, node=setup.node_b), unlabelled, foreign):
        assert by_policy(forbidden(lambda body=body: leases_a.create_namespaced_lease(ns, body)))
    assert by_policy(forbidden(lambda: leases_unbound.create_namespaced_lease(ns, mine)))

    # Outside tenant namespaces RBAC grants no Lease at all: not in kube-system, not in another namespace.
    for where in ("kube-system", setup.other):
        assert by_rbac(forbidden(lambda where=where: leases_a.create_namespaced_lease(where, mine)))
    assert by_rbac(forbidden(lambda: leases_a.delete_namespaced_lease("kube-controller-manager", "kube-system")))


def review(setup: Setup, who: str, token: str, audience: str) -> client.V1TokenReviewStatus:
    spec = client.V1TokenReviewSpec(token=token, audiences=[audience])
    return client.AuthenticationV1Api(setup.clients[who]).create_token_review(client.V1TokenReview(spec=spec)).status


def test_an_unlabelled_lease_is_deleted_and_written_again_by_its_agent(setup, kube):
    """The upgrade path: a Lease written before the node label existed can be updated by no agent, but deleted by
    one, which then creates it labelled with its node (what `kube.lease.ReplicaLeases.write` does on the policy's
    refusal). Once labelled, another node's agent can neither delete nor update it."""
    admin = client.CoordinationV1Api(kube)
    leases_a, leases_b, unbound = (setup.leases(w) for w in ("agent-a", "agent-b", "agent-unbound"))
    ns, name = setup.tenant, lease_name("old-a")
    old = lease_body("old-a", "agent-old", now(), 15, node=setup.node_a)
    del old["metadata"]["labels"][models.LABEL_NODE]  # as an agent older than the label wrote it
    admin.create_namespaced_lease(ns, old)

    ours = lease_body("old-a", "agent-a-2", now(), 15, node=setup.node_a)
    take = {"metadata": {"labels": ours["metadata"]["labels"]}, "spec": ours["spec"]}
    assert by_policy(forbidden(lambda: leases_a.patch_namespaced_lease(name, ns, take)))
    assert by_policy(forbidden(lambda: unbound.delete_namespaced_lease(name, ns)))  # a node is still required
    leases_a.delete_namespaced_lease(name, ns)
    created = leases_a.create_namespaced_lease(ns, ours)
    assert created.metadata.labels[models.LABEL_NODE] == setup.node_a and created.spec.holder_identity == "agent-a-2"
    leases_a.patch_namespaced_lease(name, ns, {"spec": {"renewTime": now()}})

    assert by_policy(forbidden(lambda: leases_b.delete_namespaced_lease(name, ns)))
    assert by_policy(forbidden(lambda: leases_b.patch_namespaced_lease(name, ns, {"spec": {"holderIdentity": "x"}})))
    # The exception is for replicas' Leases only: no other unlabelled Lease may be deleted.
    other = {**old, "metadata": {"name": "leader-election"}}
    admin.create_namespaced_lease(ns, other)
    assert by_policy(forbidden(lambda: leases_a.delete_namespaced_lease("leader-election", ns)))
    assert admin.read_namespaced_lease(name, ns).spec.holder_identity == "agent-a-2"


def test_operator_may_delete_leases_only_in_tenant_namespaces(setup, kube):
    """It deletes a replica's Lease that names another node (a squatted name); it writes no Lease itself."""
    admin, operator = client.CoordinationV1Api(kube), setup.leases("operator")
    for ns in (setup.tenant, setup.restricted, setup.other):
        admin.create_namespaced_lease(ns, lease_body("sq", "agent-b-1", now(), 15, node=setup.node_b))
    for ns in (setup.tenant, setup.restricted):
        operator.delete_namespaced_lease(lease_name("sq"), ns)
    assert by_rbac(forbidden(lambda: operator.delete_namespaced_lease(lease_name("sq"), setup.other)))
    assert by_rbac(forbidden(lambda: operator.delete_namespaced_lease("kube-controller-manager", "kube-system")))
    mine = lease_body("op", "operator", now(), 15, node=setup.node_a)
    assert by_rbac(forbidden(lambda: operator.create_namespaced_lease(setup.tenant, mine)))
    kept = admin.read_namespaced_lease(lease_name("sq"), setup.other)
    assert by_rbac(forbidden(lambda: operator.patch_namespaced_lease(kept.metadata.name, setup.other, {"spec": {}})))


def test_operator_writes_only_its_leader_election_lease(setup, kube):
    admin, operator = client.CoordinationV1Api(kube), setup.leases("operator")
    ns, name = setup.release_ns, f"{setup.release}-operator"
    record = {"holderIdentity": "op-1", "leaseDurationSeconds": 10, "renewTime": now()}
    created = operator.create_namespaced_lease(ns, {"metadata": {"name": name}, "spec": record})
    created.spec.holder_identity = "op-2"
    assert operator.replace_namespaced_lease(name, ns, created).spec.holder_identity == "op-2"
    assert operator.read_namespaced_lease(name, ns).spec.holder_identity == "op-2"
    # Only that name: another Lease there (it may create one: RBAC cannot limit create to a name) it cannot write.
    other = admin.create_namespaced_lease(ns, {"metadata": {"name": "someone-elses"}, "spec": record})
    other.spec.holder_identity = "op-2"
    assert by_rbac(forbidden(lambda: operator.replace_namespaced_lease("someone-elses", ns, other)))
    assert by_rbac(forbidden(lambda: operator.patch_namespaced_lease(name, ns, {"spec": {"holderIdentity": "x"}})))
    assert by_rbac(forbidden(lambda: operator.delete_namespaced_lease(name, ns)))
    for elsewhere in (setup.other, "kube-system"):
        body = {"metadata": {"name": name}, "spec": record}
        assert by_rbac(forbidden(lambda ns=elsewhere, body=body: operator.create_namespaced_lease(ns, body)))


def test_agent_may_review_worker_tokens(setup):
    """The worker service's check of a reader: a TokenReview for its own node's audience returns the reader's node."""
    status = review(setup, "agent-a", setup.tokens["agent-b-worker"], models.worker_audience(setup.node_a))
    assert status.authenticated, status.error
    assert status.user.username == f"system:serviceaccount:{setup.release_ns}:{setup.agent_sa}"
    assert status.user.extra[NODE_NAME_EXTRA] == [setup.node_b]
    # A token for node a's source is not one for node b's, and the API token is not a worker token.
    assert not review(
        setup, "agent-b", setup.tokens["agent-b-worker"], models.worker_audience(setup.node_b)
    ).authenticated
    assert not review(setup, "agent-a", setup.tokens["agent-b"], models.worker_audience(setup.node_a)).authenticated


def test_agent_mints_worker_tokens_only_bound_to_its_own_pod(setup, kube):
    """What a reader does before it calls a source (`worker_auth.ReaderTokens`), with the agent's own API token."""
    ns, agent_sa = setup.release_ns, setup.agent_sa

    def mint(
        pod: dict | None,
        audiences: list[str],
        *,
        who: str = "agent-a",
        sa: str = agent_sa,
        where: str = ns,
        uid: str | None = None,
    ) -> str:
        ref = None
        if pod is not None:
            ref = client.V1BoundObjectReference(
                kind="Pod", api_version="v1", name=pod["metadata"]["name"], uid=uid or pod["metadata"]["uid"]
            )
        spec = client.V1TokenRequestSpec(audiences=audiences, bound_object_ref=ref, expiration_seconds=600)
        body = client.AuthenticationV1TokenRequest(spec=spec)
        return setup.core(who).create_namespaced_service_account_token(sa, where, body).status.token

    pod_a, pod_b = setup.pods["agent-a"], setup.pods["agent-b"]
    worker_x = models.worker_audience("x")
    # Own Pod, a source's audience: the token a source on node x admits, carrying node a.
    token = mint(pod_a, [worker_x])
    status = review(setup, "agent-b", token, worker_x)
    assert status.authenticated, status.error
    assert status.user.username == f"system:serviceaccount:{ns}:{agent_sa}"
    assert status.user.extra[NODE_NAME_EXTRA] == [setup.node_a]

    # (a) Not bound to agent b's Pod (a token that would say node b), not to its own Pod's name with b's uid, not
    # unbound; and a token not bound to a Pod mints nothing.
    for pod, uid in ((pod_b, None), (pod_a, pod_b["metadata"]["uid"]), (None, None)):
        exc = forbidden(lambda pod=pod, uid=uid: mint(pod, [worker_x], uid=uid))
        assert by_policy(exc) and "may mint only tokens bound to its own Pod" in exc.body, exc.body
    assert by_policy(forbidden(lambda: mint(pod_a, [worker_x], who="agent-unbound")))
    # (b) Only ferry.dev/worker/<node> audiences: no other, not the bare prefix, and no API token (no audience means
    # the apiserver's own), not even alongside a worker audience.
    for audiences in (
        ["ferry.dev/other"],
        [models.WORKER_AUDIENCE_PREFIX],
        [],
        [worker_x, "https://kubernetes.default.svc"],
    ):
        exc = forbidden(lambda audiences=audiences: mint(pod_a, audiences))
        assert by_policy(exc) and "may mint only worker tokens" in exc.body, (audiences, exc.body)
    # (c) Only for its own ServiceAccount, and only in the release namespace (not a same-named one elsewhere).
    client.CoreV1Api(kube).create_namespaced_service_account(setup.tenant, {"metadata": {"name": agent_sa}})
    assert by_rbac(forbidden(lambda: mint(pod_a, [worker_x], sa=f"{setup.release}-operator")))
    assert by_rbac(forbidden(lambda: mint(pod_a, [worker_x], where=setup.tenant)))


def test_a_namespace_enabled_later_by_the_documented_role_bindings(setup, kube):
    """charts/ferry/README.md, "Enabling a namespace": two RoleBindings give the same rights as tenantNamespaces."""
    ns = f"rbac-late-{uuid.uuid4().hex[:6]}"
    core = client.CoreV1Api(kube)
    core.create_namespace({"metadata": {"name": ns}})
    try:
        core.create_namespaced_secret(ns, {"metadata": {"name": SECRET}, "data": {"k": "dg=="}})
        agent, operator = setup.core("agent-a"), setup.core("operator")
        assert by_rbac(forbidden(lambda: agent.read_namespaced_secret(SECRET, ns)))
        for component in ("agent", "operator"):
            name = f"{setup.release}-{component}"
            setup.cluster.kubectl(
                "-n",
                ns,
                "create",
                "rolebinding",
                name,
                f"--clusterrole={name}-tenant",
                f"--serviceaccount={setup.release_ns}:{name}",
            )
        wait_until(lambda: agent.read_namespaced_secret(SECRET, ns) is not None, 30, "the agent's RoleBinding")
        wait_until(lambda: operator.read_namespaced_secret(SECRET, ns) is not None, 30, "the operator's RoleBinding")
        lease = lease_body("late-a", "agent-a-1", now(), 15, node=setup.node_a)
        setup.leases("agent-a").create_namespaced_lease(ns, lease)
        other = lease_body("late-b", "agent-a-1", now(), 15, node=setup.node_b)
        assert by_policy(forbidden(lambda: setup.leases("agent-a").create_namespaced_lease(ns, other)))
    finally:
        setup.cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def by_operator_policy(exc: ApiException) -> bool:
    """Denied by the chart's ValidatingAdmissionPolicy on the operator's Node writes."""
    return "-operator-node-labels' denied request: the operator" in exc.body


def test_operator_changes_only_warm_node_labels(setup, kube):
    """Warm-node labels: RBAC lets the operator patch Nodes; the chart's policy lets that patch change only
    `warm.ferry.dev/*` labels, nothing else of a Node. Neither lets an agent write a Node at all."""
    admin, operator = client.CoreV1Api(kube), setup.core("operator")
    node, key = setup.node_a, models.warm_node_label(setup.tenant, "serve")
    admin.patch_node(node, {"metadata": {"labels": {"team": "a"}, "annotations": {"owner": "ops"}}})

    def refused(body: dict) -> ApiException:
        return forbidden(lambda: operator.patch_node(node, body))

    def policy_denies() -> bool:
        try:
            operator.patch_node(node, {"metadata": {"labels": {"team": "b"}}})
        except ApiException as exc:
            return exc.status == 403 and by_operator_policy(exc)
        return False

    wait_until(policy_denies, 30, "the operator policy's first denial")
    operator.patch_node(node, {"metadata": {"labels": {key: "v1"}}})
    assert admin.read_node(node).metadata.labels[key] == "v1"
    operator.patch_node(node, {"metadata": {"labels": {key: "v2", models.warm_node_label(setup.other, "x"): "v9"}}})
    operator.patch_node(node, {"metadata": {"labels": {key: None}}})
    assert key not in admin.read_node(node).metadata.labels

    taint = {"key": "evil", "effect": "NoSchedule"}
    for body in (
        {"metadata": {"labels": {"team": "b"}}},  # another label: changed, removed, added
        {"metadata": {"labels": {"team": None}}},
        {"metadata": {"labels": {"node-role.kubernetes.io/control-plane": ""}}},
        {"metadata": {"labels": {key: "v1", "team": "b"}}},  # not even alongside a warm label
        {"metadata": {"annotations": {"owner": "me"}}},
        {"metadata": {"finalizers": ["example.com/hold"]}},
        {"spec": {"unschedulable": True}},
        {"spec": {"taints": [taint]}},
    ):
        assert by_operator_policy(refused(body)), body
    assert by_rbac(forbidden(lambda: operator.delete_node(node)))
    assert by_rbac(forbidden(lambda: operator.create_node({"metadata": {"name": f"{node}-x"}})))
    assert by_rbac(forbidden(lambda: operator.patch_node_status(node, {"status": {"capacity": {"cpu": "1"}}})))
    current = admin.read_node(node)
    assert by_rbac(forbidden(lambda: operator.replace_node(node, current)))  # update: not granted, patch is
    warm = {"metadata": {"labels": {key: "1"}}}
    for agent in ("agent-a", "agent-unbound"):
        assert by_rbac(forbidden(lambda agent=agent: setup.core(agent).patch_node(node, warm)))
    after = admin.read_node(node)
    assert after.metadata.labels.get("team") == "a" and after.metadata.annotations.get("owner") == "ops"
    assert key not in after.metadata.labels and not after.spec.unschedulable
    assert "evil" not in [t.key for t in after.spec.taints or []]  # the node controller's own taints may be there


def test_operator_lists_and_watches_pods_only_in_tenant_namespaces(setup, kube):
    """Weights follow pods: the operator lists (and watches) the Pods of a tenant namespace; it gets none by name,
    and sees none elsewhere, not cluster-wide."""
    operator = setup.core("operator")
    for ns in (setup.tenant, setup.restricted):
        operator.list_namespaced_pod(ns)
        operator.list_namespaced_pod(ns, watch=True, timeout_seconds=1, _preload_content=False).release_conn()
    pod = setup.pods["agent-a"]["metadata"]["name"]
    assert by_rbac(forbidden(lambda: operator.read_namespaced_pod(pod, setup.release_ns)))
    for ns in (setup.other, setup.release_ns, "kube-system"):
        assert by_rbac(forbidden(lambda ns=ns: operator.list_namespaced_pod(ns)))
    assert by_rbac(forbidden(lambda: operator.list_pod_for_all_namespaces()))
