"""The few direct API calls the operator makes besides kopf's own patches (blocking: call via a thread)."""

from __future__ import annotations

import functools

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from ferry.api.models import GROUP, VERSION


class NotFound(LookupError):
    pass


@functools.cache
def _api() -> client.ApiClient:
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    return client.ApiClient()


def read_secret_data(namespace: str, name: str) -> dict[str, str]:
    """The Secret's `.data`, still base64-encoded as the API returns it."""
    try:
        secret = client.CoreV1Api(_api()).read_namespaced_secret(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            raise NotFound(f"Secret {namespace}/{name} not found") from exc
        raise
    return dict(secret.data or {})


def nudge(namespace: str, name: str, annotation: str, value: str) -> None:
    """Touch an annotation so kopf re-reconciles the object now instead of at the next resync."""
    body = {"metadata": {"annotations": {annotation: value}}}
    try:
        client.CustomObjectsApi(_api()).patch_namespaced_custom_object(
            GROUP, VERSION, namespace, "weightversions", name, body
        )
    except ApiException as exc:
        if exc.status != 404:
            raise
