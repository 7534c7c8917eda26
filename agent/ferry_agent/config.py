"""Node agent settings: one `AgentConfig`, from the command line, each flag defaulting to its environment variable
where it has one (the chart sets those from the downward API and its values). `python -m ferry_agent --help`
lists them all."""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ferry import ambient
from ferry_agent.attach.memstore import parse_bytes
from ferry_agent.attach.server import DEFAULT_ATTACH_CONNECTIONS_PER_POD
from ferry_agent.kube.registry import DEFAULT_LEASE_SECONDS
from ferry_agent.logs import LogFormat
from ferry_agent.ranks import DEFAULT_MAX_RANK_PROCESSES
from ferry_agent.strategies.local_file import SeedKey, seed_argument
from ferry_agent.transport import worker_auth


@dataclass(frozen=True)
class AgentConfig:
    node: str  # this node's name: the agent loads the WeightReplicas with spec.nodeName == node
    seeds: dict[SeedKey, Path]  # local safetensors files that hold these versions (the LocalFile strategy)
    lease_seconds: int  # duration of each replica's Lease; renewed every third of it
    poll_seconds: float  # resync period; watch events act at once
    retry_seconds: float  # first backoff after a failed load (doubling, at most 300 s)
    bind_address: str  # where peers reach this agent's worker services, and the metrics
    checkpoint_dir: Path  # the node's checkpoint store (ObjectStorage loads)
    checkpoint_quota_gib: float
    s3_endpoint: str | None  # for WeightVersions that name none
    s3_download_workers: int  # ranged GETs an ObjectStorage load runs at once
    ambient: ambient.AmbientPolicy  # where the agent's own S3 credentials may be used (versions without a Secret)
    metrics_port: int  # -1 = off, 0 = any free port
    rank_timeout_seconds: float  # bound on each agreement step of a multi-rank replica
    warm_ranks: int  # rank processes kept started and idle even when no replica of this node has several ranks
    max_rank_processes: int  # most rank processes running at once, lent and idle; a replica beyond it is refused
    socket_dir: str  # attach sockets under DIR/pods/<pod-uid>/; "" = no attach
    attach_connections_per_pod: int  # open attach connections one pod may hold at once
    host_memory_budget: int | None  # bytes the resident versions may take; None = unlimited
    log_format: LogFormat
    # Who this agent is as a reader (its worker tokens are bound to this Pod) and whom its worker services admit.
    pod_namespace: str | None
    service_account: str | None
    pod_name: str | None
    pod_uid: str | None
    worker_allowed_identity: tuple[str, ...]  # empty: this agent's own ServiceAccount

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None) -> AgentConfig:
        parser = argument_parser()
        args = parser.parse_args(argv)
        if not args.node:
            parser.error("--node (or NODE_NAME) is required")
        if args.warm_ranks > args.max_rank_processes:
            parser.error(f"--warm-ranks {args.warm_ranks} is more than --max-rank-processes {args.max_rank_processes}")
        return cls(
            node=args.node,
            seeds=dict(args.seed),
            lease_seconds=args.lease_seconds,
            poll_seconds=args.poll_seconds,
            retry_seconds=args.retry_seconds,
            bind_address=args.bind_address,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_quota_gib=args.checkpoint_quota_gib,
            s3_endpoint=args.s3_endpoint,
            s3_download_workers=args.s3_download_workers,
            ambient=args.ambient_credentials,
            metrics_port=args.metrics_port,
            rank_timeout_seconds=args.rank_timeout_seconds,
            warm_ranks=args.warm_ranks,
            max_rank_processes=args.max_rank_processes,
            socket_dir=args.socket_dir,
            attach_connections_per_pod=args.attach_connections_per_pod,
            host_memory_budget=args.host_memory_budget,
            log_format=LogFormat(args.log_format),
            pod_namespace=args.pod_namespace,
            service_account=args.service_account,
            pod_name=args.pod_name,
            pod_uid=args.pod_uid,
            worker_allowed_identity=tuple(args.worker_allowed_identity),
        )


def argument_parser() -> argparse.ArgumentParser:
    """The agent's flags, each with its help text and, where it has one, its environment variable."""
    parser = argparse.ArgumentParser(
        prog="ferry-agent",
        description="The Ferry node agent (one per GPU node): loads the WeightReplicas assigned to this node and "
        "serves them to peers and to the node's pods.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--node", default=os.environ.get("NODE_NAME"), help="this node's name (env NODE_NAME)")
    parser.add_argument(
        "--seed",
        type=seed_argument,
        action="append",
        default=[],
        metavar="NAMESPACE/MODEL/VERSION=PATH",
        help="a local safetensors file that holds that WeightVersion; repeatable",
    )
    parser.add_argument(
        "--lease-seconds",
        type=int,
        default=DEFAULT_LEASE_SECONDS,
        help="duration of each served replica's Lease, renewed every third of it; a replica whose Lease lapses is "
        "no longer a source",
    )
    parser.add_argument(
        "--poll-seconds",
        type=float,
        default=10.0,
        help="resync period; changes to this node's WeightReplicas are watched and act at once",
    )
    parser.add_argument(
        "--bind-address",
        default=os.environ.get("POD_IP", "127.0.0.1"),
        help="address peers reach this agent's worker service on (env POD_IP)",
    )
    parser.add_argument(
        "--checkpoint-dir",
        type=Path,
        default=Path(os.environ.get("FERRY_CHECKPOINT_DIR", "/var/lib/ferry/checkpoints")),
        help="local checkpoint store for the ObjectStorage strategy (env FERRY_CHECKPOINT_DIR)",
    )
    parser.add_argument(
        "--checkpoint-quota-gib",
        type=float,
        default=500.0,
        help="most the checkpoint store may hold; older artifacts of inactive chains are evicted first",
    )
    parser.add_argument(
        "--s3-endpoint",
        default=os.environ.get("FERRY_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL"),
        help="S3 endpoint for versions that name none (env FERRY_S3_ENDPOINT, else AWS_ENDPOINT_URL)",
    )
    parser.add_argument(
        "--s3-download-workers",
        type=int,
        default=int(os.environ.get("FERRY_S3_DOWNLOAD_WORKERS", "8")),
        help="ranged GETs an object-storage load (on every rank) runs at once (env FERRY_S3_DOWNLOAD_WORKERS)",
    )
    add_ambient_argument(parser)
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=int(os.environ.get("FERRY_AGENT_METRICS_PORT", "-1")),
        help="serve Prometheus metrics on this port (env FERRY_AGENT_METRICS_PORT; -1 = off)",
    )
    parser.add_argument(
        "--retry-seconds",
        type=float,
        default=5.0,
        help="first backoff after a failed load; it doubles with each failure of the same version, up to 300 s",
    )
    parser.add_argument(
        "--rank-timeout-seconds",
        type=float,
        default=3600.0,
        help="bound on each agreement step of a multi-rank replica (the other ranks wait in one while the first "
        "replays the chain from S3); a rank process that dies is noticed at once",
    )
    parser.add_argument(
        "--warm-ranks",
        type=int,
        default=int(os.environ.get("FERRY_WARM_RANKS", "0")),
        help="rank processes started with the agent and kept idle for multi-rank replicas (env FERRY_WARM_RANKS); "
        "besides, as many stay idle as the largest multi-rank replica of this node has ranks, so that its next "
        "version loads on processes already started",
    )
    parser.add_argument(
        "--max-rank-processes",
        type=_positive,
        default=os.environ.get("FERRY_MAX_RANK_PROCESSES", str(DEFAULT_MAX_RANK_PROCESSES)),
        help="most rank processes the agent runs at once, lent and idle (env FERRY_MAX_RANK_PROCESSES): a replica "
        "of more ranks fails with RanksExceedNode before any starts, as does one of more than the cap leaves beside "
        "the other replicas' ranks (retried with the load backoff); a CUDA replica also needs a GPU per rank. A "
        "replica that loads its next version beside the serving one holds twice its ranks meanwhile",
    )
    parser.add_argument(
        "--socket-dir",
        default=os.environ.get("FERRY_AGENT_SOCKET_DIR", "/run/ferry"),
        help="serve attach sockets at DIR/pods/<pod-uid>/ferry.sock to this node's pods "
        "(env FERRY_AGENT_SOCKET_DIR; empty = off)",
    )
    parser.add_argument(
        "--attach-connections-per-pod",
        type=_positive,
        default=os.environ.get("FERRY_AGENT_ATTACH_CONNECTIONS_PER_POD", str(DEFAULT_ATTACH_CONNECTIONS_PER_POD)),
        help="most attach connections one pod may hold open at once (env FERRY_AGENT_ATTACH_CONNECTIONS_PER_POD); "
        "an engine holds one per worker process plus its refit and sidecar connections (TP 8 + refit + sidecar: 10 "
        "to 17), a connection beyond the cap is refused",
    )
    parser.add_argument(
        "--host-memory-budget",
        type=_budget,
        default=os.environ.get("FERRY_AGENT_HOST_MEMORY_BUDGET", ""),
        metavar="BYTES",
        help="most host memory the resident versions of this node may take, e.g. 64Gi (env "
        "FERRY_AGENT_HOST_MEMORY_BUDGET; empty = unlimited); a load beyond it fails with MemoryBudgetExceeded",
    )
    parser.add_argument(
        "--log-format",
        choices=[str(f) for f in LogFormat],
        default=os.environ.get("FERRY_AGENT_LOG_FORMAT", LogFormat.PLAIN),
        help="plain text, or one JSON object a line (env FERRY_AGENT_LOG_FORMAT)",
    )
    worker_auth.add_arguments(parser)
    return parser


def add_ambient_argument(parser: argparse.ArgumentParser) -> None:
    """`--ambient-credentials`, the agent's and its rank processes' (the operator reads the same JSON)."""
    parser.add_argument(
        "--ambient-credentials",
        type=_ambient,
        default=os.environ.get(ambient.ENV, ""),
        metavar="JSON",
        help=f"rules that let WeightVersions without a credentialsSecret use this agent's own S3 credentials, per "
        f"namespace, bucket/prefix and endpoint (env {ambient.ENV}; ferry/ambient.py); empty: none may",
    )


def _ambient(text: str) -> ambient.AmbientPolicy:
    try:
        return ambient.AmbientPolicy.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _budget(text: str) -> int | None:
    if not text.strip():
        return None
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc
