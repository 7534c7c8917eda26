"""The operator's hot-path API calls, made on the event loop over one aiohttp session: the WeightVersion list and
watch (versionwatch.py), status and finalizer patches, and Events. At thousands of versions the blocking client
(kubeapi.py, called from threads) costs more CPU per request than the request itself: a thread hop, its model
serialisation and urllib3. The credentials are the blocking client's (`ferry.kube`), read per request so that a
rotated ServiceAccount token is picked up."""

from __future__ import annotations

import json
import ssl
from collections.abc import AsyncIterator, Mapping
from typing import Any

import aiohttp
from kubernetes.client.exceptions import ApiException

from ferry.api.models import GROUP, VERSION
from ferry_operator import kubeapi

JSON_PATCH = "application/json-patch+json"
MERGE_PATCH = "application/merge-patch+json"
REQUEST_TIMEOUT = aiohttp.ClientTimeout(total=60, sock_connect=10)
MAX_CONNECTIONS = 32  # requests in flight at once; a watch holds one


def custom_path(plural: str, namespace: str | None = None, name: str | None = None, sub: str | None = None) -> str:
    path = f"/apis/{GROUP}/{VERSION}"
    if namespace is not None:
        path += f"/namespaces/{namespace}"
    path += f"/{plural}"
    if name is not None:
        path += f"/{name}"
    if sub is not None:
        path += f"/{sub}"
    return path


class KubeAsync:
    """One connection pool to the apiserver; raises `ApiException` (with status and body) on an error answer, as
    the blocking client does, so callers handle both alike."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    def _config(self) -> Any:
        return kubeapi.api_client().configuration

    def _session_now(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            config = self._config()
            context: ssl.SSLContext | bool
            if config.host.startswith("https"):
                context = ssl.create_default_context(cafile=config.ssl_ca_cert)
                if config.cert_file:
                    context.load_cert_chain(config.cert_file, config.key_file)
                if not config.verify_ssl:
                    context.check_hostname = False
                    context.verify_mode = ssl.CERT_NONE
            else:
                context = False
            self._session = aiohttp.ClientSession(
                base_url=config.host,
                connector=aiohttp.TCPConnector(ssl=context, limit=MAX_CONNECTIONS),
                json_serialize=json.dumps,
            )
        return self._session

    def _headers(self, content_type: str | None = None) -> dict[str, str]:
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        for auth in self._config().auth_settings().values():  # a bearer token, refreshed by its hook
            if auth.get("in") == "header" and auth.get("value"):
                headers[auth["key"]] = auth["value"]
        return headers

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        content_type: str | None = None,
    ) -> dict[str, Any]:
        data = None if body is None else json.dumps(body)
        headers = self._headers(content_type or ("application/json" if body is not None else None))
        async with self._session_now().request(
            method, path, params=params, data=data, headers=headers, timeout=REQUEST_TIMEOUT
        ) as response:
            text = await response.text()
            if response.status >= 400:
                raise _error(response.status, response.reason, text)
            return json.loads(text) if text else {}

    async def stream(self, path: str, params: Mapping[str, str], timeout: float) -> AsyncIterator[dict[str, Any]]:
        """The events of a watch, one JSON object per line, until the server ends it."""
        async with self._session_now().get(
            path,
            params=params,
            headers=self._headers(),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=10, sock_read=timeout),
        ) as response:
            if response.status >= 400:
                raise _error(response.status, response.reason, await response.text())
            async for line in response.content:
                if line.strip():
                    yield json.loads(line)

    async def patch(self, path: str, body: Any, content_type: str = MERGE_PATCH) -> dict[str, Any]:
        return await self.request("PATCH", path, body=body, content_type=content_type)

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()


def _error(status: int, reason: str | None, text: str) -> ApiException:
    exc = ApiException(status=status, reason=reason)
    exc.body = text
    return exc


API = KubeAsync()


async def patch_status(plural: str, namespace: str, name: str, status: dict) -> dict | None:
    """Merge `status` into the object's status subresource; the object as written (None: it is gone)."""
    try:
        return await API.patch(custom_path(plural, namespace, name, "status"), {"status": status})
    except ApiException as exc:
        if exc.status != 404:
            raise
        return None


async def get_object(plural: str, namespace: str, name: str) -> dict | None:
    """The object as it is now (None: gone): what a reconcile woken in process starts from."""
    try:
        return await API.request("GET", custom_path(plural, namespace, name))
    except ApiException as exc:
        if exc.status != 404:
            raise
        return None


async def add_finalizer(plural: str, namespace: str, name: str, uid: str, current: list[str], finalizer: str) -> bool:
    """Append `finalizer` to that very object's finalizers as they were read (`current`: `add_finalizer_ops`).
    False: the object is gone, or the list changed since it was read (its watch event brings the new one)."""
    return await _json_patch(plural, namespace, name, kubeapi.add_finalizer_ops(uid, current, finalizer))


async def remove_finalizer(
    plural: str, namespace: str, name: str, uid: str, current: list[str], finalizer: str
) -> bool:
    """Remove `finalizer` from that very object (`remove_finalizer_ops`). False: the object is gone, or the list
    changed since it was read."""
    return await _json_patch(plural, namespace, name, kubeapi.remove_finalizer_ops(uid, current, finalizer))


async def _json_patch(plural: str, namespace: str, name: str, ops: list[dict]) -> bool:
    try:
        await API.patch(custom_path(plural, namespace, name), ops, JSON_PATCH)
    except ApiException as exc:
        if exc.status in (404, 409, 422):  # gone, or a test failed: the object is not as it was read
            return False
        raise
    return True


async def create_event(namespace: str, body: dict) -> None:
    await API.request("POST", f"/api/v1/namespaces/{namespace}/events", body=body)
