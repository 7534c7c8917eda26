"""The WeightVersion of a publish: built and validated by the API models, applied (immutably), and waited on."""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from typing import Any

from pydantic import ValidationError

from ferry import s3
from ferry.api.conditions import get_condition
from ferry.api.models import (
    API_VERSION,
    GROUP,
    VERSION,
    VERSION_FAILED_UNTIL_MENDED,
    ConditionStatus,
    StorageReason,
    WeightFormat,
    WeightVersion,
    WeightVersionConditionType,
    WeightVersionPhase,
)
from ferry.errors import InvalidInput
from ferry.publish.errors import ImmutableConflict, InvalidPublish, PublishError, PublishNotFound, PublishUnavailable

log = logging.getLogger("ferry.publish")


@contextlib.contextmanager
def kube_errors(what: str) -> Iterator[None]:
    """Kubernetes client failures as PublishError naming the step."""
    from kubernetes.client.exceptions import ApiException
    from kubernetes.config import ConfigException
    from urllib3.exceptions import HTTPError

    try:
        yield
    except ApiException as exc:
        detail = exc.reason
        with contextlib.suppress(Exception):
            detail = json.loads(exc.body)["message"]
        message = f"{what}: the Kubernetes API answered {exc.status}: {detail}"
        status = exc.status or 0
        if status == 404:
            raise PublishNotFound(message) from exc
        if status == 409:
            raise ImmutableConflict(message) from exc
        if 400 <= status < 500 and status != 429:  # invalid, unauthorized, forbidden: the same request fails again
            raise InvalidPublish(message) from exc
        raise PublishUnavailable(message) from exc
    except ConfigException as exc:
        raise InvalidPublish(f"{what}: {exc}") from exc
    except (HTTPError, OSError) as exc:
        raise PublishUnavailable(f"{what}: {exc}") from exc


def _custom(api: Any) -> Any:
    from kubernetes import client

    return client.CustomObjectsApi(api)


def read_weight_version(api: Any, namespace: str, name: str) -> dict[str, Any] | None:
    from kubernetes.client.exceptions import ApiException

    try:
        return _custom(api).get_namespaced_custom_object(GROUP, VERSION, namespace, "weightversions", name)
    except ApiException as exc:
        if exc.status == 404:
            return None
        raise


def weight_version_body(
    *,
    name: str,
    model: str,
    base_version: str | None,
    uri: str,
    endpoint: str | None = None,
    region: str | None = None,
    credentials_secret: str | None = None,
    layout_signature: str | None = None,
) -> dict[str, Any]:
    """The WeightVersion manifest, validated by the pydantic API models before anything is uploaded."""
    storage = {"uri": uri, "endpoint": endpoint, "region": region, "credentialsSecret": credentials_secret}
    spec = {
        "modelName": model,
        "format": WeightFormat.XOR_DELTA if base_version else WeightFormat.FULL_CHECKPOINT,
        "baseVersion": base_version,
        "storage": {k: v for k, v in storage.items() if v},
        "layoutSignature": layout_signature,
    }
    try:
        model_obj = WeightVersion.model_validate({"spec": spec})
    except ValidationError as exc:
        details = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise InvalidPublish(f"invalid WeightVersion: {details}") from exc
    return {
        "apiVersion": API_VERSION,
        "kind": WeightVersion.kind,
        "metadata": {"name": name},
        "spec": model_obj.spec.model_dump(mode="json", exclude_none=True),
    }


def check_credentials_secret(api: Any, namespace: str, name: str) -> None:
    """The operator and the agents read the version with this Secret's keys: a missing Secret or key fails the
    publish before anything is uploaded. A publisher that may not read Secrets cannot check (the WeightVersion's
    StorageVerified condition will say)."""
    from kubernetes import client
    from kubernetes.client.exceptions import ApiException

    what = f"Secret {namespace}/{name} (--credentials-secret)"
    try:
        secret = client.CoreV1Api(api).read_namespaced_secret(name, namespace)
    except ApiException as exc:
        if exc.status == 404:
            raise InvalidPublish(f"{what} does not exist: readers could not verify or load the version") from exc
        if exc.status == 403:
            log.warning("%s not checked: this identity may not read Secrets in %s", what, namespace)
            return
        raise
    try:
        s3.credentials_from_secret_data(secret.data)
    except InvalidInput as exc:
        raise InvalidPublish(f"{what}: {exc}") from exc


def apply_weight_version(api: Any, namespace: str, body: dict[str, Any]) -> bool:
    """Create it; True if created, False if an identical one exists. A different spec is an ImmutableConflict."""
    from kubernetes.client.exceptions import ApiException

    name = body["metadata"]["name"]
    try:
        _custom(api).create_namespaced_custom_object(GROUP, VERSION, namespace, "weightversions", body)
        return True
    except ApiException as exc:
        if exc.status != 409:
            raise
    check_existing(read_weight_version(api, namespace, name), body, namespace)
    return False


def check_existing(existing: dict[str, Any] | None, body: dict[str, Any], namespace: str) -> None:
    if existing is not None and existing.get("spec") != body["spec"]:
        raise ImmutableConflict(
            f"WeightVersion {namespace}/{body['metadata']['name']} already exists with spec "
            f"{json.dumps(existing.get('spec'), sort_keys=True)}, not {json.dumps(body['spec'], sort_keys=True)}; "
            "WeightVersions are immutable: publish under a new version name"
        )


def wait_ready(
    api: Any, namespace: str, name: str, timeout: float, poll: float = 1.0, *, created: bool = False
) -> None:
    """Until the operator marks it Ready. A Failed phase ends the wait at once (one that is mended in place only for
    a WeightVersion this publish `created`: an older object's status may predate the upload), and so does a
    missing object of a created one (it was uploaded before the apply); `timeout` running out is
    PublishUnavailable."""
    deadline = time.monotonic() + timeout
    last = "no status yet"
    while True:
        obj = read_weight_version(api, namespace, name) or {}
        status = obj.get("status") or {}
        ready = get_condition(status.get("conditions"), WeightVersionConditionType.READY)
        if status.get("phase") == WeightVersionPhase.READY or (ready and ready.get("status") == ConditionStatus.TRUE):
            return
        if ready:
            last = f"{status.get('phase')}: {ready.get('reason')}: {ready.get('message')}"
        reason = (ready or {}).get("reason")
        failed = status.get("phase") == WeightVersionPhase.FAILED
        if failed and (created or reason not in VERSION_FAILED_UNTIL_MENDED):
            raise PublishError(f"WeightVersion {namespace}/{name} failed ({last})")
        if created and reason == StorageReason.ObjectMissing:
            raise PublishError(f"WeightVersion {namespace}/{name} names objects that are not there ({last})")
        if time.monotonic() >= deadline:
            raise PublishUnavailable(f"WeightVersion {namespace}/{name} is not Ready after {timeout:.0f}s ({last})")
        time.sleep(poll)
