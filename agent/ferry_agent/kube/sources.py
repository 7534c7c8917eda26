"""The API reads of one rank's load: its WeightReplica, the WeightVersions of its chain, S3 credentials and the
peer sources of a version, each retried while the apiserver is unreachable."""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable, Collection, Mapping
from typing import Any

from kubernetes import client, watch
from kubernetes.client.exceptions import ApiException

from ferry.ambient import AmbientPolicy
from ferry.api.models import GROUP, LABEL_MODEL, VERSION, ReplicaPhase, WeightReplica, label_value
from ferry.s3 import credentials_from_secret_data
from ferry_agent.kube.apiretry import call_with_retry
from ferry_agent.kube.registry import first_loader, holder_candidates, peer_version_problem, source_candidates
from ferry_agent.strategies.chain import LoadContext
from ferry_agent.strategies.progress import Progress

PLURAL = WeightReplica.plural
_TURNS = (ReplicaPhase.SERVING, ReplicaPhase.FAILED)  # phases that change a waiting reader's sources or first loader
# A replica with no source at all lists again on the next change of its model's replicas that can give it one (a
# watch from the list's resourceVersion: a replica that serves, serves its load, fails, appears or goes), at the latest
# after this, while the first loader starts.
FIRST_LOADER_POLL_S = 2.0


class ApiSources:
    """What a rank reads from the API while loading: peer sources, WeightVersions and S3 credentials. Each read
    is retried with backoff while the apiserver is unreachable or failing (`apiretry.call_with_retry`), so a
    short outage delays a load instead of failing it."""

    def __init__(
        self,
        api: client.ApiClient,
        namespace: str,
        stopping: threading.Event | None = None,
        *,
        ambient: AmbientPolicy | None = None,
        s3_endpoint: str | None = None,
    ) -> None:
        """`ambient`: where the agent's own S3 credentials may be used (default: nowhere); `s3_endpoint`: the
        endpoint of versions that name none."""
        self._api = api
        self._ambient = ambient or AmbientPolicy()
        self._s3_endpoint = s3_endpoint
        self._objects = client.CustomObjectsApi(api)
        self._leases = client.CoordinationV1Api(api)
        self.namespace = namespace
        self._stopping = stopping or threading.Event()

    def _read(self, what: str, fn: Callable[[], Any]) -> Any:
        return call_with_retry(fn, what=f"reading {what} in {self.namespace}", stop=self._stopping)

    def replica(self, name: str) -> dict[str, Any]:
        return self._read(
            f"WeightReplica {name}",
            lambda: self._objects.get_namespaced_custom_object(GROUP, VERSION, self.namespace, PLURAL, name),
        )

    def candidates(
        self, version: str, self_name: str, wait_s: float, note: Callable[[str], None], progress: Progress | None = None
    ) -> Callable[[LoadContext], list]:
        """Peer sources for a rank: replicas serving the very WeightVersion object of that name, which must exist,
        be Ready and be of the replica's model (raises otherwise; `ctx.version_uid` says which object), and
        replicas still loading it that serve what they hold (pipelined fan-out). With no Serving source, the first
        loader of the version gets none (it reads object storage, and the others read from it while it does);
        any other replica that finds no source at all waits up to `wait_s` for the first loader to start serving
        (`note` says so, and `progress` names it as the source waited on), instead of all reading S3."""

        def check(ctx: LoadContext) -> str:
            body = self.version(version)
            problem = peer_version_problem(body, name=version, model=ctx.model)
            if problem is not None:
                raise ValueError(problem)
            assert body is not None
            return str(body["metadata"]["uid"])

        seen: list[str] = []  # the resourceVersion of the last list, where a wait's watch starts

        def listed(ctx: LoadContext) -> tuple[list, dict]:
            # By model, not by the version label: that names spec.version, and a replica moving to a newer version
            # still serves this one until the newer one is resident (make-before-break).
            body = self._objects.list_namespaced_custom_object(
                GROUP, VERSION, self.namespace, PLURAL, label_selector=f"{LABEL_MODEL}={label_value(ctx.model)}"
            )
            seen[:] = [(body.get("metadata") or {}).get("resourceVersion") or ""]
            leases = {
                lease.metadata.name: self._api.sanitize_for_serialization(lease)
                for lease in self._leases.list_namespaced_lease(self.namespace).items
            }
            return body["items"], leases

        def once(ctx: LoadContext, uid: str) -> tuple[list, list]:
            replicas, leases = self._read(f"the sources of {version}", lambda: listed(ctx))
            found = source_candidates(
                replicas,
                leases,
                version=version,
                rank=ctx.rank,
                self_replica=self_name,
                now=dt.datetime.now(dt.UTC),
                world_size=ctx.world_size,
                version_uid=uid,
            )
            if not found and first_loader(replicas, version=version, self_replica=self_name) == self_name:
                return [], replicas
            found += holder_candidates(
                replicas,
                version=version,
                rank=ctx.rank,
                self_replica=self_name,
                world_size=ctx.world_size,
                version_uid=uid,
            )
            return found, replicas

        def listing(ctx: LoadContext) -> list:
            ctx.version_uid = uid = check(ctx)
            found, replicas = once(ctx, uid)
            deadline = time.monotonic() + wait_s
            waited_on = None
            while not found and time.monotonic() < deadline:
                leader = first_loader(replicas, version=version, self_replica=self_name)
                if leader == self_name or self._stopping.is_set():
                    break
                note(f"waiting for {leader} to load {version}")
                if progress is not None and leader != waited_on:  # once: progress reports reset stall detection
                    progress(0, 0, f"peer/{leader}")  # a stall names the peer waited on
                    waited_on = leader
                self._next_change(ctx.model, seen[0] if seen else "", FIRST_LOADER_POLL_S)
                found, replicas = once(ctx, uid)
            return found

        return listing

    def _next_change(self, model: str, resource_version: str, timeout_s: float) -> None:
        """Return on the first change of the model's replicas after `resource_version` that may give a waiting reader a
        source or another first loader (not a progress report), or after `timeout_s`."""
        started = time.monotonic()
        stream = watch.Watch()
        try:
            for event in stream.stream(
                self._objects.list_namespaced_custom_object,
                GROUP,
                VERSION,
                self.namespace,
                PLURAL,
                label_selector=f"{LABEL_MODEL}={label_value(model)}",
                resource_version=resource_version or None,
                timeout_seconds=max(1, int(timeout_s)),
                _request_timeout=(5, timeout_s),
            ):
                status = (event.get("object") or {}).get("status") or {}
                if event.get("type") != "MODIFIED" or status.get("loadingRanks") or status.get("phase") in _TURNS:
                    return
        except Exception:  # the read timeout is the usual end; a failed watch waits out the interval
            pass
        finally:
            stream.stop()
        time.sleep(max(0.0, timeout_s - (time.monotonic() - started)))

    def first_loader(self, version: str, self_name: str) -> Callable[[LoadContext, Collection[str]], str]:
        """Who reads object storage for `version` now, the replicas in the second argument (found dead) excluded."""

        def leader(ctx: LoadContext, dead: Collection[str]) -> str:
            replicas = self._read(
                f"the replicas of {ctx.model}",
                lambda: self._objects.list_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, PLURAL, label_selector=f"{LABEL_MODEL}={label_value(ctx.model)}"
                )["items"],
            )
            return first_loader(replicas, version=version, self_replica=self_name, exclude=dead)

        return leader

    def version(self, name: str) -> dict | None:
        try:
            return self._read(
                f"WeightVersion {name}",
                lambda: self._objects.get_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, "weightversions", name
                ),
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def credentials(self, storage: Mapping) -> dict[str, str] | None:
        secret = storage.get("credentialsSecret")
        if not secret:
            # The agent's own environment (instance role, env vars), only where the admin allows it: raises
            # AmbientCredentialsDenied, and no request is made.
            self._ambient.check(self.namespace, storage.get("uri") or "", storage.get("endpoint"), self._s3_endpoint)
            return None
        data = self._read(
            f"Secret {secret}", lambda: client.CoreV1Api(self._api).read_namespaced_secret(secret, self.namespace).data
        )
        return credentials_from_secret_data(data)
