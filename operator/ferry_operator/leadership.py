"""Leader election on one coordination.k8s.io Lease, the way client-go's leaderelection does it, so that several
operator replicas run with exactly one active.

A candidate that does not hold the Lease waits in kopf's startup activity, before kopf starts any watch: a standby
runs no handler and fills no index. It takes the Lease when the holder clears it (a graceful shutdown) or when the
record has not changed for the Lease's `leaseDurationSeconds`, counted on its own clock from when it last saw the
record change (clock skew between replicas does not matter). Every write carries the resourceVersion it read, so of
two candidates only one wins. The holder renews every `retry_period` from a thread of its own (a busy event loop
does not cost it the Lease); when it cannot renew for `renew_deadline`, or finds another holder, the process exits
at once, with handlers in flight, and the Deployment restarts it as a standby. renew_deadline < lease_duration:
it stops before another candidate can see the Lease expire.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import os
import socket
import sys
import threading
import time
import urllib.parse
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from prometheus_client import Gauge

from ferry.kube import kube_client
from ferry_operator.config import CONFIG, OperatorConfig

log = logging.getLogger("ferry.operator.leadership")

LEADER = Gauge("ferry_operator_leader", "1 while this operator process holds the leader-election Lease, else 0")


@dataclass(frozen=True)
class ElectionConfig:
    namespace: str
    name: str
    identity: str
    lease_duration: int
    renew_deadline: float
    retry_period: float
    # kopf's --liveness URL: kopf serves it once it runs, the standby meanwhile (or the probe would restart it).
    standby_healthz: str = ""

    def __post_init__(self) -> None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            raise ValueError(
                f"leader election needs 0 < retryPeriod ({self.retry_period}) < renewDeadline ({self.renew_deadline})"
                f" < leaseDuration ({self.lease_duration})"
            )

    @classmethod
    def of(cls, config: OperatorConfig) -> ElectionConfig | None:
        """None when leader election is off (the operator then assumes it is the only one)."""
        if not config.leader_election:
            return None
        # A restarted container keeps its Pod name: the suffix tells its Lease records from its predecessor's.
        base = config.leader_election_identity or socket.gethostname()
        return cls(
            namespace=config.leader_election_namespace,
            name=config.leader_election_lease,
            identity=f"{base}_{uuid.uuid4().hex[:8]}",
            lease_duration=config.leader_election_lease_seconds,
            renew_deadline=config.leader_election_renew_deadline_seconds,
            retry_period=config.leader_election_retry_seconds,
            standby_healthz=config.standby_healthz or "",
        )


def _micro(now: dt.datetime) -> str:
    return now.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Elector:
    """Acquire, renew and release the Lease; each method is one blocking API round (call it from a thread)."""

    def __init__(
        self, api: client.CoordinationV1Api, config: ElectionConfig, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.api, self.config, self.clock = api, config, clock
        self.holder = ""  # the holder last seen
        self._seen: tuple[str, float] = ("", 0.0)  # (resourceVersion, local time it was first seen)
        self._lease: dict[str, Any] | None = None  # the Lease as this process last wrote it

    def _timeout(self) -> tuple[float, float]:
        # No request may outlast a retry period: a hung apiserver must not hold the renewal past its deadline.
        return (self.config.retry_period, self.config.retry_period)

    def _read(self) -> dict[str, Any] | None:
        try:
            response = self.api.read_namespaced_lease(
                self.config.name, self.config.namespace, _preload_content=False, _request_timeout=self._timeout()
            )
        except ApiException as exc:
            if exc.status == 404:
                return None
            raise
        return json.loads(response.data)

    def _spec(self, now: dt.datetime, acquire_time: str, transitions: int) -> dict[str, Any]:
        return {
            "holderIdentity": self.config.identity,
            "leaseDurationSeconds": self.config.lease_duration,
            "acquireTime": acquire_time,
            "renewTime": _micro(now),
            "leaseTransitions": transitions,
        }

    def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this process holds the Lease afterwards."""
        now = dt.datetime.now(dt.UTC)
        lease = self._read()
        if lease is None:
            body = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.config.name, "namespace": self.config.namespace},
                "spec": self._spec(now, _micro(now), 0),
            }
            return self._write(body, create=True)
        version = lease["metadata"]["resourceVersion"]
        if self._seen[0] != version:
            self._seen = (version, self.clock())
        spec = lease.get("spec") or {}
        self.holder = spec.get("holderIdentity") or ""
        mine = self.holder == self.config.identity
        if self.holder and not mine:
            duration = float(spec.get("leaseDurationSeconds") or self.config.lease_duration)
            if self.clock() < self._seen[1] + duration:
                return False  # held, and renewed within its duration as far as this process has seen
            log.info(
                "the Lease %s/%s of %s expired; taking it over", self.config.namespace, self.config.name, self.holder
            )
        transitions = int(spec.get("leaseTransitions") or 0)
        acquire_time = spec.get("acquireTime") if mine else _micro(now)
        lease["spec"] = self._spec(now, acquire_time or _micro(now), transitions if mine else transitions + 1)
        return self._write(lease, create=False)

    def _write(self, body: dict[str, Any], *, create: bool) -> bool:
        try:
            if create:
                response = self.api.create_namespaced_lease(
                    self.config.namespace, body, _preload_content=False, _request_timeout=self._timeout()
                )
            else:  # carries the resourceVersion read: a concurrent writer makes this a 409
                response = self.api.replace_namespaced_lease(
                    self.config.name,
                    self.config.namespace,
                    body,
                    _preload_content=False,
                    _request_timeout=self._timeout(),
                )
        except ApiException as exc:
            if exc.status == 409:
                return False
            raise
        self._lease = json.loads(response.data)
        self.holder = self.config.identity
        return True

    def release(self) -> None:
        """Clear the holder (a graceful shutdown): a standby takes the Lease at its next try, not after it expires."""
        if self._lease is None:
            return
        self._lease["spec"].update(
            holderIdentity=None, leaseDurationSeconds=1, renewTime=_micro(dt.datetime.now(dt.UTC))
        )
        try:
            self.api.replace_namespaced_lease(
                self.config.name, self.config.namespace, self._lease, _request_timeout=self._timeout()
            )
        except ApiException as exc:
            log.warning("releasing the Lease %s/%s failed: %s", self.config.namespace, self.config.name, exc.reason)
            return
        log.info("released the Lease %s/%s", self.config.namespace, self.config.name)


def _lost(message: str) -> None:
    """Leadership lost: stop now, with whatever runs, rather than act beside the new leader."""
    LEADER.set(0)
    log.critical("%s; exiting so that only the new holder acts", message)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(1)


class Leadership:
    """The process's part in the election: `acquire` (awaited in kopf's startup), then renewals, `release`."""

    def __init__(self, elector: Elector, on_lost: Callable[[str], None] = _lost) -> None:
        self.elector = elector
        self.on_lost = on_lost
        self._stop = threading.Event()
        self._renewer: threading.Thread | None = None

    @property
    def config(self) -> ElectionConfig:
        return self.elector.config

    async def acquire(self) -> None:
        config = self.config
        log.info("leader election: %s waits for the Lease %s/%s", config.identity, config.namespace, config.name)
        LEADER.set(0)
        health = await self._serve_standby_health() if config.standby_healthz else None
        announced = ""
        try:
            while True:
                try:
                    if await asyncio.to_thread(self.elector.try_acquire_or_renew):
                        break
                except Exception as exc:  # the apiserver is away: keep trying, as a standby does nothing else
                    log.warning("leader election: trying the Lease failed: %s", exc)
                if self.elector.holder != announced:
                    announced = self.elector.holder
                    log.info("leader election: standby; %s holds the Lease", announced or "nobody")
                await asyncio.sleep(config.retry_period)
        finally:
            if health is not None:
                await health.cleanup()  # frees the port for kopf's own liveness endpoint
        LEADER.set(1)
        log.info("leader election: %s holds the Lease %s/%s; starting", config.identity, config.namespace, config.name)
        self._renewer = threading.Thread(target=self._renew, name="lease-renewer", daemon=True)
        self._renewer.start()

    async def _serve_standby_health(self) -> web.AppRunner:
        url = urllib.parse.urlparse(self.config.standby_healthz)

        async def healthz(_: web.Request) -> web.Response:
            return web.Response(text=f"standby; {self.elector.holder or 'nobody'} holds the Lease\n")

        app = web.Application()
        app.router.add_get(url.path or "/", healthz)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, url.hostname, url.port or 80).start()
        return runner

    def _renew(self) -> None:
        config = self.config
        renewed = time.monotonic()
        while not self._stop.wait(config.retry_period):
            try:
                ok = self.elector.try_acquire_or_renew()
            except Exception as exc:
                log.warning("leader election: renewing the Lease failed: %s", exc)
                ok = False
            if self._stop.is_set():
                return
            if ok:
                renewed = time.monotonic()
            elif self.elector.holder not in ("", config.identity):
                return self.on_lost(f"the Lease {config.namespace}/{config.name} is held by {self.elector.holder}")
            elif time.monotonic() - renewed > config.renew_deadline:
                return self.on_lost(
                    f"the Lease {config.namespace}/{config.name} was not renewed for {config.renew_deadline:g}s"
                )

    def release(self) -> None:
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join(self.config.retry_period * 2)
            self.elector.release()
        LEADER.set(0)


def from_env() -> Leadership | None:
    config = ElectionConfig.of(CONFIG)
    if config is None:
        return None
    # A client of its own: the renewals never queue behind the handlers' requests.
    return Leadership(Elector(client.CoordinationV1Api(kube_client()), config))
