"""Operator settings, read once from the environment (Helm sets them on the Deployment)."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ferry.api.models import MAX_CHAIN_LENGTH


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    value = float(raw)
    if not value > 0:
        raise ValueError(f"{name} must be a positive number, got {raw!r}")
    return value


@dataclass(frozen=True)
class OperatorConfig:
    verify_concurrency: int  # storage verifications at once (threads, and the S3 client's connection pool)
    verify_backoff_initial: float
    verify_backoff_max: float
    release_retry_seconds: float
    watch_server_timeout: int
    max_chain_length: int
    metrics_address: str
    metrics_port: int  # 0 = any free port, -1 = off
    s3_endpoint: str | None

    @classmethod
    def from_env(cls) -> OperatorConfig:
        return cls(
            verify_concurrency=int(_float("FERRY_VERIFY_CONCURRENCY", 16)),
            verify_backoff_initial=_float("FERRY_VERIFY_BACKOFF_SECONDS", 2.0),
            verify_backoff_max=_float("FERRY_VERIFY_BACKOFF_MAX_SECONDS", 300.0),
            release_retry_seconds=_float("FERRY_RELEASE_RETRY_SECONDS", 2.0),
            watch_server_timeout=int(_float("FERRY_WATCH_TIMEOUT_SECONDS", 300)),
            max_chain_length=MAX_CHAIN_LENGTH,
            metrics_address=os.environ.get("FERRY_METRICS_ADDRESS", "0.0.0.0"),
            metrics_port=int(os.environ.get("FERRY_METRICS_PORT", "8080")),
            # Default endpoint for WeightVersions that name none (e.g. an in-cluster S3 gateway).
            s3_endpoint=os.environ.get("FERRY_S3_ENDPOINT") or os.environ.get("AWS_ENDPOINT_URL") or None,
        )


CONFIG = OperatorConfig.from_env()
