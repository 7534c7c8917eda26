"""The node agent's side of a multi-rank replica: rank processes (`ferry_agent.ranks.worker`) kept started by a
`RankPool` and lent to one replica's load at a time.

A rank process costs seconds to start (torch, NIXL, the API client and credentials), so the agent starts them
ahead of the loads and keeps them between loads: `RankPool.take(n)` lends idle ones first (and starts only the
ones missing), and `RankProcesses.stop` gives them back once their replica stops serving, released but still
running, for the next load. `RankPool.maintain` keeps as many idle as the node's next multi-rank load will need,
and replaces an idle one that died.

`RankProcesses.start()` opens a TCPStore for the ranks of one load to rendezvous at and hands each lent process its
`load`; `wait_loaded()` follows their events until every rank serves (or any fails, and then kills them all: a
rank that crashed leaves the others blocked in a collective, so nothing waits for the group timeout, and a process
of a failed load is never lent again); afterwards `active_leases()` and `failure()` say how the serving ranks are
doing, and `stop()` drains them and gives them back.
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
from typing import Any

from ferry.errors import LoadFailed
from ferry_agent.config import AgentConfig
from ferry_agent.ranks import DEFAULT_MAX_RANK_PROCESSES
from ferry_agent.ranks.worker import RANK_CONFIG_ENV, Job
from ferry_agent.transport.loading_source import Publish

log = logging.getLogger(__name__)

FAILED_RANKS_GRACE_S = 30.0  # after one rank fails, how long the others get to report the agreed failure
START_BACKOFF_MAX_S = 300.0  # longest wait before idle processes are started again after ones that could not start
Event = dict[str, Any]


class RanksExceedNode(RuntimeError):
    """A replica's ranks cannot run on this node (now); nothing was started for it."""


@dataclass(frozen=True)
class WorkerSettings:
    """What every rank process of this agent is started with: the agent's own settings, nothing of a replica."""

    agent_name: str
    config: AgentConfig  # handed whole to each rank process (`RANK_CONFIG_ENV`), which parses no settings itself

    def argv(self, name: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "ferry_agent.ranks.worker",
            "--agent-name",
            name,
            "--parent-pid",
            str(os.getpid()),
        ]

    def env(self) -> dict[str, str]:
        return {RANK_CONFIG_ENV: self.config.to_env()}


@dataclass(frozen=True)
class RankLaunch:
    """What the rank processes of one replica load."""

    namespace: str
    replica: str
    world_size: int
    version: str
    timeout_s: float = 3600.0

    def job(self, rank: int, store: str) -> Job:
        return Job(self.namespace, self.replica, rank, self.world_size, store, self.version, self.timeout_s)


class RankWorker:
    """One rank process. Its events go to whoever it is lent to (`lend`); while idle, only its pool watches it."""

    def __init__(self, settings: WorkerSettings, name: str, on_idle_exit: Callable[[RankWorker], None]) -> None:
        self.name = name  # its NIXL agent's
        self.rank: int | None = None  # in the last load it was lent to
        self._on_idle_exit = on_idle_exit
        env = {**os.environ, "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo"), **settings.env()}
        self.proc = subprocess.Popen(
            settings.argv(name), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.ready = threading.Event()  # started: the next `load` begins at once
        self.stopped = threading.Event()  # the load it was lent to is released, or the process is gone
        self._lock = threading.Lock()
        self._sink: Callable[[Event], None] | None = None
        self._unlent: list[Event] = []  # a failure and the exit of a process nobody borrowed yet
        self._ending = False  # let go by its pool: its exit is expected
        threading.Thread(target=self._read, name=f"ferry-{name}", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def lend(self, sink: Callable[[Event], None]) -> None:
        """Its events go to `sink` from now on (what it said while it was not lent and matters, too)."""
        with self._lock:
            self._sink = sink
            self.stopped.clear()
            missed, self._unlent = self._unlent, []
        for event in missed:
            sink(event)

    def unlend(self) -> None:
        with self._lock:
            self._sink = None

    def send(self, *lines: str) -> None:
        """Commands on its stdin; a process that is gone says so with its `exit` event, not here."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write("".join(f"{line}\n" for line in lines))
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            pass

    def end(self, timeout_s: float = 5.0) -> None:
        """Let it go: end of stdin ends an idle process; kill what does not end in time."""
        self._ending = True
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
        except (BrokenPipeError, OSError):
            pass
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()

    def kill(self) -> None:
        self._ending = True  # killed on purpose: its exit is no idle process dying
        if self.alive():
            log.warning("killing rank process %d (%s)", self.pid, self.name)
            self.proc.kill()
        self.proc.wait()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                log.warning("rank process %s printed a non-event line: %s", self.name, line.rstrip())
                continue
            if isinstance(event, dict):
                self._deliver(event)
        self._deliver({"event": "exit", "code": self.proc.wait()})

    def _deliver(self, event: Event) -> None:
        kind = event.get("event")
        if kind == "ready":
            log.info("rank process %d (%s) ready", self.pid, self.name)
            self.ready.set()
        elif kind in ("stopped", "exit"):
            self.stopped.set()
        with self._lock:
            sink = self._sink
            if sink is None and kind in ("failed", "exit"):
                self._unlent.append(event)
        if kind == "exit" and sink is None and not self._ending:
            log.warning("idle rank process %d (%s) exited with code %s", self.pid, self.name, event["code"])
            self._on_idle_exit(self)
        if sink is not None and kind not in ("ready", "stopped"):
            sink(event)


class RankPool:
    """The agent's rank processes that serve no replica now: lent to loads, given back after, replaced if one dies.
    Processes are started by the thread that calls `take` and `maintain` (the agent's reconcile loop): a rank dies
    with the thread that started it (`PR_SET_PDEATHSIG`), so that must be one that lives as long as the agent."""

    def __init__(
        self,
        settings: WorkerSettings,
        warm: int = 0,
        wake: Callable[[], None] = lambda: None,
        cap: int = DEFAULT_MAX_RANK_PROCESSES,
    ) -> None:
        if not 0 <= warm <= cap:
            raise ValueError(f"warm rank processes ({warm}) must be between 0 and the cap ({cap})")
        self.settings = settings
        self.warm = warm  # idle processes kept even when no replica of this node has several ranks
        self.cap = cap  # most processes running at once, lent and idle: whatever the replicas ask, never more
        self._wake = wake  # an idle process died: the agent's loop replaces it (`maintain`)
        self._idle: list[RankWorker] = []
        self._running: list[RankWorker] = []  # every process started and not yet exited, lent or idle
        self._lock = threading.Lock()
        self._started = 0
        self._closed = False
        # Idle processes that died before they were ready (a setting or credential they cannot start with): the
        # next ones are started only after a backoff, not in a loop that burns the node's CPU.
        self._failed_starts = 0
        self._next_start = 0.0

    def _start(self) -> RankWorker:
        self._started += 1
        worker = RankWorker(self.settings, f"{self.settings.agent_name}-w{self._started}", self._exited)
        self._running.append(worker)
        log.info("started rank process %d (%s)", worker.pid, worker.name)
        return worker

    def _lent(self) -> int:
        """Running processes lent to loads (under the lock)."""
        self._running = [w for w in self._running if w.alive()]
        return len(self._running) - sum(w in self._running for w in self._idle)

    def refusal(self, n: int) -> str | None:
        """Why a replica of `n` ranks can never run here (more ranks than the cap), or None."""
        if n > self.cap:
            return f"ranksPerReplica {n} > this node's cap {self.cap} (--max-rank-processes)"
        return None

    def check(self, n: int) -> None:
        """RanksExceedNode unless `n` processes can be lent now, beside those other loads hold."""
        with self._lock:
            self._check(n)

    def _check(self, n: int) -> None:
        if (why := self.refusal(n)) is not None:
            raise RanksExceedNode(why)
        lent = self._lent()
        if lent + n > self.cap:
            raise RanksExceedNode(
                f"ranksPerReplica {n} does not fit beside the {lent} rank processes lent now (to the loads and served "
                f"versions of this node, a served version of this replica included): this node's cap is {self.cap} "
                "(--max-rank-processes); retried with backoff"
            )

    def _exited(self, worker: RankWorker) -> None:
        with self._lock:
            if worker.ready.is_set():
                self._failed_starts = 0
            else:
                self._failed_starts += 1
                self._next_start = time.monotonic() + min(START_BACKOFF_MAX_S, 2.0**self._failed_starts)
        self._wake()

    def take(self, n: int) -> tuple[list[RankWorker], int]:
        """`n` processes for one load, by rank, and how many of them were idle. Rank r goes to an idle process that
        was rank r before where there is one (on a GPU node it keeps using `cuda:r`, instead of holding a CUDA
        context on every GPU), else to the longest idle, else to a new one. RanksExceedNode, before any process
        starts, if that would take the processes running beyond the cap."""
        with self._lock:
            self._check(n)  # the idle ones are at most the cap less the lent ones (`maintain`): n more fit
            idle = [w for w in self._idle if w.alive()]
            lent = [next((w for w in idle if w.rank == r), None) for r in range(n)]
            rest = iter([w for w in idle if w not in lent])
            lent = [w if w is not None else next(rest, None) for w in lent]
            self._idle = [w for w in idle if w not in lent]
            warm = sum(w is not None for w in lent)
            workers = [w if w is not None else self._start() for w in lent]
        for rank, worker in enumerate(workers):
            worker.rank = rank
        return workers, warm

    def give_back(self, workers: list[RankWorker]) -> None:
        """Processes whose load was released (`stopped`), ready for the next one."""
        with self._lock:
            closed = self._closed
            back = [] if closed else [w for w in workers if w.alive()]
            self._idle += back
        for worker in back:
            log.info("rank process %d (%s) is idle", worker.pid, worker.name)
        for worker in workers if closed else []:
            worker.end()

    def maintain(self, wanted: int) -> None:
        """Keep max(`warm`, `wanted`) processes idle (`wanted`: the most ranks a replica of this node has, so that
        its next version loads on started processes), starting what is missing and ending what is beyond; never
        more than the cap leaves beside the lent ones."""
        with self._lock:
            if self._closed:
                return
            self._idle = [w for w in self._idle if w.alive()]
            target = max(0, min(max(self.warm, wanted), self.cap - self._lent()))
            extra, self._idle = self._idle[target:], self._idle[:target]
            if time.monotonic() >= self._next_start:
                self._idle += [self._start() for _ in range(target - len(self._idle))]
        for worker in extra:
            worker.end()

    def idle(self) -> list[RankWorker]:
        with self._lock:
            return list(self._idle)

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.end()


def _report(callback: Callable[..., None], *args: Any) -> None:
    """Progress goes to the status; failing to write it must not fail the load."""
    try:
        callback(*args)
    except Exception as exc:
        log.warning("reporting rank progress failed: %s", exc)


def _loading_ranks(loading: Mapping[int, Mapping[str, Any]]) -> dict[str, Any] | None:
    """The replica's `loadingRanks` from what each rank published (None: no rank serves its load, or the ranks
    name different WeightVersion objects, which no reader could check)."""
    uids = {fields.get("loadingVersionUid") for fields in loading.values()}
    if not loading or len(uids) != 1:
        return None
    entries = [entry for rank in sorted(loading) for entry in loading[rank].get("loadingRanks") or ()]
    return {"loadingRanks": entries, "loadingVersionUid": uids.pop()}


def _combine(failures: Mapping[int, str]) -> str:
    """One message when the ranks agree on it (they normally do), else each rank's."""
    distinct = set(failures.values())
    if len(distinct) == 1:
        return distinct.pop()
    return "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))


class RankProcesses:
    """The rank processes of one replica's load, lent by `pool`."""

    def __init__(
        self,
        launch: RankLaunch,
        pool: RankPool,
        *,
        progress: Callable[[int, int, str], None] = lambda *_: None,
        note: Callable[[str], None] = lambda _m: None,
        wake: Callable[[], None] = lambda: None,
        loading: Publish = lambda _fields: None,
    ) -> None:
        """`loading(fields)`: the ranks that serve their load while it runs, as `status.loadingRanks` and
        `loadingVersionUid` (None: none does)."""
        self.launch = launch
        self._pool = pool
        self._progress = progress
        self._note = note
        self._wake = wake
        self._loading = loading
        self._workers: list[RankWorker] = []
        self._events: queue.Queue[tuple[int, Event] | None] = queue.Queue()
        self._leases: dict[int, int] = {}
        self._exits: dict[int, int] = {}
        self._serving = False
        self._loaded = False
        self._lock = threading.Lock()
        self._tcp: Any = None

    # ------------------------------------------------------------------ start and load

    def start(self) -> None:
        import torch.distributed as dist

        n = self.launch.world_size
        self._workers, warm = self._pool.take(n)  # first: a refusal (RanksExceedNode) starts nothing
        # Port 0: the OS picks a free one, so concurrent replicas never collide. Dropped once all ranks loaded.
        self._tcp = dist.TCPStore(
            "127.0.0.1",
            0,
            n,
            is_master=True,
            wait_for_workers=False,
            timeout=dt.timedelta(seconds=self.launch.timeout_s),
        )
        store = f"127.0.0.1:{self._tcp.port}"
        for rank, worker in enumerate(self._workers):
            worker.lend(lambda event, rank=rank: self._events.put((rank, event)))
            worker.send(f"load {self.launch.job(rank, store).to_json()}")
        log.info(
            "%s/%s: %d rank processes (pids %s; %d were started before), store %s",
            self.launch.namespace,
            self.launch.replica,
            n,
            ",".join(str(w.pid) for w in self._workers),
            warm,
            store,
        )

    def wait_loaded(self, timeout_s: float) -> list[Event]:
        """Every rank's `serving` event, by rank; LoadFailed (all ranks killed) if any rank fails."""
        n = self.launch.world_size
        serving: dict[int, Event] = {}
        failed: dict[int, Event] = {}
        progress: dict[int, tuple[int, int, str]] = {}
        loading: dict[int, dict[str, Any]] = {}  # rank -> what it published while it loads
        deadline = time.monotonic() + timeout_s
        grace_end: float | None = None
        while len(serving) < n:
            end = deadline if grace_end is None else min(deadline, grace_end)
            try:
                item = self._events.get(timeout=max(0.0, end - time.monotonic()))
            except queue.Empty:
                if not failed:
                    failed[-1] = {"message": f"the ranks did not finish loading within {timeout_s:g}s"}
                break
            if item is None:
                continue
            rank, event = item
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
            elif kind == "loading":
                if event.get("fields"):
                    loading[rank] = event["fields"]
                else:
                    loading.pop(rank, None)
                _report(self._loading, _loading_ranks(loading))
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
            if loading:  # the ranks that served their load are gone
                _report(self._loading, None)
            attempts = next((f.get("attempts") for _, f in sorted(failed.items()) if f.get("attempts")), [])
            raise LoadFailed(_combine({r: str(f["message"]) for r, f in failed.items()}), attempts)
        self._tcp = None
        with self._lock:
            self._serving = self._loaded = True
        threading.Thread(target=self._follow, name="ferry-ranks", daemon=True).start()
        return [serving[r] for r in range(n)]

    # ------------------------------------------------------------------ serving

    def _follow(self) -> None:
        """After loading: keep lease counts and exits current, waking the agent on each change."""
        while (item := self._events.get()) is not None:
            rank, event = item
            with self._lock:
                if event.get("event") == "leases":
                    self._leases[rank] = int(event["count"])
                elif event.get("event") == "exit":
                    self._exits[rank] = event["code"]
                else:
                    continue
            self._wake()

    def pid(self, rank: int) -> int:
        return self._workers[rank].pid

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
        """Release the replica: every rank drains its readers (within `drain_s`) and lets its share go, and goes
        back to the pool. Ranks that had not all loaded are killed instead (they may be blocked in a collective, or
        hold a half-loaded share), as is any that does not stop in time."""
        with self._lock:
            self._serving = False
            loaded = self._loaded
        workers, self._workers = self._workers, []
        if loaded:
            for worker in workers:
                worker.send(*([f"drain {drain_s:g}"] if drain_s > 0 else []), "stop")
            end = time.monotonic() + drain_s + 10.0
            for worker in workers:
                if not worker.stopped.wait(max(0.1, end - time.monotonic())):
                    worker.kill()
        else:
            for worker in workers:
                worker.kill()
        for worker in workers:
            worker.unlend()
        self._events.put(None)  # ends `_follow`
        self._pool.give_back([w for w in workers if w.stopped.is_set() and w.alive()])
        self._tcp = None
