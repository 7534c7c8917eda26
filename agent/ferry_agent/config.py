"""Node agent settings: one `AgentConfig`, declared once (`ferry.settings`): each setting from its flag, else its
environment variable where it has one (the chart sets those from the downward API and its values), else its
default. `python -m ferry_agent --help` lists them all; the rank processes get the agent's own (`to_env`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, BeforeValidator, Field, PlainSerializer, model_validator

from ferry import ambient
from ferry.settings import Settings, setting
from ferry_agent.attach.memstore import parse_bytes
from ferry_agent.attach.server import DEFAULT_ATTACH_CONNECTIONS_PER_POD
from ferry_agent.kube.registry import DEFAULT_LEASE_SECONDS
from ferry_agent.logs import LogFormat
from ferry_agent.ranks import DEFAULT_MAX_RANK_PROCESSES
from ferry_agent.strategies.local_file import SeedKey, parse_seed


def _positive(value: Any) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if number < 1:
        raise ValueError(f"{value!r} is not a positive integer")
    return number


def _budget(value: Any) -> int | None:
    if not isinstance(value, str):
        return value
    return parse_bytes(value) if value.strip() else None


def _ambient(value: Any) -> ambient.AmbientPolicy:
    return value if isinstance(value, ambient.AmbientPolicy) else ambient.AmbientPolicy.parse(value)


def _seed(text: str) -> str:
    _, path = parse_seed(text)
    if not path.is_file():
        raise ValueError(f"seed checkpoint {path} does not exist")
    return text


Positive = Annotated[int, BeforeValidator(_positive)]
Seed = Annotated[str, AfterValidator(_seed)]
Budget = Annotated[int | None, BeforeValidator(_budget)]
Ambient = Annotated[
    ambient.AmbientPolicy, BeforeValidator(_ambient), PlainSerializer(lambda p: p.text, return_type=str)
]


class AgentConfig(Settings):
    """The node agent's settings, declared once: its flags, their variables (the chart sets those from the downward
    API and its values) and `--help` come from here, and its rank processes get the same object from the agent."""

    PROG = "ferry-agent"
    DESCRIPTION = (
        "The Ferry node agent (one per GPU node): loads the WeightReplicas assigned to this node and serves them to "
        "peers and to the node's pods."
    )

    node: Annotated[str, Field(min_length=1)] = setting(
        ..., "this node's name: the agent loads the WeightReplicas with spec.nodeName == node", env="NODE_NAME"
    )
    seed: tuple[Seed, ...] = setting(
        (),
        "a local safetensors file that holds that WeightVersion; repeatable",
        metavar="NAMESPACE/MODEL/VERSION=PATH",
        repeat=True,
    )
    lease_seconds: int = setting(
        DEFAULT_LEASE_SECONDS,
        "duration of each served replica's Lease, renewed every third of it; a replica whose Lease lapses is no "
        "longer a source",
    )
    poll_seconds: float = setting(
        10.0, "resync period; changes to this node's WeightReplicas are watched and act at once"
    )
    retry_seconds: float = setting(
        5.0, "first backoff after a failed load; it doubles with each failure of the same version, up to 300 s"
    )
    bind_address: str = setting(
        "127.0.0.1", "address peers reach this agent's worker services (and its metrics) on", env="POD_IP"
    )
    checkpoint_dir: Path | None = setting(
        Path("/var/lib/ferry/checkpoints"),
        "local checkpoint store for the ObjectStorage strategy",
        env="FERRY_CHECKPOINT_DIR",
    )
    checkpoint_quota_gib: float = setting(
        500.0, "most the checkpoint store may hold; older artifacts of inactive chains are evicted first"
    )
    s3_endpoint: str | None = setting(
        None, "S3 endpoint for versions that name none", env=("FERRY_S3_ENDPOINT", "AWS_ENDPOINT_URL")
    )
    s3_download_workers: Positive = setting(
        8, "ranged GETs an object-storage load (on every rank) runs at once", env="FERRY_S3_DOWNLOAD_WORKERS"
    )
    ambient_credentials: Ambient = setting(
        "",
        "JSON rules that let WeightVersions without a credentialsSecret use this agent's own S3 credentials, per "
        "namespace, bucket/prefix and endpoint (ferry/ambient.py); empty: none may",
        env=ambient.ENV,
        metavar="JSON",
    )
    metrics_port: int = setting(
        -1, "serve Prometheus metrics on this port (-1 = off, 0 = any free port)", env="FERRY_AGENT_METRICS_PORT"
    )
    rank_timeout_seconds: float = setting(
        3600.0,
        "bound on each agreement step of a multi-rank replica (the other ranks wait in one while the first replays "
        "the chain from S3); a rank process that dies is noticed at once",
    )
    warm_ranks: int = setting(
        0,
        "rank processes started with the agent and kept idle for multi-rank replicas; besides, as many stay idle as "
        "the largest multi-rank replica of this node has ranks, so that its next version loads on processes already "
        "started",
        env="FERRY_WARM_RANKS",
    )
    max_rank_processes: Positive = setting(
        DEFAULT_MAX_RANK_PROCESSES,
        "most rank processes the agent runs at once, lent and idle: a replica of more ranks fails with "
        "RanksExceedNode before any starts, as does one of more than the cap leaves beside the other replicas' ranks "
        "(retried with the load backoff); a CUDA replica also needs a GPU per rank. A replica that loads its next "
        "version beside the serving one holds twice its ranks meanwhile",
        env="FERRY_MAX_RANK_PROCESSES",
    )
    socket_dir: str = setting(
        "/run/ferry",
        "serve attach sockets at DIR/pods/<pod-uid>/ferry.sock to this node's pods (empty = off)",
        env="FERRY_AGENT_SOCKET_DIR",
        metavar="DIR",
    )
    attach_connections_per_pod: Positive = setting(
        DEFAULT_ATTACH_CONNECTIONS_PER_POD,
        "most attach connections one pod may hold open at once; an engine holds one per worker process plus its "
        "refit and sidecar connections (TP 8 + refit + sidecar: 10 to 17), a connection beyond the cap is refused",
        env="FERRY_AGENT_ATTACH_CONNECTIONS_PER_POD",
    )
    host_memory_budget: Budget = setting(
        None,
        "most host memory the resident versions of this node may take, e.g. 64Gi (unset = unlimited); a load "
        "beyond it fails with MemoryBudgetExceeded",
        env="FERRY_AGENT_HOST_MEMORY_BUDGET",
        metavar="BYTES",
    )
    log_format: LogFormat = setting(
        LogFormat.PLAIN,
        "plain text, or one JSON object a line",
        env="FERRY_AGENT_LOG_FORMAT",
        choices=[str(f) for f in LogFormat],
    )
    # Who this agent is as a reader (its worker tokens are bound to this Pod) and whom its worker services admit.
    pod_namespace: str | None = setting(
        None, "the namespace of this agent's Pod and ServiceAccount", env="POD_NAMESPACE"
    )
    service_account: str | None = setting(None, "this agent's ServiceAccount", env="SERVICE_ACCOUNT")
    pod_name: str | None = setting(None, "this agent's Pod, which its worker tokens are bound to", env="POD_NAME")
    pod_uid: str | None = setting(None, "that Pod's uid", env="POD_UID")
    worker_allowed_identity: tuple[str, ...] = setting(
        (),
        "a user (as TokenReview reports it) whose pod-bound tokens may read from this agent; repeatable (default: "
        "this agent's own ServiceAccount)",
        metavar="USERNAME",
        repeat=True,
    )

    @model_validator(mode="after")
    def _warm_within_cap(self) -> AgentConfig:
        if self.warm_ranks > self.max_rank_processes:
            raise ValueError(
                f"--warm-ranks {self.warm_ranks} is more than --max-rank-processes {self.max_rank_processes}"
            )
        return self

    @property
    def seeds(self) -> dict[SeedKey, Path]:
        """The local safetensors files that hold these versions (the LocalFile strategy)."""
        return dict(parse_seed(text) for text in self.seed)
