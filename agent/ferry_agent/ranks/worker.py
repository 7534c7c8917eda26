"""`python -m ferry_agent.ranks.worker`: one rank of a multi-rank WeightReplica, as its own process.

The node agent starts one per rank (one per GPU) with a shared TCPStore address; the ranks join a gloo group,
run the desired-version cold start (`replica_load.load_rank`), and each then serves its share of the tensors
to peers with its own NIXL agent and worker service. A CPU share lives in sealed memfd chunks of the rank's own
`HostStore`; the `serving` event names their descriptors, which the node agent opens through /proc to offer the
share for attach. It reports to the node agent in JSON lines on stdout
(`Reporter`) and takes commands on stdin: `drain SECONDS`, `stop`. End of stdin (the agent died) stops it
too, releasing everything: the lease-holding node agent is gone, so no reader may keep reading.

The node agent alone writes the WeightReplica status; a rank only reads the API, and retries those reads while
the apiserver is unreachable (a loaded rank no longer needs it at all).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ferry import s3
from ferry.kube import kube_client
from ferry_agent import logs
from ferry_agent.attach.memstore import HostStore
from ferry_agent.kube.apiretry import bound_requests
from ferry_agent.kube.sources import ApiSources
from ferry_agent.logs import LogFormat
from ferry_agent.ranks.agreement import TorchRankGroup
from ferry_agent.replica_load import load_rank, rank_context, read_guard, serve_rank
from ferry_agent.store.checkpoints import CheckpointStore
from ferry_agent.strategies.chain import StrategyRecoveryError
from ferry_agent.strategies.local_file import seed_argument
from ferry_agent.transport import worker_auth
from ferry_agent.transport.nixl import NixlPeer

log = logging.getLogger("ferry.rank")
LEASE_POLL_S = 1.0


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


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ferry-rank", description=__doc__.splitlines()[0])
    p.add_argument("--namespace", required=True, help="the namespace of the WeightReplica")
    p.add_argument("--replica", required=True, help="the WeightReplica this rank belongs to")
    p.add_argument("--rank", type=int, required=True, help="this rank, from 0")
    p.add_argument("--world-size", type=int, required=True, help="the replica's number of ranks")
    p.add_argument("--store", required=True, metavar="HOST:PORT", help="the TCPStore the ranks rendezvous at")
    p.add_argument(
        "--desired-version",
        default=os.environ.get("FERRY_DESIRED_VERSION", ""),
        help="the version this rank is configured to load; rank 0's wins, a different one is fatal",
    )
    p.add_argument("--agent-name", required=True, help="prefix of this rank's NIXL agent name")
    p.add_argument("--bind-address", default="127.0.0.1", help="address peers reach this rank's worker service on")
    p.add_argument("--checkpoint-dir", type=Path, help="the node's checkpoint store (shared by its ranks)")
    p.add_argument("--checkpoint-quota-gib", type=float, default=500.0, help="most the checkpoint store may hold")
    p.add_argument("--s3-endpoint", help="S3 endpoint for versions that name none")
    p.add_argument(
        "--seed",
        type=seed_argument,
        action="append",
        default=[],
        metavar="NAMESPACE/MODEL/VERSION=PATH",
        help="a local safetensors file that holds that WeightVersion; repeatable",
    )
    p.add_argument(
        "--log-format",
        choices=[str(f) for f in LogFormat],
        default=LogFormat.PLAIN,
        help="plain text, or one JSON object a line (the agent passes its own)",
    )
    p.add_argument("--timeout-seconds", type=float, default=3600.0, help="bound on every collective")
    p.add_argument("--parent-pid", type=int, help="the node agent's pid: this rank ends when the agent does")
    p.add_argument("--node", default=os.environ.get("NODE_NAME"), help="this rank's node (env NODE_NAME)")
    worker_auth.add_arguments(p)
    return p


def _wait_for_commands(server: Any, stdin: Any) -> None:
    """Serve until told to stop (or the agent goes away); `drain S` first lets readers finish."""
    for line in stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "drain":
            try:
                server.drain(float(arg or 10))
            except TimeoutError:
                log.warning("readers still active after %ss; stopping anyway", arg)
        elif command == "stop":
            break
        elif command:
            log.warning("unknown command %r", command)
    server.stop()


def _watch_leases(server: Any, report: Reporter, stop: threading.Event) -> None:
    published = 0
    while not stop.wait(LEASE_POLL_S):
        count = server.leases.active_count()
        if count != published:
            report("leases", count=count)
            published = count


def run(args: argparse.Namespace, report: Reporter, stdin: Any) -> int:
    if args.world_size < 1 or not 0 <= args.rank < args.world_size:
        raise SystemExit(f"rank {args.rank} is outside a world of {args.world_size}")
    if not args.node:
        raise SystemExit("--node (or NODE_NAME) is required")
    # The S3 model parsed while the rank starts (NIXL, the API, the rendezvous), not when its cold start needs S3.
    threading.Thread(target=s3.prewarm, name="ferry-s3-prewarm", daemon=True).start()
    api = bound_requests(kube_client())
    try:
        tokens, auth = worker_auth.from_arguments(args, api, args.node)
    except ValueError as exc:
        raise SystemExit(f"ferry-rank: {exc}") from exc
    sources = ApiSources(api, args.namespace)
    spec = sources.replica(args.replica)["spec"]
    store = None
    if args.checkpoint_dir:
        store = CheckpointStore(args.checkpoint_dir, int(args.checkpoint_quota_gib * 2**30))
    peer = NixlPeer(f"{args.agent_name}-r{args.rank}")
    host, _, port = args.store.rpartition(":")
    tcp = dist.TCPStore(
        host, int(port), args.world_size, is_master=False, timeout=dt.timedelta(seconds=args.timeout_seconds)
    )
    group = TorchRankGroup.init(
        rank=args.rank, world_size=args.world_size, store=tcp, timeout=dt.timedelta(seconds=args.timeout_seconds)
    )

    def progress(done: int, total: int, source: str) -> None:
        report("progress", done=done, total=total, source=source)

    ctx = rank_context(group, args.replica, spec)
    host = HostStore()  # this rank's share, on `cpu`: sealed memfd chunks the node agent adopts for attach
    label = f"{args.namespace}/{spec['modelName']}/{args.desired_version}#{args.rank}"
    try:
        result = load_rank(
            group,
            ctx,
            sources=sources,
            spec=spec,
            configured=args.desired_version or None,
            peer=peer,
            store=store,
            s3_endpoint=args.s3_endpoint,
            seeds=dict(args.seed),
            progress=progress,
            note=lambda text: report("note", message=text),
            credentials=tokens,
            allocate=host.allocator((args.namespace, args.replica), label),
        )
        memory = None
        if result.resident.host is not None:
            peer.deregister(result.resident)  # the READ's registration: sealing needs no pinned, writable pages
            sealed = host.seal(result.resident, label, ctx.version, ctx.version_uid)
            memory = {
                "fds": sealed.fds,
                "chunks": sealed.chunk_sizes,
                "tensors": [{**e.to_json(), "sha256": e.sha256} for e in sealed.entries],
            }
    except Exception as exc:
        fatal = isinstance(exc, StrategyRecoveryError)
        log.error("rank %d of %s: load failed%s: %s", args.rank, args.replica, " (fatal)" if fatal else "", exc)
        report("failed", message=str(exc), fatal=fatal, attempts=[a.to_status() for a in ctx.attempts])
        peer.shutdown()
        return 1
    finally:
        group.close()
    server, entry = serve_rank(
        result.resident,
        peer,
        rank=args.rank,
        host=args.bind_address,
        spec=spec,
        guard=read_guard(auth, args.namespace, ctx),
    )
    report(
        "serving",
        rank=args.rank,
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
        _wait_for_commands(server, stdin)
    finally:
        stop.set()
        peer.deregister(result.resident)
        peer.shutdown()
    report("stopped", rank=args.rank)
    return 0


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
    logs.configure(
        LogFormat(args.log_format),
        stream=sys.stderr,
        prefix=f"rank{args.rank}/{args.world_size} ",
        replica=f"{args.namespace}/{args.replica}",
        rank=args.rank,
    )
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks of a replica share one node
    # Events keep the original stdout to themselves; anything else printed there (NIXL logs to stdout, C++
    # libraries write to fd 1) goes to stderr with the logs.
    events = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    report = Reporter(events)
    try:
        code = run(args, report, sys.stdin)
    except Exception as exc:  # before or around the load (API, store, rendezvous): say why, not just "exit 1"
        log.exception("rank %d of %s failed", args.rank, args.replica)
        report("failed", message=f"rank {args.rank}: {type(exc).__name__}: {exc}", fatal=False, attempts=[])
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
