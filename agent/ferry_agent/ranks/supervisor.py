"""The node agent's side of a multi-rank replica: one `ferry_agent.ranks.worker` process per rank.

`RankProcesses.start()` opens a TCPStore for the ranks to rendezvous at and starts them; `wait_loaded()` follows
their events until every rank serves (or any fails, and then stops them all: a rank that crashed leaves the
others blocked in a collective, so nothing waits for the group timeout); afterwards `active_leases()` and
`failure()` say how the serving ranks are doing, and `stop()` drains and ends them.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ferry_agent.strategies.local_file import SeedKey

from ferry.errors import LoadFailed
from ferry_agent.transport.worker_auth import PodIdentity

log = logging.getLogger(__name__)

FAILED_RANKS_GRACE_S = 30.0  # after one rank fails, how long the others get to report the agreed failure


@dataclass(frozen=True)
class RankLaunch:
    """What every rank process of one replica is started with."""

    namespace: str
    replica: str
    world_size: int
    version: str
    agent_name: str
    bind_address: str = "127.0.0.1"
    checkpoint_dir: Path | None = None
    checkpoint_quota_gib: float = 500.0
    s3_endpoint: str | None = None
    seeds: Mapping[SeedKey, Path] | None = None
    timeout_s: float = 3600.0
    node: str = ""  # the agent's node: the ranks' worker services accept tokens for its audience
    reader: PodIdentity | None = None  # whom the ranks mint their worker tokens as; None: their env's
    worker_allowed_identities: tuple[str, ...] = ()
    log_format: str = "plain"  # `logs.LogFormat`: the agent's

    def argv(self, rank: int, store: str) -> list[str]:
        args = [
            sys.executable,
            "-m",
            "ferry_agent.ranks.worker",
            "--namespace",
            self.namespace,
            "--replica",
            self.replica,
            "--rank",
            str(rank),
            "--world-size",
            str(self.world_size),
            "--store",
            store,
            "--desired-version",
            self.version,
            "--agent-name",
            self.agent_name,
            "--bind-address",
            self.bind_address,
            "--timeout-seconds",
            str(self.timeout_s),
            "--checkpoint-quota-gib",
            str(self.checkpoint_quota_gib),
            "--parent-pid",
            str(os.getpid()),
            "--log-format",
            str(self.log_format),
        ]
        if self.checkpoint_dir is not None:
            args += ["--checkpoint-dir", str(self.checkpoint_dir)]
        if self.s3_endpoint:
            args += ["--s3-endpoint", self.s3_endpoint]
        for key, path in (self.seeds or {}).items():
            args += ["--seed", f"{key}={path}"]
        if self.node:
            args += ["--node", self.node]
        if self.reader is not None:
            me = self.reader
            args += [
                "--pod-namespace",
                me.namespace,
                "--service-account",
                me.service_account,
                "--pod-name",
                me.pod_name,
                "--pod-uid",
                me.pod_uid,
            ]
        for identity in self.worker_allowed_identities:
            args += ["--worker-allowed-identity", identity]
        return args


def _report(callback: Callable[..., None], *args: Any) -> None:
    """Progress goes to the status; failing to write it must not fail the load."""
    try:
        callback(*args)
    except Exception as exc:
        log.warning("reporting rank progress failed: %s", exc)


def _combine(failures: Mapping[int, str]) -> str:
    """One message when the ranks agree on it (they normally do), else each rank's."""
    distinct = set(failures.values())
    if len(distinct) == 1:
        return distinct.pop()
    return "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))


class RankProcesses:
    def __init__(
        self,
        launch: RankLaunch,
        *,
        progress: Callable[[int, int, str], None] = lambda *_: None,
        note: Callable[[str], None] = lambda _m: None,
        wake: Callable[[], None] = lambda: None,
    ) -> None:
        self.launch = launch
        self._progress = progress
        self._note = note
        self._wake = wake
        self._procs: list[subprocess.Popen[str]] = []
        self._events: queue.Queue[tuple[int, dict[str, Any]]] = queue.Queue()
        self._leases: dict[int, int] = {}
        self._exits: dict[int, int] = {}
        self._serving = False
        self._lock = threading.Lock()
        self._tcp: Any = None

    # ------------------------------------------------------------------ start and load

    def start(self) -> None:
        import torch.distributed as dist

        n = self.launch.world_size
        # Port 0: the OS picks a free one, so concurrent replicas never collide. Closed once all ranks loaded.
        self._tcp = dist.TCPStore(
            "127.0.0.1",
            0,
            n,
            is_master=True,
            wait_for_workers=False,
            timeout=dt.timedelta(seconds=self.launch.timeout_s),
        )
        store = f"127.0.0.1:{self._tcp.port}"
        env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}
        for rank in range(n):
            proc = subprocess.Popen(
                self.launch.argv(rank, store),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=env,
            )
            self._procs.append(proc)
            threading.Thread(target=self._read, args=(rank, proc), name=f"ferry-rank{rank}", daemon=True).start()
        log.info("%s/%s: started %d rank processes (store %s)", self.launch.namespace, self.launch.replica, n, store)

    def _read(self, rank: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                log.warning("rank %d printed a non-event line: %s", rank, line.rstrip())
                continue
            if isinstance(event, dict):
                self._events.put((rank, event))
        self._events.put((rank, {"event": "exit", "code": proc.wait()}))

    def wait_loaded(self, timeout_s: float) -> list[dict[str, Any]]:
        """Every rank's `serving` event, by rank; LoadFailed (all ranks stopped) if any rank fails."""
        n = self.launch.world_size
        serving: dict[int, dict[str, Any]] = {}
        failed: dict[int, dict[str, Any]] = {}
        progress: dict[int, tuple[int, int, str]] = {}
        deadline = time.monotonic() + timeout_s
        grace_end: float | None = None
        while len(serving) < n:
            end = deadline if grace_end is None else min(deadline, grace_end)
            try:
                rank, event = self._events.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                if not failed:
                    failed[-1] = {"message": f"the ranks did not finish loading within {timeout_s:g}s"}
                break
            kind = event.get("event")
            if kind == "progress":
                progress[rank] = (int(event["done"]), int(event["total"]), str(event["source"]))
                _report(
                    self._progress,
                    sum(p[0] for p in progress.values()),
                    sum(p[1] for p in progress.values()),
                    progress[min(progress)][2],
                )
            elif kind == "note":
                _report(self._note, str(event.get("message", "")))
            elif kind == "serving":
                serving[rank] = event
            elif kind == "leases":
                self._leases[rank] = int(event["count"])
            elif kind == "failed":
                failed[rank] = event
                grace_end = grace_end or time.monotonic() + FAILED_RANKS_GRACE_S
                if len(failed) + len(serving) == n:
                    break
            elif kind == "exit":
                self._exits[rank] = event["code"]
                if rank not in failed:
                    failed[rank] = {"message": f"rank {rank} exited with code {event['code']} before it loaded"}
                    break  # the other ranks are blocked in a collective with it: stop them now
        if failed:
            self.stop(drain_s=0)
            attempts = next((f.get("attempts") for _, f in sorted(failed.items()) if f.get("attempts")), [])
            raise LoadFailed(_combine({r: str(f["message"]) for r, f in failed.items()}), attempts)
        self._tcp = None
        with self._lock:
            self._serving = True
        threading.Thread(target=self._follow, name="ferry-ranks", daemon=True).start()
        return [serving[r] for r in range(n)]

    # ------------------------------------------------------------------ serving

    def _follow(self) -> None:
        """After loading: keep lease counts and exits current, waking the agent on each change."""
        while True:
            rank, event = self._events.get()
            with self._lock:
                if event.get("event") == "leases":
                    self._leases[rank] = int(event["count"])
                elif event.get("event") == "exit":
                    self._exits[rank] = event["code"]
                    if len(self._exits) == len(self._procs):
                        self._wake()
                        return
                else:
                    continue
            self._wake()

    def pid(self, rank: int) -> int:
        return self._procs[rank].pid

    def active_leases(self) -> int:
        with self._lock:
            return sum(self._leases.values())

    def failure(self) -> str | None:
        """Why the replica no longer serves: a rank process that ended on its own."""
        with self._lock:
            if not self._serving or not self._exits:
                return None
            rank, code = min(self._exits.items())
            return f"rank {rank} of {self.launch.replica} exited with code {code} while serving"

    def stop(self, drain_s: float = 10.0) -> None:
        """Drain every rank (readers finish, within `drain_s`), then end them; kill what does not end."""
        with self._lock:
            self._serving = False
        for proc in self._procs:
            if proc.poll() is None and proc.stdin is not None:
                try:
                    if drain_s > 0:
                        proc.stdin.write(f"drain {drain_s:g}\n")
                    proc.stdin.write("stop\n")
                    proc.stdin.close()
                except (BrokenPipeError, OSError):
                    pass
        end = time.monotonic() + drain_s + 10.0
        for proc in self._procs:
            try:
                proc.wait(timeout=max(0.1, end - time.monotonic()) if drain_s > 0 else 2.0)
            except subprocess.TimeoutExpired:
                log.warning("rank process %d did not stop; killing it", proc.pid)
                proc.kill()
                proc.wait()
        self._tcp = None
