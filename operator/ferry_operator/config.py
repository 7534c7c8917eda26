"""Operator settings, read once from the environment (Helm sets them on the Deployment).

`SETTINGS` documents every variable the operator reads, with its default; `python -m ferry_operator --help` lists
them, and takes each as a flag too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ferry import ambient
from ferry.api.models import MAX_CHAIN_LENGTH


@dataclass(frozen=True)
class Setting:
    env: str
    default: str  # as the variable would spell it; "" = unset
    help: str

    @property
    def flag(self) -> str:
        return "--" + self.env.removeprefix("FERRY_").lower().replace("_", "-")


SETTINGS = (
    Setting(
        "FERRY_VERIFY_CONCURRENCY", "16", "storage verifications at once (threads; as many again read shard headers)"
    ),
    Setting("FERRY_VERIFY_BACKOFF_SECONDS", "2", "first retry delay after a failed storage verification"),
    Setting("FERRY_VERIFY_BACKOFF_MAX_SECONDS", "300", "cap of the doubling verification retry delay"),
    Setting(
        "FERRY_RELEASE_RETRY_SECONDS",
        "300",
        "safety net: a blocked release (deletion) is looked at again after this long without any change (a change of"
        " what blocks it wakes it at once)",
    ),
    Setting("FERRY_WATCH_TIMEOUT_SECONDS", "300", "server-side timeout of each watch request"),
    Setting("FERRY_METRICS_ADDRESS", "0.0.0.0", "address of the Prometheus /metrics endpoint"),
    Setting("FERRY_METRICS_PORT", "8080", "port of the /metrics endpoint; 0 = any free port, -1 = off"),
    Setting("FERRY_S3_ENDPOINT", "", "S3 endpoint for WeightVersions that name none (else AWS_ENDPOINT_URL)"),
    Setting(
        ambient.ENV,
        "",
        "JSON rules that let WeightVersions without a credentialsSecret use the operator's own S3 credentials, per "
        "namespace, bucket/prefix and endpoint (ferry/ambient.py); unset: none may",
    ),
    Setting("FERRY_LEADER_ELECTION", "", "true: run as one of several replicas, one active (Lease election)"),
    Setting("FERRY_LEADER_ELECTION_NAMESPACE", "default", "namespace of the leader-election Lease"),
    Setting("FERRY_LEADER_ELECTION_LEASE", "ferry-operator", "name of the leader-election Lease"),
    Setting("FERRY_LEADER_ELECTION_IDENTITY", "", "this replica's identity in the Lease (default: the hostname)"),
    Setting("FERRY_LEADER_ELECTION_LEASE_SECONDS", "10", "how long a leader's Lease holds without renewal"),
    Setting("FERRY_LEADER_ELECTION_RENEW_DEADLINE_SECONDS", "7", "a leader that cannot renew this long steps down"),
    Setting("FERRY_LEADER_ELECTION_RETRY_SECONDS", "2", "how often the Lease is renewed, or tried by a standby"),
    Setting("FERRY_STANDBY_HEALTHZ", "", "URL a standby serves the liveness probe on (kopf's --liveness)"),
)
DEFAULTS = {s.env: s.default for s in SETTINGS}


def _float(name: str) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        raw = DEFAULTS[name]
    value = float(raw)
    if not value > 0:
        raise ValueError(f"{name} must be a positive number, got {raw!r}")
    return value


@dataclass(frozen=True)
class OperatorConfig:
    verify_concurrency: int  # storage verifications at once (threads; as many again read shard headers)
    verify_backoff_initial: float
    verify_backoff_max: float
    release_retry_seconds: float
    watch_server_timeout: int
    max_chain_length: int
    metrics_address: str
    metrics_port: int  # 0 = any free port, -1 = off
    s3_endpoint: str | None
    ambient: ambient.AmbientPolicy  # where the operator's own S3 credentials may be used

    @classmethod
    def from_env(cls) -> OperatorConfig:
        return cls(
            verify_concurrency=int(_float("FERRY_VERIFY_CONCURRENCY")),
            verify_backoff_initial=_float("FERRY_VERIFY_BACKOFF_SECONDS"),
            verify_backoff_max=_float("FERRY_VERIFY_BACKOFF_MAX_SECONDS"),
            release_retry_seconds=_float("FERRY_RELEASE_RETRY_SECONDS"),
            watch_server_timeout=int(_float("FERRY_WATCH_TIMEOUT_SECONDS")),
            max_chain_length=MAX_CHAIN_LENGTH,
            metrics_address=os.environ.get("FERRY_METRICS_ADDRESS", DEFAULTS["FERRY_METRICS_ADDRESS"]),
            metrics_port=int(os.environ.get("FERRY_METRICS_PORT", DEFAULTS["FERRY_METRICS_PORT"])),
            # Default endpoint for WeightVersions that name none (e.g. an in-cluster S3 gateway).
            s3_endpoint=os.environ.get("FERRY_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL") or None,
            ambient=ambient.AmbientPolicy.from_env(),
        )


CONFIG = OperatorConfig.from_env()
