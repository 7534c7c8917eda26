"""The attach server: one Unix socket per consumer pod, `<socket_dir>/pods/<pod-uid>/ferry.sock`.

A pod mounts only its own directory, so reaching a socket proves which pod is asking (the path is the capability);
a pod sees and attaches only versions served for ModelLoads of its own namespace. A lease is the connection: the
versions a connection attached stay held until it releases them or closes (the kernel closes it when the consumer
dies, SIGKILL included), and a held version is never freed, whatever the agent stops offering meanwhile. Every
lease taken or let go is announced (`on_leases_changed`); `attachments()` says who holds what, per replica.

A consumer still maps what an earlier agent process leased it when that agent restarts: its client connects
again and announces each such version (`announce`: ModelLoad, version, rank). An announcement holds no memory;
while its connection stays open it is listed like a lease, in the status of the replica that serves that
ModelLoad here, so retention keeps the version the pod still reads.

Each request gets one reply, in order (`ferry.client.protocol`). A client that breaks the framing (garbage, an
oversized length, descriptors sent to the agent, EOF mid-frame) is sent an error where possible and disconnected;
a well-framed bad request gets an error reply and the connection stays. Nothing a client sends reaches beyond its
own connection thread.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import select
import selectors
import shutil
import socket
import threading
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import Gauge

from ferry.api.conditions import now_rfc3339
from ferry.client import protocol as p
from ferry_agent.attach.memstore import SealedVersion
from ferry_agent.attach.publish import OPS as PUBLISH_OPS
from ferry_agent.attach.publish import TrainerPublishing

log = logging.getLogger("ferry.agent.attach")

LEASES = Gauge("ferry_agent_attach_leases", "Versions leased by engine pods on this node (attach connections)")
SEALED_BYTES = Gauge("ferry_agent_attach_sealed_bytes", "Host memory in sealed attach chunks: offered or still leased")

# A Pod UID as the apiserver writes it; anything else never becomes a path.
_POD_UID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")
# sun_path holds 108 bytes including the terminator.
_MAX_SOCKET_PATH = 107

# An engine pod holds one connection per worker process (TP 8: 8), its refit's and its sidecar's, and a few more
# while a worker restarts: 64 leaves room and still bounds what one pod can make the agent hold open.
DEFAULT_ATTACH_CONNECTIONS_PER_POD = 64

_DIR_MODE = 0o2775  # setgid, group rwx: see AttachServer.start


@dataclass(frozen=True)
class Pod:
    uid: str
    namespace: str
    name: str
    service_account: str = ""  # spec.serviceAccountName: whom a publish is authorized for (attach/publish.py)


@dataclass
class Offer:
    """A version this node serves for one ModelLoad (one WeightReplica)."""

    namespace: str
    model_load: str
    model: str
    version: str
    version_uid: str | None
    sealed: SealedVersion  # every tensor (all ranks' shares)
    ranks: list[SealedVersion] = field(default_factory=list)  # a multi-rank replica's share of each rank

    @property
    def leases(self) -> int:
        return self.sealed.leases + sum(r.leases for r in self.ranks)

    def unref(self) -> None:
        for held in (self.sealed, *self.ranks):
            held.unref()


@dataclass
class _Lease:
    id: str
    offer: Offer
    sealed: SealedVersion  # what it holds: the whole version, or one rank's share
    replica: tuple[str, str]  # the WeightReplica whose status names the pod (namespace, name)
    pod: Pod
    rank: int | None  # None: all shares
    since: str


@dataclass
class _Announced:
    """A version a pod still maps from an earlier agent process (`announce`): no memory, only its status entry."""

    id: str
    pod: Pod
    model_load: str
    version: str
    rank: int | None
    since: str


@dataclass
class _Listener:
    pod: Pod
    sock: socket.socket
    path: Path
    connections: set[socket.socket] = field(default_factory=set)


class AttachServer:
    def __init__(
        self,
        socket_dir: Path,
        *,
        agent_name: str = "",
        max_connections_per_pod: int = DEFAULT_ATTACH_CONNECTIONS_PER_POD,
        max_leases_per_connection: int = 64,
        publishing: TrainerPublishing | None = None,
    ) -> None:
        self.socket_dir = socket_dir
        self._publishing = publishing  # the publish ops (None: refused as unknown)
        self.pods_dir = socket_dir / "pods"
        self._agent_name = agent_name
        self._max_connections = max_connections_per_pod
        self._max_leases = max_leases_per_connection
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)  # notified on every offer and withdrawal (watchers)
        self._offers: dict[tuple[str, str], Offer] = {}  # (namespace, WeightReplica name) -> what is offered
        self._held: list[Offer] = []  # withdrawn, still leased
        self._leases: dict[str, _Lease] = {}  # every connection's leases, by id: who holds what (status)
        self._announced: dict[str, _Announced] = {}  # every connection's announcements, by id (status)
        self._on_leases: list[Callable[[], None]] = []
        self._listeners: dict[str, _Listener] = {}  # pod uid ->
        self._selector = selectors.DefaultSelector()
        self._pending: list[Callable[[], None]] = []  # selector changes, applied by the accept thread
        self._wake_r, self._wake_w = socket.socketpair()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        self.pods_dir.mkdir(parents=True, exist_ok=True)
        # When the kubelet reaches a consumer's subPath (pods/<uid>) before this agent does, it makes the directory
        # itself: root-owned, with the mode of the socket root, in the group of pods/ when pods/ is setgid. These
        # bits make that directory the agent's group's and writable by it, so the socket can still be bound there.
        for directory in (self.socket_dir, self.pods_dir):
            try:
                os.chmod(directory, _DIR_MODE)
            except OSError as exc:  # not ours (provisioned by hand): a kubelet-made directory stays unreachable
                log.warning("cannot set mode %o on %s: %s", _DIR_MODE, directory, exc)
        LEASES.set_function(lambda: sum(v["attached"] for v in self.snapshot()))
        SEALED_BYTES.set_function(  # a chunk shared by several versions (or shares) counts once
            lambda: sum({id(c): c.size for o in self._all_offers() for c in o.sealed.chunks}.values())
        )
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._accept_loop, name="ferry-attach", daemon=True)
        self._thread.start()
        log.info("attach sockets under %s", self.pods_dir)

    def stop(self) -> None:
        self._stopping.set()
        self._wake_w.send(b"x")
        if self._thread is not None:
            self._thread.join(timeout=5)
        for uid in list(self._listeners):
            self._close_listener(uid)

    # ------------------------------------------------------------------ offers

    def offer(self, key: tuple[str, str], offer: Offer) -> None:
        """Serve `offer` for replica `key`, in place of what it served before."""
        self.withdraw(key)
        with self._lock:
            self._offers[key] = offer
            self._changed.notify_all()
            announced = any(
                a.pod.namespace == offer.namespace and a.model_load == offer.model_load
                for a in self._announced.values()
            )
        if announced:  # announcements of its ModelLoad are now listed in this replica's status
            self._leases_changed()
        log.info(
            "offering %s/%s %s (%d bytes, %d chunks) to pods of %s",
            offer.model_load,
            offer.model,
            offer.version,
            offer.sealed.total_bytes,
            len(offer.sealed.fds),
            offer.namespace,
        )

    def withdraw(self, key: tuple[str, str]) -> None:
        """No new attaches; held leases keep the memory until they go."""
        with self._lock:
            offer = self._offers.pop(key, None)
            if offer is not None and offer.leases:
                self._held.append(offer)
            self._changed.notify_all()
        if offer is not None:
            offer.unref()

    def _all_offers(self) -> list[Offer]:
        with self._lock:
            return list(self._offers.values()) + [o for o in self._held if o.leases]

    def snapshot(self) -> list[dict[str, Any]]:
        """What is offered and held, with the consumers attached: the agent's view."""
        with self._lock:
            offers = list(self._offers.values())
            held = [o for o in self._held if o.leases]
        return [
            {
                "namespace": o.namespace,
                "modelLoad": o.model_load,
                "model": o.model,
                "version": o.version,
                "versionUid": o.version_uid,
                "bytes": o.sealed.total_bytes,
                "tensors": len(o.sealed.entries),
                "attached": o.leases,
                "offered": offered,
            }
            for group, offered in ((offers, True), (held, False))
            for o in group
        ]

    def on_leases_changed(self, callback: Callable[[], None]) -> None:
        """`callback()` after every lease taken or let go (from the connection's thread: it must not block)."""
        self._on_leases.append(callback)

    def attachments(self) -> dict[tuple[str, str], list[dict[str, Any]]]:
        """Per replica, the pods that hold its versions: one `status.attachments` entry per pod, version and rank
        (several connections of one pod are one entry, since its first lease), in pod order."""
        with self._lock:
            held = [
                (lease.replica, lease.pod, lease.offer.version, lease.rank, lease.since)
                for lease in self._leases.values()
            ]
            replicas = {(o.namespace, o.model_load): key for key, o in self._offers.items()}
            for a in self._announced.values():
                replica = replicas.get((a.pod.namespace, a.model_load))
                if replica is not None:  # else listed once this node serves its ModelLoad again
                    held.append((replica, a.pod, a.version, a.rank, a.since))
        found: dict[tuple[str, str], dict[tuple[str, str, int | None], dict[str, Any]]] = {}
        for replica, pod, version, rank, since in held:
            entry: dict[str, Any] = {
                "pod": pod.name,
                "podNamespace": pod.namespace,
                "podUid": pod.uid,
                "version": version,
                "since": since,
            }
            if rank is not None:
                entry["rank"] = rank
            per_replica = found.setdefault(replica, {})
            key = (pod.uid, version, rank)
            if key not in per_replica or entry["since"] < per_replica[key]["since"]:
                per_replica[key] = entry
        return {replica: sorted(entries.values(), key=_entry_order) for replica, entries in found.items()}

    def _leases_changed(self) -> None:
        for callback in self._on_leases:
            try:
                callback()
            except Exception:  # a status hook must not cost the consumer its reply
                log.exception("lease change callback failed")

    # ------------------------------------------------------------------ pods

    def sync_pods(self, pods: Iterable[Pod]) -> None:
        """Exactly these pods have sockets."""
        wanted = {pod.uid: pod for pod in pods}
        for uid in set(self._listeners) - set(wanted):
            self.remove_pod(uid)
        for pod in wanted.values():
            self.add_pod(pod)

    def add_pod(self, pod: Pod) -> None:
        if pod.uid in self._listeners:
            return
        if not _POD_UID.match(pod.uid):
            log.warning("pod %s/%s has an unexpected uid %r; no socket", pod.namespace, pod.name, pod.uid)
            return
        directory = self.pods_dir / pod.uid
        path = directory / p.SOCKET_NAME
        if len(os.fsencode(path)) > _MAX_SOCKET_PATH:
            log.error(
                "socket path %s is longer than a Unix socket allows; no socket for %s/%s", path, pod.namespace, pod.name
            )
            return
        try:
            directory.mkdir(mode=0o755, exist_ok=True)  # made by the kubelet, it is group-writable (start)
            path.unlink(missing_ok=True)  # left by an earlier agent
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(str(path))
            # The engine may run as any user; only its own pod can reach this directory.
            os.chmod(path, 0o666)
            sock.listen(16)
            sock.setblocking(False)
        except OSError as exc:
            log.error("cannot serve a socket for pod %s/%s at %s: %s", pod.namespace, pod.name, path, exc)
            return
        listener = _Listener(pod, sock, path)
        self._listeners[pod.uid] = listener
        self._apply(lambda: self._selector.register(sock, selectors.EVENT_READ, listener))
        log.info("socket for pod %s/%s at %s", pod.namespace, pod.name, path)

    def remove_pod(self, uid: str) -> None:
        self._close_listener(uid)

    def _close_listener(self, uid: str) -> None:
        listener = self._listeners.pop(uid, None)
        if listener is None:
            return

        def unregister() -> None:
            with contextlib.suppress(KeyError, ValueError):
                self._selector.unregister(listener.sock)
            listener.sock.close()

        if self._thread is not None and self._thread.is_alive():
            self._apply(unregister)
        else:
            listener.sock.close()
        shutil.rmtree(listener.path.parent, ignore_errors=True)
        log.info("socket of pod %s/%s removed", listener.pod.namespace, listener.pod.name)

    def _apply(self, change: Callable[[], None]) -> None:
        with self._lock:
            self._pending.append(change)
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    # ------------------------------------------------------------------ accepting

    def _accept_loop(self) -> None:
        while not self._stopping.is_set():
            with self._lock:
                pending, self._pending = self._pending, []
            for change in pending:
                change()
            for key, _ in self._selector.select(timeout=5):
                if key.data is None:
                    with contextlib.suppress(BlockingIOError):
                        self._wake_r.recv(4096)
                    continue
                self._accept(key.data)

    def _accept(self, listener: _Listener) -> None:
        try:
            conn, _ = listener.sock.accept()
        except OSError as exc:
            if exc.errno not in (errno.EAGAIN, errno.ECONNABORTED):
                log.warning("accept on %s failed: %s", listener.path, exc)
            return
        conn.setblocking(True)
        with self._lock:
            full = len(listener.connections) >= self._max_connections
            if not full:
                listener.connections.add(conn)
        if full:
            _reply_and_close(conn, p.error(p.TOO_MANY_LEASES, f"at most {self._max_connections} connections a pod"))
            return
        threading.Thread(target=self._serve, args=(listener, conn), name="ferry-attach-conn", daemon=True).start()

    # ------------------------------------------------------------------ one connection

    def _serve(self, listener: _Listener, conn: socket.socket) -> None:
        pod = listener.pod
        leases: dict[str, _Lease] = {}
        announced: dict[str, _Announced] = {}
        publishes: dict[str, Any] = {}  # this connection's publishes not yet committed
        try:
            while True:
                try:
                    request, _ = p.recv_frame(conn, max_bytes=p.MAX_REQUEST_BYTES, max_fds=0)
                except p.Closed:
                    return
                except p.ProtocolError as exc:
                    log.warning("pod %s/%s: %s; disconnecting", pod.namespace, pod.name, exc)
                    _reply_and_close(conn, p.error(p.BAD_REQUEST, str(exc)))
                    return
                if request.get("op") == "watch":
                    self._watch(pod, request, conn)
                    return
                try:
                    if request.get("op") == "announce":
                        reply, fds = self._announce(pod, request, leases, announced), []
                    elif request.get("op") in PUBLISH_OPS and self._publishing is not None:
                        reply, fds = self._publishing.handle(pod, request, publishes)
                    else:
                        reply, fds = self._handle(pod, request, leases)
                except Exception as exc:  # a bug here must cost this request, not the agent
                    log.exception("pod %s/%s: request failed", pod.namespace, pod.name)
                    reply, fds = p.error("Internal", f"{type(exc).__name__}: {exc}"), []
                p.send_frame(conn, reply, fds)
        except OSError as exc:  # the consumer went away mid-reply
            log.info("pod %s/%s disconnected: %s", pod.namespace, pod.name, exc)
        finally:
            if self._publishing is not None:
                self._publishing.disconnected(publishes)
            for lease in leases.values():
                lease.sealed.unlease()
            if leases:
                log.info("pod %s/%s released %d lease(s) by closing", pod.namespace, pod.name, len(leases))
            with self._lock:
                listener.connections.discard(conn)
                self._held = [o for o in self._held if o.leases]
                for lease_id in leases:
                    self._leases.pop(lease_id, None)
                for announcement in announced:
                    self._announced.pop(announcement, None)
            conn.close()
            if leases or announced:
                self._leases_changed()

    def _handle(self, pod: Pod, request: dict[str, Any], leases: dict[str, _Lease]) -> tuple[dict[str, Any], list]:
        op = request.get("op")
        if op == "hello":
            return {
                "ok": True,
                "proto": p.PROTOCOL,
                "agent": self._agent_name,
                "pod": {"namespace": pod.namespace, "name": pod.name, "uid": pod.uid},
            }, []
        if op == "list":
            mine = [v for v in self.snapshot() if v.get("namespace") == pod.namespace]
            return {"ok": True, "versions": mine, "leases": sorted(leases)}, []
        if op == "attach":
            return self._attach(pod, request, leases)
        if op == "release":
            lease_id = request.get("lease")
            lease = leases.pop(lease_id, None) if isinstance(lease_id, str) else None
            if lease is None:
                return p.error(p.UNKNOWN_LEASE, f"no lease {lease_id!r} on this connection"), []
            lease.sealed.unlease()
            with self._lock:
                self._held = [o for o in self._held if o.leases]
                self._leases.pop(lease.id, None)
            self._leases_changed()
            return {"ok": True}, []
        return p.error(p.BAD_REQUEST, f"unknown op {op!r}"), []

    def _announce(
        self, pod: Pod, request: dict[str, Any], leases: dict[str, _Lease], announced: dict[str, _Announced]
    ) -> dict[str, Any]:
        """`{"op": "announce", "modelLoad", "version", "rank"?}`: the pod still maps this version of that ModelLoad
        of its namespace (leased from an earlier agent process); listed until this connection closes."""
        name, version, rank = request.get("modelLoad"), request.get("version"), request.get("rank")
        if not all(isinstance(v, str) and 0 < len(v) <= 253 for v in (name, version)):
            return p.error(p.BAD_REQUEST, "announce needs a string 'modelLoad' and 'version'")
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
            return p.error(p.BAD_REQUEST, "'rank' must be a non-negative integer")
        namespace = request.get("namespace") or pod.namespace
        if namespace != pod.namespace:
            return p.error(p.FORBIDDEN, f"pod {pod.namespace}/{pod.name} may announce only in {pod.namespace}")
        if len(leases) + len(announced) >= self._max_leases:
            return p.error(p.TOO_MANY_LEASES, f"at most {self._max_leases} leases a connection")
        announcement = _Announced(uuid.uuid4().hex, pod, name, version, rank, now_rfc3339())
        announced[announcement.id] = announcement
        with self._lock:
            self._announced[announcement.id] = announcement
        self._leases_changed()
        log.info("pod %s/%s still maps %s %s (announced)", pod.namespace, pod.name, name, version)
        return {"ok": True, "announcement": announcement.id}

    def _watch(self, pod: Pod, request: dict[str, Any], conn: socket.socket) -> None:
        """The connection becomes a stream: a frame `{"version", "versionUid"}` whenever what this node serves for
        `name` changes (the first one at once; `version` null while nothing is served). Ends when the client
        closes or sends anything."""
        name = request.get("name")
        namespace = request.get("namespace") or pod.namespace
        if not isinstance(name, str) or not name or namespace != pod.namespace:
            p.send_frame(conn, p.error(p.BAD_REQUEST, "watch needs a 'name' in the pod's own namespace"))
            return
        last: tuple[str | None, str | None] | None = None
        while not self._stopping.is_set():
            with self._lock:
                current = self._served_version(namespace, name)
                if current == last:
                    self._changed.wait(timeout=1.0)
                    current = self._served_version(namespace, name)
            if current != last:
                p.send_frame(conn, {"ok": True, "version": current[0], "versionUid": current[1]})
                last = current
            if _readable_or_closed(conn):  # a watcher only listens: EOF or any byte ends it
                return

    def _served_version(self, namespace: str, name: str) -> tuple[str | None, str | None]:
        offers = [o for o in self._offers.values() if o.namespace == namespace]
        matches = [o for o in offers if o.model_load == name] or [o for o in offers if o.model == name]
        if len({o.version for o in matches}) != 1:
            return None, None
        return matches[0].version, matches[0].version_uid

    def _attach(self, pod: Pod, request: dict[str, Any], leases: dict[str, _Lease]) -> tuple[dict[str, Any], list]:
        name = request.get("name")
        namespace = request.get("namespace") or pod.namespace
        version = request.get("version")
        rank = request.get("rank")
        if not isinstance(name, str) or not name or not isinstance(namespace, str):
            return p.error(p.BAD_REQUEST, "attach needs a string 'name' (the ModelLoad or the model)"), []
        if version is not None and not isinstance(version, str):
            return p.error(p.BAD_REQUEST, "'version' must be a string"), []
        if rank is not None and (not isinstance(rank, int) or isinstance(rank, bool) or rank < 0):
            return p.error(p.BAD_REQUEST, "'rank' must be a non-negative integer"), []
        if namespace != pod.namespace:
            return p.error(p.FORBIDDEN, f"pod {pod.namespace}/{pod.name} may attach only in {pod.namespace}"), []
        if len(leases) >= self._max_leases:
            return p.error(p.TOO_MANY_LEASES, f"at most {self._max_leases} leases a connection"), []
        with self._lock:
            offers = [o for o in self._offers.values() if o.namespace == namespace]
            matches = [o for o in offers if o.model_load == name] or [o for o in offers if o.model == name]
            served = sorted({o.version for o in matches})
            if version is not None:
                matches = [o for o in matches if o.version == version]
            if len({id(o.sealed) for o in matches}) > 1:
                return p.error(p.BAD_REQUEST, f"{name!r} names several ModelLoads here; name the ModelLoad"), []
            if not matches:
                what = f"{namespace}/{name}" + (f" version {version}" if version else "")
                now = f" (serving {', '.join(served)})" if served else ""
                return p.error(p.NOT_SERVED, f"{what} is not served on this node{now}"), []
            offer = matches[0]
            world = len(offer.ranks) or 1
            if rank is not None and rank >= world:
                return p.error(
                    p.BAD_REQUEST, f"{offer.model_load} has {world} rank(s) here; rank {rank} does not exist"
                ), []
            sealed = offer.ranks[rank] if rank is not None and offer.ranks else offer.sealed
            sealed.lease()  # under the lock: a concurrent withdraw cannot free it between lookup and lease
            replica = next(k for k, o in self._offers.items() if o is offer)
            lease = _Lease(uuid.uuid4().hex, offer, sealed, replica, pod, rank, now_rfc3339())
            self._leases[lease.id] = lease
        leases[lease.id] = lease
        self._leases_changed()
        log.info(
            "pod %s/%s attached %s %s (lease %s)",
            pod.namespace,
            pod.name,
            offer.model_load,
            offer.version,
            lease.id[:8],
        )
        reply = {
            "ok": True,
            "lease": lease.id,
            "namespace": offer.namespace,
            "modelLoad": offer.model_load,
            "model": offer.model,
            "version": offer.version,
            "versionUid": offer.version_uid,
            "rank": rank if offer.ranks else 0,
            "ranks": world,
            **sealed.manifest(),
        }
        return reply, list(sealed.fds)


def _entry_order(entry: dict[str, Any]) -> tuple[str, str, str, int]:
    return entry["podNamespace"], entry["pod"], entry["version"], entry.get("rank", -1)


def _readable_or_closed(conn: socket.socket) -> bool:
    ready, _, _ = select.select([conn], [], [], 0)
    return bool(ready)


def _reply_and_close(conn: socket.socket, message: dict[str, Any]) -> None:
    try:
        conn.settimeout(1)
        p.send_frame(conn, message)
    except OSError:
        pass
    finally:
        conn.close()
