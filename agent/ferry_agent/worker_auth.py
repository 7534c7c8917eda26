"""Who may read weights from a worker service: authenticated agents, for versions their own node is assigned.

A reader sends the source on node N a token of its ServiceAccount, bound to its own Pod and with audience
`ferry.dev/worker/N` (`ReaderTokens`: a TokenRequest per source node), as `authorization: Bearer <token>` on every
call; a source that receives one cannot replay it to another. The server on node N

1. verifies the token with a TokenReview for that audience (cached by token hash: 60 s on success, 2 s on
   failure), and refuses anything not authenticated with `UNAUTHENTICATED`;
2. requires the reviewed user to be an allowed agent identity and to carry the node-name extra that pod-bound
   tokens have (`authentication.kubernetes.io/node-name`), else `PERMISSION_DENIED`;
3. for a manifest or a lease (both hand out NIXL metadata), requires a WeightReplica with `spec.nodeName` == the
   reader's node to be assigned the served namespace/model/version, else `PERMISSION_DENIED`; checked on every
   call against the API's WeightReplicas (a watched view, milliseconds behind; a direct read while the view is
   not in sync);
4. releases a lease only for the principal that holds it.

An API error while checking is `UNAVAILABLE` (transient: the reader retries, then tries another source), except
during an apiserver outage: a token accepted and a view in sync within the last `OUTAGE_GRACE_S` keep answering,
so agents keep serving each other what they hold while the API is down.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from kubernetes import client, watch

from ferry.api.models import GROUP, LABEL_NODE, VERSION, worker_audience

NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
SUCCESS_TTL_S = 60.0
FAILURE_TTL_S = 2.0
TOKEN_EXPIRATION_S = 600  # a reader's worker token: the shortest lifetime a TokenRequest allows
EXPIRY_MARGIN_S = 30.0  # a cached token this close to expiring is not sent any more
# How long an accepted review and a last-synced assignment view still answer while the API cannot be reached: the
# readers the API last allowed keep reading through an outage; nobody new gets in, and it ends when the API returns.
OUTAGE_GRACE_S = 600.0
PLURAL = "weightreplicas"
log = logging.getLogger(__name__)
_BEARER = "bearer "


class AccessDenied(Exception):
    """A refused call: `code` is the gRPC status the server answers with."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


# ---------------------------------------------------------------------------------------------- reader side


@dataclass(frozen=True)
class PodIdentity:
    """Who the reader is: its ServiceAccount and the Pod its tokens are bound to (the chart's downward-API env)."""

    namespace: str
    service_account: str
    pod_name: str
    pod_uid: str

    @property
    def username(self) -> str:
        return f"system:serviceaccount:{self.namespace}:{self.service_account}"


class TokenUnavailable(RuntimeError):
    """No worker token for a source: the TokenRequest failed and no unexpired one is cached."""


class ReaderTokens:
    """The reader's credentials, one per source node: a token of its own ServiceAccount bound to its own Pod (so it
    carries the reader's node) with audience `worker_audience(node)`, so the source it is sent to cannot replay it to
    another. Minted with a TokenRequest and reused until `renew_fraction` of its lifetime has passed; when renewing
    fails (the API is down), the cached token is still sent until `EXPIRY_MARGIN_S` before it expires."""

    def __init__(
        self,
        api: client.ApiClient,
        identity: PodIdentity,
        *,
        expiration_s: int = TOKEN_EXPIRATION_S,
        renew_fraction: float = 0.5,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._core = client.CoreV1Api(api)
        self.identity = identity
        self._expiration_s = expiration_s
        self._renew_fraction = renew_fraction
        self._clock = clock
        self._lock = threading.Lock()
        self._tokens: dict[str, tuple[str, float, float]] = {}  # audience -> (token, renew at, expires at)

    def __call__(self, node: str) -> str:
        """The token for the worker services of `node` (raises `TokenUnavailable`)."""
        try:
            audience = worker_audience(node)
        except ValueError as exc:
            raise TokenUnavailable(str(exc)) from exc
        now = self._clock()
        with self._lock:
            cached = self._tokens.get(audience)
        if cached is not None and now < cached[1]:
            return cached[0]
        try:
            token, expires_at = self._mint(audience)
        except Exception as exc:
            if cached is not None and now < cached[2] - EXPIRY_MARGIN_S:
                log.warning("renewing the worker token for %s failed (%s); the current one is still valid", node, exc)
                return cached[0]
            raise TokenUnavailable(f"cannot get a worker token for {audience}: {_api_error(exc)}") from exc
        renew_at = now + (expires_at - now) * self._renew_fraction
        with self._lock:
            self._tokens[audience] = (token, renew_at, expires_at)
        return token

    def _mint(self, audience: str) -> tuple[str, float]:
        me = self.identity
        ref = client.V1BoundObjectReference(api_version="v1", kind="Pod", name=me.pod_name, uid=me.pod_uid)
        spec = client.V1TokenRequestSpec(
            audiences=[audience], bound_object_ref=ref, expiration_seconds=self._expiration_s
        )
        status = self._core.create_namespaced_service_account_token(
            me.service_account, me.namespace, client.AuthenticationV1TokenRequest(spec=spec)
        ).status
        if not status or not status.token or status.expiration_timestamp is None:
            raise RuntimeError("the TokenRequest returned no token")
        return status.token, status.expiration_timestamp.timestamp()


def _api_error(exc: Exception) -> str:
    if isinstance(exc, client.ApiException):
        return f"{exc.status} {exc.reason}: {(exc.body or '')[:300]}"
    return f"{type(exc).__name__}: {exc}"


def bearer_metadata(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


# ---------------------------------------------------------------------------------------------- server side


@dataclass(frozen=True)
class Review:
    """What a TokenReview said about a token."""

    authenticated: bool
    username: str = ""
    extra: Mapping[str, Sequence[str]] | None = None
    error: str = ""


class Reviewer(Protocol):
    def review(self, token: str) -> Review:
        """Raises on API errors (not cached, answered UNAVAILABLE)."""


class TokenReviewer:
    """A TokenReview against the Kubernetes API for one audience: the worker audience of the source's node."""

    def __init__(self, api: client.ApiClient, audience: str) -> None:
        self._auth = client.AuthenticationV1Api(api)
        self._audience = audience

    def review(self, token: str) -> Review:
        body = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token, audiences=[self._audience]))
        status = self._auth.create_token_review(body).status
        if not status or not status.authenticated:
            return Review(False, error=(status.error if status else "") or "token not authenticated")
        if self._audience not in (status.audiences or []):
            return Review(False, error=f"token is not for audience {self._audience}")
        user = status.user
        return Review(True, username=user.username or "", extra=user.extra or {})


class CachedReviewer:
    """Reviews keyed by the token's sha256: a success for `ok_ttl_s`, a refusal for `fail_ttl_s`. While the API
    cannot be reached, a success is still answered for `outage_grace_s` after it was last confirmed."""

    def __init__(
        self,
        reviewer: Reviewer,
        *,
        ok_ttl_s: float = SUCCESS_TTL_S,
        fail_ttl_s: float = FAILURE_TTL_S,
        outage_grace_s: float = OUTAGE_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._reviewer = reviewer
        self._ok_ttl_s = ok_ttl_s
        self._fail_ttl_s = fail_ttl_s
        self._outage_grace_s = outage_grace_s
        self._clock = clock
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, Review]] = {}  # key -> (reviewed at, review)

    def review(self, token: str) -> Review:
        key = hashlib.sha256(token.encode()).hexdigest()
        now = self._clock()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None and now - hit[0] < self._ttl(hit[1]):
                return hit[1]
            for old in [k for k, (at, r) in self._cache.items() if now - at >= max(self._ttl(r), self._grace(r))]:
                del self._cache[old]
        try:
            result = self._reviewer.review(token)  # outside the lock: one slow review must not stall every reader
        except Exception:
            if hit is not None and hit[1].authenticated and now - hit[0] < self._outage_grace_s:
                return hit[1]
            raise
        with self._lock:
            self._cache[key] = (self._clock(), result)
        return result

    def _ttl(self, review: Review) -> float:
        return self._ok_ttl_s if review.authenticated else self._fail_ttl_s

    def _grace(self, review: Review) -> float:
        return self._outage_grace_s if review.authenticated else 0.0


@dataclass(frozen=True)
class Principal:
    """An authenticated agent on one node."""

    username: str
    node: str

    @property
    def key(self) -> str:
        return f"{self.username}@{self.node}"


@dataclass(frozen=True)
class ServedVersion:
    """What one worker service serves; a reader's node must have a WeightReplica assigned exactly this."""

    namespace: str
    model: str
    version: str


class Assignments(Protocol):
    def assigned(self, node: str, served: ServedVersion) -> bool:
        """Raises on API errors."""


class ApiAssignments:
    """WeightReplicas read from the API for one grant (from the apiserver's watch cache: resourceVersion 0)."""

    def __init__(self, api: client.ApiClient) -> None:
        self._objects = client.CustomObjectsApi(api)

    def assigned(self, node: str, served: ServedVersion) -> bool:
        # The label narrows the list; the spec decides (labels are not what the operator schedules by).
        items = self._objects.list_namespaced_custom_object(
            GROUP, VERSION, served.namespace, PLURAL, label_selector=f"{LABEL_NODE}={node}", resource_version="0"
        )["items"]
        return any(_assigns(wr, node, served) for wr in items)


class WatchedAssignments:
    """The WeightReplicas of each served namespace, kept current by a list + watch (milliseconds behind the API), so
    a grant costs no API round trip (one would be ~1 ms, a few % of a 256 MiB transfer). While a namespace's watch is
    not in sync (its first moments, after any error) every grant reads the API instead (`ApiAssignments`); when that
    read fails too, the last view answers for `outage_grace_s` after it fell out of sync. A watch that delivers
    nothing is cut after `WATCH_READ_TIMEOUT_S` and relisted, which bounds how stale a silently partitioned view can
    be."""

    def __init__(
        self,
        api: client.ApiClient,
        direct: Assignments | None = None,
        *,
        outage_grace_s: float = OUTAGE_GRACE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._objects = client.CustomObjectsApi(api)
        self._direct = direct or ApiAssignments(api)
        self._outage_grace_s = outage_grace_s
        self._clock = clock
        self._lock = threading.Lock()
        self._views: dict[str, _NamespaceView] = {}

    def assigned(self, node: str, served: ServedVersion) -> bool:
        with self._lock:
            view = self._views.get(served.namespace)
            if view is None:
                view = self._views[served.namespace] = _NamespaceView(self._objects, served.namespace, self._clock)
        replicas, lost_at = view.snapshot()
        if lost_at is not None:
            try:
                return self._direct.assigned(node, served)
            except Exception:
                if replicas is None or self._clock() - lost_at >= self._outage_grace_s:
                    raise
        return any(_assigns(wr, node, served) for wr in replicas or ())


WATCH_SECONDS = 60  # the server ends each watch after this; the view then relists
WATCH_READ_TIMEOUT_S = 90.0


class _NamespaceView:
    def __init__(self, objects: client.CustomObjectsApi, namespace: str, clock: Callable[[], float]) -> None:
        self._objects = objects
        self._namespace = namespace
        self._clock = clock
        self._lock = threading.Lock()
        self._items: dict[str, Mapping[str, Any]] | None = None  # the last view; None before the first list
        self._lost_at: float | None = clock()  # when the view fell out of sync; None while in sync
        threading.Thread(target=self._run, name=f"ferry-assignments-{namespace}", daemon=True).start()

    def snapshot(self) -> tuple[list[Mapping[str, Any]] | None, float | None]:
        """The last view and when it fell out of sync (None while it is in sync)."""
        with self._lock:
            return (None if self._items is None else list(self._items.values())), self._lost_at

    def _run(self) -> None:
        while True:
            try:
                self._list_and_watch()
            except Exception as exc:  # out of sync until the next list succeeds: grants read the API meanwhile
                with self._lock:
                    if self._lost_at is None:
                        self._lost_at = self._clock()
                log.info("watch of WeightReplicas in %s ended: %s", self._namespace, type(exc).__name__)
                time.sleep(1.0)

    def _list_and_watch(self) -> None:
        listed = self._objects.list_namespaced_custom_object(GROUP, VERSION, self._namespace, PLURAL)
        with self._lock:
            self._items = {wr["metadata"]["name"]: wr for wr in listed["items"]}
            self._lost_at = None
        for event in watch.Watch().stream(
            self._objects.list_namespaced_custom_object, GROUP, VERSION, self._namespace, PLURAL,
            resource_version=listed["metadata"]["resourceVersion"], timeout_seconds=WATCH_SECONDS,
            _request_timeout=WATCH_READ_TIMEOUT_S,
        ):  # fmt: skip
            obj = event["object"]
            if event["type"] == "ERROR" or not isinstance(obj, Mapping) or "metadata" not in obj:
                raise RuntimeError(f"watch error: {obj}")  # e.g. 410 Gone: relist
            with self._lock:
                if event["type"] == "DELETED":
                    self._items.pop(obj["metadata"]["name"], None)
                else:
                    self._items[obj["metadata"]["name"]] = obj


def _assigns(wr: Mapping[str, Any], node: str, served: ServedVersion) -> bool:
    spec = wr.get("spec") or {}
    return (
        not (wr.get("metadata") or {}).get("deletionTimestamp")
        and spec.get("nodeName") == node
        and spec.get("version") == served.version
        and spec.get("modelName") == served.model
    )


def _bearer(metadata: Iterable[tuple[str, str | bytes]] | None) -> str | None:
    for key, value in metadata or ():
        if key.lower() == "authorization" and isinstance(value, str) and value.lower().startswith(_BEARER):
            return value[len(_BEARER) :].strip() or None
    return None


class WorkerAuth:
    """Authentication and authorization shared by every worker service of one agent process."""

    def __init__(self, reviewer: Reviewer, assignments: Assignments, allowed_identities: Iterable[str]) -> None:
        self._reviewer = reviewer
        self._assignments = assignments
        self.allowed_identities = frozenset(allowed_identities)
        if not self.allowed_identities:
            raise ValueError("at least one allowed worker identity is required")

    @classmethod
    def from_api(cls, api: client.ApiClient, allowed_identities: Iterable[str], node: str) -> WorkerAuth:
        """The checks of the worker services on `node`: they accept only tokens for `worker_audience(node)`."""
        return cls(
            CachedReviewer(TokenReviewer(api, worker_audience(node))), WatchedAssignments(api), allowed_identities
        )

    def authenticate(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Principal:
        token = _bearer(metadata)
        if token is None:
            raise AccessDenied(grpc.StatusCode.UNAUTHENTICATED, "a bearer token (a worker token) is required")
        try:
            result = self._reviewer.review(token)
        except Exception as exc:
            raise AccessDenied(grpc.StatusCode.UNAVAILABLE, f"cannot review the token: {type(exc).__name__}") from exc
        if not result.authenticated:
            raise AccessDenied(grpc.StatusCode.UNAUTHENTICATED, f"token rejected: {result.error}")
        if result.username not in self.allowed_identities:
            raise AccessDenied(grpc.StatusCode.PERMISSION_DENIED, f"{result.username} is not a Ferry agent identity")
        nodes = list((result.extra or {}).get(NODE_NAME_EXTRA) or [])
        if len(nodes) != 1 or not nodes[0]:
            raise AccessDenied(
                grpc.StatusCode.PERMISSION_DENIED, "the token is not bound to a pod on a node (no node-name extra)"
            )
        return Principal(result.username, nodes[0])

    def authorize_read(self, principal: Principal, served: ServedVersion) -> None:
        try:
            ok = self._assignments.assigned(principal.node, served)
        except Exception as exc:
            raise AccessDenied(
                grpc.StatusCode.UNAVAILABLE, f"cannot check replica assignments: {type(exc).__name__}"
            ) from exc
        if not ok:
            raise AccessDenied(
                grpc.StatusCode.PERMISSION_DENIED,
                f"no WeightReplica on node {principal.node} is assigned {served.namespace}/{served.version}",
            )

    def guard(self, served: ServedVersion) -> ReadGuard:
        return ReadGuard(self, served)


class ReadGuard:
    """The checks of one worker service: it serves `served` and nothing else."""

    def __init__(self, auth: WorkerAuth, served: ServedVersion) -> None:
        self._auth = auth
        self.served = served

    def admit_read(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Principal:
        """For a manifest or a lease: an allowed agent whose node is assigned the served version."""
        principal = self._auth.authenticate(metadata)
        self._auth.authorize_read(principal, self.served)
        return principal

    def admit_release(self, metadata: Iterable[tuple[str, str | bytes]] | None) -> Principal:
        """For a release: an allowed agent; the service then checks it holds the lease."""
        return self._auth.authenticate(metadata)


# ---------------------------------------------------------------------------------------------- processes


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The worker-auth flags of the agent and of its rank processes: who the reader is (the chart sets the env from
    the downward API) and whom the server admits."""
    for flag, env, what in (
        ("--pod-namespace", "POD_NAMESPACE", "the namespace of this agent's Pod and ServiceAccount"),
        ("--service-account", "SERVICE_ACCOUNT", "this agent's ServiceAccount"),
        ("--pod-name", "POD_NAME", "this agent's Pod, which its worker tokens are bound to"),
        ("--pod-uid", "POD_UID", "that Pod's uid"),
    ):
        parser.add_argument(flag, default=os.environ.get(env) or None, help=f"{what} (env {env})")
    parser.add_argument(
        "--worker-allowed-identity",
        action="append",
        default=[],
        metavar="USERNAME",
        help="a user (as TokenReview reports it) whose pod-bound tokens may read from this agent; repeatable "
        "(default: this agent's own ServiceAccount)",
    )


def from_arguments(args: argparse.Namespace, api: client.ApiClient, node: str) -> tuple[ReaderTokens, WorkerAuth]:
    """The reader's credentials and the checks of the worker services on `node`; `ValueError` names what is
    missing."""
    missing = [f"--{n.replace('_', '-')}" for n in ("pod_namespace", "service_account", "pod_name", "pod_uid")
               if not getattr(args, n)]  # fmt: skip
    if missing:
        raise ValueError(
            f"{', '.join(missing)} missing: worker tokens are minted for this agent's ServiceAccount, bound to its "
            "Pod (the chart sets POD_NAMESPACE, SERVICE_ACCOUNT, POD_NAME and POD_UID)"
        )
    identity = PodIdentity(args.pod_namespace, args.service_account, args.pod_name, args.pod_uid)
    auth = WorkerAuth.from_api(api, args.worker_allowed_identity or [identity.username], node)
    return ReaderTokens(api, identity), auth
