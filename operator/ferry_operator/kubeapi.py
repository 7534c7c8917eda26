"""The API calls the operator makes; blocking, so call them via a thread. kopf writes nothing of its own here."""

from __future__ import annotations

import functools

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from ferry.api.models import GROUP, VERSION
from ferry.kube import kube_client

# The kopf resource of each kind, for handler decorators and kopf's own calls.
WV = (GROUP, VERSION, "weightversions")
ML = (GROUP, VERSION, "modelloads")
WR = (GROUP, VERSION, "weightreplicas")


class NotFound(LookupError):
    pass


@functools.cache
def api_client() -> client.ApiClient:
    return kube_client()


def read_secret_data(namespace: str, name: str) -> dict[str, str]:
    """The Secret's `.data`, still base64-encoded as the API returns it."""
    try:
        secret = client.CoreV1Api(api_client()).read_namespaced_secret(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            raise NotFound(f"Secret {namespace}/{name} not found") from exc
        raise
    return dict(secret.data or {})


def get_object(plural: str, namespace: str, name: str) -> dict | None:
    """The object as it is now (None: gone): what a reconcile woken in process starts from."""
    try:
        return _objects().get_namespaced_custom_object(GROUP, VERSION, namespace, plural, name)
    except ApiException as exc:
        if exc.status != 404:
            raise
        return None


def patch_status(plural: str, namespace: str, name: str, status: dict, resource_version: str | None = None) -> bool:
    """Merge `status` into the object's status subresource (a gone object is no error). Given `resource_version`,
    only into the object as read: False (409) when it changed since, so a status computed from an older
    generation never overwrites a newer one's."""
    body: dict = {"status": status}
    if resource_version is not None:
        body["metadata"] = {"resourceVersion": resource_version}
    try:
        _objects().patch_namespaced_custom_object_status(GROUP, VERSION, namespace, plural, name, body)
    except ApiException as exc:
        if exc.status == 404 or (exc.status == 409 and resource_version is not None):
            return False
        raise
    return True


def _objects() -> client.CustomObjectsApi:
    return client.CustomObjectsApi(api_client())


def create_replica(body: dict) -> bool:
    """False when it is already there (a previous reconcile created it)."""
    try:
        _objects().create_namespaced_custom_object(
            GROUP, VERSION, body["metadata"]["namespace"], "weightreplicas", body
        )
    except ApiException as exc:
        if exc.status != 409:
            raise
        return False
    return True


def delete_replica(namespace: str, name: str) -> bool:
    """False when it was already gone."""
    try:
        _objects().delete_namespaced_custom_object(GROUP, VERSION, namespace, "weightreplicas", name)
    except ApiException as exc:
        if exc.status != 404:
            raise
        return False
    return True


def retarget_replica(namespace: str, name: str, ops: list[dict]) -> bool:
    """Apply the JSON patch `ops` (`modelloads.retarget_ops`). False: its test failed (422; the replica moved since
    it was read, so a newer reconcile owns it) or the replica is gone."""
    try:
        _objects().patch_namespaced_custom_object(
            GROUP, VERSION, namespace, "weightreplicas", name, ops, _content_type="application/json-patch+json"
        )
    except ApiException as exc:
        if exc.status in (404, 422):
            return False
        raise
    return True


def set_replica_conditions(namespace: str, name: str, conditions: list[dict]) -> None:
    """The operator's one field of a WeightReplica status (the agent owns the others)."""
    body = {"status": {"conditions": conditions}}
    try:
        _objects().patch_namespaced_custom_object_status(GROUP, VERSION, namespace, "weightreplicas", name, body)
    except ApiException as exc:
        if exc.status != 404:
            raise


def retire_version(namespace: str, name: str, uid: str, annotations: dict[str, str]) -> bool:
    """Annotate, then delete, the WeightVersion `name` only if it is still the object `uid` (a republished name is
    another version). False: it is gone or was replaced; other refusals (403) raise."""
    try:
        body = {"metadata": {"uid": uid, "annotations": annotations}}  # a uid in a patch is a precondition
        _objects().patch_namespaced_custom_object(GROUP, VERSION, namespace, "weightversions", name, body)
        _objects().delete_namespaced_custom_object(
            GROUP,
            VERSION,
            namespace,
            "weightversions",
            name,
            body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid)),
        )
    except ApiException as exc:
        # 404: gone; 409 (delete precondition) or 422 (a patch may not change the uid): the name is another object.
        if exc.status in (404, 409, 422):
            return False
        raise
    return True


def delete_lease(namespace: str, name: str, uid: str) -> bool:
    """Delete that very Lease object (a precondition on its uid: never a Lease its rightful agent wrote since).
    False when it is gone or was replaced meanwhile."""
    try:
        client.CoordinationV1Api(api_client()).delete_namespaced_lease(
            name, namespace, body=client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid))
        )
    except ApiException as exc:
        if exc.status in (404, 409):  # gone, or another object by that name now
            return False
        raise
    return True


def label_replica(namespace: str, name: str, key: str, value: str) -> None:
    body = {"metadata": {"labels": {key: value}}}
    try:
        _objects().patch_namespaced_custom_object(GROUP, VERSION, namespace, "weightreplicas", name, body)
    except ApiException as exc:
        if exc.status != 404:
            raise


def label_node(node: str, key: str, value: str | None) -> None:
    """Set (None: remove) one label of a Node: the operator's only Node write (a warm-node label; the chart's
    admission policy refuses it any other change of a Node)."""
    try:
        client.CoreV1Api(api_client()).patch_node(node, {"metadata": {"labels": {key: value}}})
    except ApiException as exc:
        if exc.status != 404:
            raise


def add_finalizer_ops(uid: str, current: list[str], finalizer: str) -> list[dict]:
    """A JSON patch that tests the uid and the list, so neither another object of that name nor a finalizer added
    meanwhile by someone else is overwritten, and no resourceVersion (which a status patch moves) is tested."""
    if current:
        ops = [
            {"op": "test", "path": "/metadata/finalizers", "value": current},
            {"op": "add", "path": "/metadata/finalizers/-", "value": finalizer},
        ]
    else:  # a test of `null` passes on an absent member
        ops = [
            {"op": "test", "path": "/metadata/finalizers", "value": None},
            {"op": "add", "path": "/metadata/finalizers", "value": [finalizer]},
        ]
    return [{"op": "test", "path": "/metadata/uid", "value": uid}, *ops]


def remove_finalizer_ops(uid: str, current: list[str], finalizer: str) -> list[dict]:
    """A JSON patch removing `finalizer` from that very object, tested at the index it has in `current` (as read)."""
    at = f"/metadata/finalizers/{current.index(finalizer)}"
    return [
        {"op": "test", "path": "/metadata/uid", "value": uid},
        {"op": "test", "path": at, "value": finalizer},
        {"op": "remove", "path": at},
    ]
