"""Who may read weights from a worker service: authenticated agents, for versions their own node is assigned.

A reader sends the source on node N a token of its ServiceAccount, bound to its own Pod and with audience
`ferry.dev/worker/N` (`ReaderTokens`: a TokenRequest per source node), as `authorization: Bearer <token>` on every
call; a source that receives one cannot replay it to another. The server on node N

1. checks the token locally (a JWT, not expired or not yet valid, for the reviewed audience: only so that garbage
   costs no API call), then verifies it with a TokenReview for that audience (cached by token hash: 60 s on success,
   2 s on failure, never past the token's `exp`, at most `MAX_CACHED_REVIEWS` of each), and refuses anything not
   authenticated with `UNAUTHENTICATED`;
2. requires the reviewed user to be an allowed agent identity and to carry the node-name extra that pod-bound
   tokens have (`authentication.kubernetes.io/node-name`), else `PERMISSION_DENIED`;
3. for a manifest or a lease (both hand out NIXL metadata), requires a WeightReplica with `spec.nodeName` == the
   reader's node to be assigned the served namespace/model/version, else `PERMISSION_DENIED`; checked on every
   call against the API's WeightReplicas (a watched view, milliseconds behind; a direct read while the view is
   not in sync);
4. releases a lease only for the principal that holds it.

An API error while checking is `UNAVAILABLE` (transient: the reader retries, then tries another source), except
during an apiserver outage: a token accepted and a view in sync within the last `OUTAGE_GRACE_S` keep answering
(the token only until its `exp`), so agents keep serving each other what they hold while the API is down.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import logging
import math
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
from kubernetes import client, watch

from ferry.api.models import GROUP, LABEL_MODEL, LABEL_NODE, VERSION, label_value, worker_audience

NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
SUCCESS_TTL_S = 60.0
FAILURE_TTL_S = 2.0
TOKEN_EXPIRATION_S = 600  # a reader's worker token: the shortest lifetime a TokenRequest allows
EXPIRY_MARGIN_S = 30.0  # a cached token this close to expiring is not sent any more
# How long an accepted review and a last-synced assignment view still answer while the API cannot be reached: the
# readers the API last allowed keep reading through an outage; nobody new gets in, and it ends when the API returns.
OUTAGE_GRACE_S = 600.0
# A model's WeightReplica view (per namespace) stops watching once no grant asked it for this long (WatchedAssignments).
VIEW_IDLE_S = 10.0
# Skew allowed between this node's clock and the apiserver's for a token's `exp` and `nbf` before a token is refused
# without a review (the apiserver allows itself a minute); the cache never answers past `exp` itself.
CLOCK_LEEWAY_S = 30.0
# Reviews kept per outcome (accepted, refused): a flood of tokens cannot grow memory, and a flood of refused ones
# cannot push out the readers accepted before an outage.
MAX_CACHED_REVIEWS = 4096
_SWEEP_S = 1.0  # how often the cache drops its expired entries (a pass over at most 2 * MAX_CACHED_REVIEWS)
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
    @property
    def audience(self) -> str:
        """The audience tokens are reviewed for."""

    def review(self, token: str) -> Review:
        """Raises on API errors (not cached, answered UNAVAILABLE)."""


class TokenReviewer:
    """A TokenReview against the Kubernetes API for one audience: the worker audience of the source's node."""

    def __init__(self, api: client.ApiClient, audience: str) -> None:
        self._auth = client.AuthenticationV1Api(api)
        self._audience = audience

    @property
    def audience(self) -> str:
        return self._audience

    def review(self, token: str) -> Review:
        body = client.V1TokenReview(spec=client.V1TokenReviewSpec(token=token, audiences=[self._audience]))
        status = self._auth.create_token_review(body).status
        if not status or not status.authenticated:
            return Review(False, error=(status.error if status else "") or "token not authenticated")
        if self._audience not in (status.audiences or []):
            return Review(False, error=f"token is not for audience {self._audience}")
        user = status.user
        return Review(True, username=user.username or "", extra=user.extra or {})


class TokenRejected(ValueError):
    """A token refused by the local checks, before any TokenReview."""


_B64URL = re.compile(r"[A-Za-z0-9_-]+")


def _b64url_json(part: str) -> Any:
    if not _B64URL.fullmatch(part):
        raise ValueError("not base64url")
    return json.loads(base64.urlsafe_b64decode(part + "=" * (-len(part) % 4)))


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def precheck_token(token: str, audience: str, now: float, leeway_s: float = CLOCK_LEEWAY_S) -> float:
    """The token's `exp` if it can be a live token for `audience` at wall-clock time `now`, else `TokenRejected`
    saying why. Unverified (no signature check: TokenReview decides), it only spares the API a review of a token that
    is not a JWT, has expired or is not valid yet, or is for another audience."""
    parts = token.split(".")
    if len(parts) != 3 or not parts[2] or not _B64URL.fullmatch(parts[2]):
        raise TokenRejected("not a JWT (three base64url parts)")
    try:
        header, claims = _b64url_json(parts[0]), _b64url_json(parts[1])
    except (ValueError, binascii.Error) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
        raise TokenRejected("not a JWT (header and payload must be base64url JSON)") from exc
    if not isinstance(header, dict) or not isinstance(claims, dict):
        raise TokenRejected("not a JWT (header and payload must be JSON objects)")
    exp, nbf = claims.get("exp"), claims.get("nbf")
    if not _finite(exp):
        raise TokenRejected("the token has no valid `exp` claim (pod-bound tokens always expire)")
    if now >= exp + leeway_s:
        raise TokenRejected(f"the token expired {now - exp:.0f}s ago")
    if nbf is not None and not _finite(nbf):
        raise TokenRejected("the token has an invalid `nbf` claim")
    if nbf is not None and now + leeway_s < nbf:
        raise TokenRejected(f"the token is not valid for another {nbf - now:.0f}s (`nbf`)")
    aud = claims.get("aud")
    if audience not in ([aud] if isinstance(aud, str) else aud if isinstance(aud, list) else []):
        raise TokenRejected(f"the token is not for audience {audience}")
    return float(exp)


@dataclass(frozen=True)
class _Cached:
    at: float  # when the API said so (monotonic)
    exp: float  # the token's `exp` (wall clock)
    review: Review


class CachedReviewer:
    """Tokens checked locally first (`precheck_token`, for the reviewer's audience: a refusal costs no API call and
    takes no cache entry), then reviews keyed by the token's sha256: a success for `ok_ttl_s`, a refusal for
    `fail_ttl_s`. While the API cannot be reached, a success is still answered for `outage_grace_s` after it was last
    confirmed. Nothing is answered from the cache once the token's `exp` has passed. Successes and refusals are each
    kept for at most `max_entries` tokens (the least recently used success, the oldest refusal dropped first)."""

    def __init__(
        self,
        reviewer: Reviewer,
        *,
        ok_ttl_s: float = SUCCESS_TTL_S,
        fail_ttl_s: float = FAILURE_TTL_S,
        outage_grace_s: float = OUTAGE_GRACE_S,
        max_entries: int = MAX_CACHED_REVIEWS,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be positive, got {max_entries}")
        self._reviewer = reviewer
        self._ok_ttl_s = ok_ttl_s
        self._fail_ttl_s = fail_ttl_s
        self._outage_grace_s = outage_grace_s
        self._max_entries = max_entries
        self._clock = clock
        self._wall_clock = wall_clock
        self._lock = threading.Lock()
        self._accepted: OrderedDict[str, _Cached] = OrderedDict()  # least recently used first
        self._refused: OrderedDict[str, _Cached] = OrderedDict()  # oldest first
        self._next_sweep = clock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._accepted) + len(self._refused)

    def review(self, token: str) -> Review:
        try:
            exp = precheck_token(token, self._reviewer.audience, self._wall_clock())
        except TokenRejected as exc:
            return Review(False, error=str(exc))
        key = hashlib.sha256(token.encode()).hexdigest()
        now = self._clock()
        with self._lock:
            self._sweep(now)
            refused = self._refused.get(key)
            if refused is not None and now - refused.at < self._fail_ttl_s:
                return refused.review
            accepted = self._accepted.get(key)
            if accepted is not None:
                self._accepted.move_to_end(key)
                if now - accepted.at < self._ok_ttl_s and self._wall_clock() < exp:
                    return accepted.review
        try:
            result = self._reviewer.review(token)  # outside the lock: one slow review must not stall every reader
        except Exception:
            if accepted is not None and now - accepted.at < self._outage_grace_s and self._wall_clock() < exp:
                return accepted.review
            raise
        entry = _Cached(self._clock(), exp, result)
        with self._lock:
            # A refusal also ends the outage grace of an earlier success (the token was revoked).
            self._accepted.pop(key, None)
            self._refused.pop(key, None)
            kept = self._accepted if result.authenticated else self._refused
            kept[key] = entry
            if len(kept) > self._max_entries:
                kept.popitem(last=False)
        return result

    def _sweep(self, now: float) -> None:
        """Drop what can no longer answer: past its TTL (a success: past the outage grace too) or its `exp`."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + _SWEEP_S
        wall = self._wall_clock()
        for kept, life in (
            (self._accepted, max(self._ok_ttl_s, self._outage_grace_s)),
            (self._refused, self._fail_ttl_s),
        ):
            for key in [k for k, e in kept.items() if now - e.at >= life or wall >= e.exp]:
                del kept[key]


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
    """The WeightReplicas of each served model in its namespace, kept current by a list + watch (milliseconds behind
    the API), so a grant costs no API round trip (one would be ~1 ms, a few % of a 256 MiB transfer). While a view is
    not in sync (its first moments, after any error) every grant reads the API instead (`ApiAssignments`); when that
    read fails too, the last view answers for `outage_grace_s` after it fell out of sync. A watch that delivers
    nothing is cut after `WATCH_READ_TIMEOUT_S` and relisted, which bounds how stale a silently partitioned view can
    be. A view no grant has asked for `idle_s` stops watching (the next grant starts another): every WeightReplica
    write is an event to every agent watching its model, N² of them for N replicas, while a source serves
    readers in bursts (a fan-out), and a delta rollout from object storage grants nothing."""

    def __init__(
        self,
        api: client.ApiClient,
        direct: Assignments | None = None,
        *,
        outage_grace_s: float = OUTAGE_GRACE_S,
        idle_s: float = VIEW_IDLE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._objects = client.CustomObjectsApi(api)
        self._direct = direct or ApiAssignments(api)
        self._outage_grace_s = outage_grace_s
        self._idle_s = idle_s
        self._clock = clock
        self._lock = threading.Lock()
        self._views: dict[tuple[str, str], _NamespaceView] = {}  # by (namespace, model)

    def assigned(self, node: str, served: ServedVersion) -> bool:
        with self._lock:
            key = (served.namespace, served.model)
            view = self._views.get(key)
            if view is None or view.closed:
                view = _NamespaceView(self._objects, *key, self._clock, self._idle_s)
                self._views[key] = view
            view.used_at = self._clock()
        replicas, lost_at = view.snapshot()
        if lost_at is not None:
            try:
                return self._direct.assigned(node, served)
            except Exception:
                if replicas is None or self._clock() - lost_at >= self._outage_grace_s:
                    raise
        return any(_assigns(wr, node, served) for wr in replicas or ())


WATCH_SECONDS = 60  # the server ends each watch after this; the view then relists (or stops, when idle)
WATCH_READ_TIMEOUT_S = 90.0


class _NamespaceView:
    """The WeightReplicas of one model in one namespace (by the model label the operator puts on each: a replica
    of another model is never an assignment of this one, and its writes are no events here)."""

    def __init__(
        self, objects: client.CustomObjectsApi, namespace: str, model: str, clock: Callable[[], float], idle_s: float
    ) -> None:
        self._objects = objects
        self._namespace = namespace
        self._selector = f"{LABEL_MODEL}={label_value(model)}"
        self._clock = clock
        self._idle_s = idle_s
        self._lock = threading.Lock()
        self._items: dict[str, Mapping[str, Any]] | None = None  # the last view; None before the first list
        self._lost_at: float | None = clock()  # when the view fell out of sync; None while in sync
        self.used_at = clock()  # the last grant that asked it
        self.closed = False  # it stopped watching: out of sync for good
        threading.Thread(target=self._run, name=f"ferry-assignments-{namespace}", daemon=True).start()

    def snapshot(self) -> tuple[list[Mapping[str, Any]] | None, float | None]:
        """The last view and when it fell out of sync (None while it is in sync)."""
        with self._lock:
            return (None if self._items is None else list(self._items.values())), self._lost_at

    def _in_sync(self) -> bool:
        with self._lock:
            return self._lost_at is None

    def _idle(self) -> bool:
        return self._clock() - self.used_at >= self._idle_s

    def _run(self) -> None:
        # An idle view stops only in sync: one out of sync (the API down) keeps trying, and its last view keeps
        # answering within the outage grace, however far apart the grants come.
        while not (self._idle() and self._in_sync()):
            try:
                self._list_and_watch()
            except Exception as exc:  # out of sync until the next list succeeds: grants read the API meanwhile
                with self._lock:
                    if self._lost_at is None:
                        self._lost_at = self._clock()
                log.info("watch of WeightReplicas in %s ended: %s", self._namespace, type(exc).__name__)
                time.sleep(1.0)
        with self._lock:
            self.closed = True
            if self._lost_at is None:
                self._lost_at = self._clock()
        log.debug("watch of WeightReplicas in %s stopped: no grant for %.0fs", self._namespace, self._idle_s)

    def _list_and_watch(self) -> None:
        listed = self._objects.list_namespaced_custom_object(
            GROUP, VERSION, self._namespace, PLURAL, label_selector=self._selector
        )
        with self._lock:
            self._items = {wr["metadata"]["name"]: wr for wr in listed["items"]}
            self._lost_at = None
        stream = watch.Watch()
        for event in stream.stream(
            self._objects.list_namespaced_custom_object,
            GROUP,
            VERSION,
            self._namespace,
            PLURAL,
            label_selector=self._selector,
            resource_version=listed["metadata"]["resourceVersion"],
            timeout_seconds=WATCH_SECONDS,
            _request_timeout=WATCH_READ_TIMEOUT_S,
        ):
            obj = event["object"]
            if event["type"] == "ERROR" or not isinstance(obj, Mapping) or "metadata" not in obj:
                raise RuntimeError(f"watch error: {obj}")  # e.g. 410 Gone: relist
            with self._lock:
                if event["type"] == "DELETED":
                    self._items.pop(obj["metadata"]["name"], None)
                else:
                    self._items[obj["metadata"]["name"]] = obj
            if self._idle():
                stream.stop()
                return


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


class ReaderArguments(Protocol):
    """Who the reader is and whom the server admits: an `AgentConfig` (the agent's, also in its rank processes)."""

    @property
    def pod_namespace(self) -> str | None: ...

    @property
    def service_account(self) -> str | None: ...

    @property
    def pod_name(self) -> str | None: ...

    @property
    def pod_uid(self) -> str | None: ...

    @property
    def worker_allowed_identity(self) -> Sequence[str]: ...


def from_arguments(args: ReaderArguments, api: client.ApiClient, node: str) -> tuple[ReaderTokens, WorkerAuth]:
    """The reader's credentials and the checks of the worker services on `node`; `ValueError` names what is
    missing."""
    missing = [
        f"--{n.replace('_', '-')}"
        for n in ("pod_namespace", "service_account", "pod_name", "pod_uid")
        if not getattr(args, n)
    ]
    if missing:
        raise ValueError(
            f"{', '.join(missing)} missing: worker tokens are minted for this agent's ServiceAccount, bound to its "
            "Pod (the chart sets POD_NAMESPACE, SERVICE_ACCOUNT, POD_NAME and POD_UID)"
        )
    identity = PodIdentity(args.pod_namespace, args.service_account, args.pod_name, args.pod_uid)
    auth = WorkerAuth.from_api(api, args.worker_allowed_identity or [identity.username], node)
    return ReaderTokens(api, identity), auth
