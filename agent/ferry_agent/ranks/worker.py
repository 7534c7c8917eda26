"""`python -m ferry_agent.ranks.worker`: a rank process of the node agent, which lends it to one rank of one
multi-rank WeightReplica at a time.

The agent keeps such processes started (`ranks.supervisor.RankPool`): torch, the S3 model, the API client, the
worker tokens and a NIXL agent of its own are set up once, when the process starts, not per load. It says `ready`,
and then takes loads one after another, each as a `load {json}` line on stdin: which replica, which rank of how
many, the TCPStore the ranks rendezvous at. The ranks join a gloo group for that load, run the desired-version cold
start (`replica_load.load_rank`), and each then serves its share of the tensors to peers with its NIXL agent and a
worker service of that load. A CPU share lives in sealed memfd chunks of the rank's own `HostStore` (or, for a
follower of an S3 cold start, the chunks its local leader landed it in: `ranks.landing`); the `serving` event names
their descriptors, which the node agent opens through /proc to offer the share for attach.

While a rank loads, it serves the tensors it has checked (pipelined fan-out: `LoadingSource`, whose entry the agent
writes into `status.loadingRanks` from the `loading` event).

It reports to the node agent in JSON lines on stdout (`Reporter`: `ready`, `progress`, `note`, `loading`, `serving`,
`leases`, `failed`, `stopped`) and takes commands on stdin: `load JSON`, then `drain SECONDS` and `stop`, which end
the load (readers finish, the share is released) and leave the process ready for the next one. A load that fails
ends the process: its gloo group may be broken, and the agent starts a fresh one. End of stdin (the agent died or
let the process go) ends it too, releasing everything.

The node agent alone writes the WeightReplica status; a rank only reads the API, and retries those reads while
the apiserver is unreachable (a loaded rank no longer needs it at all).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import functools
import gc
import json
import logging
import os
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from ferry import s3
from ferry.kube import kube_client
from ferry_agent import logs
from ferry_agent.attach.memstore import HostStore
from ferry_agent.config import AgentConfig
from ferry_agent.kube.apiretry import bound_requests
from ferry_agent.kube.sources import ApiSources
from ferry_agent.ranks.agreement import TorchRankGroup
from ferry_agent.replica_load import load_rank, loading_source, rank_context, read_guard, serve_rank
from ferry_agent.store.checkpoints import CheckpointStore
from ferry_agent.strategies.chain import StrategyRecoveryError
from ferry_agent.transport import worker_auth
from ferry_agent.transport.nixl import NixlPeer

log = logging.getLogger("ferry.rank")
LEASE_POLL_S = 1.0
RANK_CONFIG_ENV = "FERRY_RANK_AGENT_CONFIG"  # the agent's settings (`AgentConfig`, JSON), set by the agent


class Reporter:
    """JSON-line events on stdout, one writer at a time."""

    def __init__(self, out: Any) -> None:
        self._out = out
        self._lock = threading.Lock()

    def __call__(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, **fields}, separators=(",", ":"))
        with self._lock:
            self._out.write(line + "\n")
            self._out.flush()


@dataclass(frozen=True)
class Job:
    """One load the agent lends this process to: the `load` command's JSON."""

    namespace: str  # of the WeightReplica
    replica: str
    rank: int
    world_size: int
    store: str  # HOST:PORT of the TCPStore the ranks of this load rendezvous at
    version: str  # the version this rank is configured to load; rank 0's wins, a different one is fatal
    timeout_s: float = 3600.0  # bound on every collective

    @classmethod
    def parse(cls, text: str) -> Job:
        job = cls(**json.loads(text))
        if job.world_size < 1 or not 0 <= job.rank < job.world_size:
            raise ValueError(f"rank {job.rank} is outside a world of {job.world_size}")
        return job

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))


def _parser() -> argparse.ArgumentParser:
    """Only what differs between the rank processes of one agent: every setting is the agent's (`RANK_CONFIG_ENV`)."""
    p = argparse.ArgumentParser(prog="ferry-rank", description=__doc__.splitlines()[0])
    p.add_argument("--agent-name", required=True, help="this process's NIXL agent name (unique on the node)")
    p.add_argument("--parent-pid", type=int, help="the node agent's pid: this rank ends when the agent does")
    return p


def _wait_for_commands(server: Any, stdin: Any) -> bool:
    """Serve until told to stop (True) or the agent goes away (False); `drain S` first lets readers finish."""
    stopped = False
    for line in stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "drain":
            try:
                server.drain(float(arg or 10))
            except TimeoutError:
                log.warning("readers still active after %ss; stopping anyway", arg)
        elif command == "stop":
            stopped = True
            break
        elif command:
            log.warning("unknown command %r while serving", command)
    server.stop()
    return stopped


def _watch_leases(server: Any, report: Reporter, stop: threading.Event) -> None:
    published = 0
    while not stop.wait(LEASE_POLL_S):
        count = server.leases.active_count()
        if count != published:
            report("leases", count=count)
            published = count


class RankProcess:
    """What a rank process keeps from one load to the next: the API client and worker credentials, the node's
    checkpoint store, its NIXL agent and its host memory."""

    def __init__(self, agent_name: str, config: AgentConfig, report: Reporter) -> None:
        # The S3 model parsed while the process starts (NIXL, the API), not when a cold start needs S3.
        threading.Thread(target=s3.prewarm, name="ferry-s3-prewarm", daemon=True).start()
        self.agent_name = agent_name
        self.config = config
        self.report = report
        self.api = bound_requests(kube_client())
        try:
            self.tokens, self.auth = worker_auth.from_arguments(config, self.api, config.node)
        except ValueError as exc:
            raise SystemExit(f"ferry-rank: {exc}") from exc
        self.store = None
        if config.checkpoint_dir:
            self.store = CheckpointStore(config.checkpoint_dir, int(config.checkpoint_quota_gib * 2**30))
        self.peer = NixlPeer(agent_name)
        self.host = HostStore()  # the shares this process serves, on `cpu`: sealed memfd chunks the agent adopts

    def serve(self, job: Job, stdin: Any) -> bool | None:
        """Load `job`'s rank and serve it until told to stop. None: the load failed (reported); else whether the
        process goes on (False: stdin ended)."""
        config, report = self.config, self.report
        _log_as(self.agent_name, config, job)
        sources = ApiSources(
            self.api, job.namespace, ambient=config.ambient_credentials, s3_endpoint=config.s3_endpoint
        )
        spec = sources.replica(job.replica)["spec"]
        host, _, port = job.store.rpartition(":")
        timeout = dt.timedelta(seconds=job.timeout_s)
        tcp = dist.TCPStore(host, int(port), job.world_size, is_master=False, timeout=timeout)
        group = TorchRankGroup.init(rank=job.rank, world_size=job.world_size, store=tcp, timeout=timeout)

        def progress(done: int, total: int, source: str) -> None:
            report("progress", done=done, total=total, source=source)

        ctx = rank_context(group, job.replica, spec)
        key = (job.namespace, job.replica)
        label = f"{job.namespace}/{spec['modelName']}/{job.version}#{job.rank}"
        sealed = None
        serving = loading_source(
            self.peer,
            ctx,
            auth=self.auth,
            namespace=job.namespace,
            version=job.version,
            spec=spec,
            sources=sources,
            host=config.bind_address,
            publish=lambda fields: report("loading", fields=fields),
        )
        try:
            result = load_rank(
                group,
                ctx,
                sources=sources,
                spec=spec,
                configured=job.version or None,
                peer=self.peer,
                store=self.store,
                s3_endpoint=config.s3_endpoint,
                download_workers=config.s3_download_workers,
                seeds=config.seeds,
                progress=progress,
                note=lambda text: report("note", message=text),
                credentials=self.tokens,
                allocate=self.host.allocator(key, label),
                map_sealed=functools.partial(self.host.map_sealed, key),
                serving=serving,
            )
            serving.close()  # before the seal: no reader may hold the writable pages
            memory = None
            if result.resident.host is not None:
                # The READ's registration goes first: sealing needs no pinned, writable pages.
                self.peer.deregister(result.resident)
                sealed = self.host.seal(result.resident, label, ctx.version, ctx.version_uid)
                memory = {
                    "fds": sealed.fds,
                    "chunks": sealed.chunk_sizes,
                    "tensors": [{**e.to_json(), "sha256": e.sha256} for e in sealed.entries],
                }
        except Exception as exc:
            fatal = isinstance(exc, StrategyRecoveryError)
            log.error("rank %d of %s: load failed%s: %s", job.rank, job.replica, " (fatal)" if fatal else "", exc)
            report("failed", message=str(exc), fatal=fatal, attempts=[a.to_status() for a in ctx.attempts])
            return None
        finally:
            serving.close()
            group.close()
        server, entry = serve_rank(
            result.resident,
            self.peer,
            rank=job.rank,
            host=config.bind_address,
            spec=spec,
            guard=read_guard(self.auth, job.namespace, ctx),
        )
        report(
            "serving",
            rank=job.rank,
            version=ctx.version,
            source=result.source_label,
            bytes=result.bytes_moved,
            entry=entry,
            attempts=[a.to_status() for a in ctx.attempts],
            version_uid=ctx.version_uid,
            memory=memory,
        )
        stop = threading.Event()
        threading.Thread(target=_watch_leases, args=(server, report, stop), daemon=True).start()
        try:
            return _wait_for_commands(server, stdin)
        finally:
            stop.set()
            self.peer.deregister(result.resident)
            if sealed is not None:  # this process's hold; the agent's (and attached pods') may keep the pages
                sealed.unref()


def run(agent_name: str, config: AgentConfig, report: Reporter, stdin: Any) -> int:
    me = RankProcess(agent_name, config, report)
    report("ready", agent=me.peer.name)
    try:
        for line in stdin:
            command, _, arg = line.strip().partition(" ")
            if command == "load":
                job = Job.parse(arg)
                try:
                    going_on = me.serve(job, stdin)
                except Exception as exc:  # around the load (API, rendezvous): say why, not just "exit 1"
                    log.exception("rank %d of %s failed", job.rank, job.replica)
                    report("failed", message=f"rank {job.rank}: {type(exc).__name__}: {exc}", fatal=False, attempts=[])
                    return 1
                if going_on is None:
                    return 1
                gc.collect()  # what the load held (its share's mappings, the worker service) goes now, not later
                if torch.cuda.is_initialized():
                    torch.cuda.empty_cache()  # a GPU share's memory goes back to the device, not to a cache of ours
                _log_as(agent_name, config)
                report("stopped", rank=job.rank)
                if not going_on:
                    break
            elif command in ("drain", "stop"):
                continue  # nothing is served: nothing to drain or stop
            elif command:
                log.warning("unknown command %r", command)
    finally:
        me.peer.shutdown()
    return 0


def _log_as(agent_name: str, config: AgentConfig, job: Job | None = None) -> None:
    """Log lines say which load they belong to, if any."""
    if job is None:
        logs.configure(config.log_format, stream=sys.stderr, prefix=f"{agent_name} ")
        return
    logs.configure(
        config.log_format,
        stream=sys.stderr,
        prefix=f"rank{job.rank}/{job.world_size} ",
        replica=f"{job.namespace}/{job.replica}",
        rank=job.rank,
    )


def _die_with(parent_pid: int | None) -> None:
    """A rank outlives no agent, even one killed with SIGKILL mid-load (the agent holds the replica's Lease)."""
    if parent_pid is None or sys.platform != "linux":
        return
    import ctypes

    PR_SET_PDEATHSIG = 1
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:  # the agent died before the line above took effect
        raise SystemExit(f"the agent (pid {parent_pid}) is gone")


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    _die_with(args.parent_pid)
    config = AgentConfig.from_env(os.environ[RANK_CONFIG_ENV])
    _log_as(args.agent_name, config)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks of a replica share one node
    # Events keep the original stdout to themselves; anything else printed there (NIXL logs to stdout, C++
    # libraries write to fd 1) goes to stderr with the logs.
    events = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    report = Reporter(events)
    try:
        code = run(args.agent_name, config, report, sys.stdin)
    except Exception as exc:  # while the process starts (API, credentials, store): say why, not just "exit 1"
        log.exception("rank process %s failed", args.agent_name)
        report("failed", message=f"{type(exc).__name__}: {exc}", fatal=False, attempts=[])
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
