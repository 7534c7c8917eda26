"""Operator settings, declared once (`ferry.settings`): each is a FERRY_* environment variable (the chart sets them
on the Deployment) or the flag of `python -m ferry_operator` beside it, which wins. `python -m ferry_operator --help`
lists them with their defaults; the kopf process reads them once from its environment (`CONFIG`)."""

from __future__ import annotations

import os
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, PlainSerializer

from ferry import ambient
from ferry.settings import Settings, setting

Positive = Annotated[float, Field(gt=0)]
PositiveInt = Annotated[int, Field(gt=0)]


def _ambient(value: Any) -> ambient.AmbientPolicy:
    return value if isinstance(value, ambient.AmbientPolicy) else ambient.AmbientPolicy.parse(value)


def _flag(value: Any) -> bool:
    return value if isinstance(value, bool) else str(value).strip().lower() in ("1", "true", "yes", "on")


Ambient = Annotated[
    ambient.AmbientPolicy, BeforeValidator(_ambient), PlainSerializer(lambda p: p.text, return_type=str)
]
Flag = Annotated[bool, BeforeValidator(_flag)]


def _env(name: str) -> str:
    return f"FERRY_{name.upper()}"


class OperatorConfig(Settings):
    """The operator's settings: field `x_y` is flag `--x-y` and variable `FERRY_X_Y`."""

    PROG = "python -m ferry_operator"
    DESCRIPTION = (
        "Ferry's operator. Each setting is a FERRY_* environment variable (as the Helm chart sets them) or the flag "
        "beside it, which wins."
    )
    EPILOG = (
        "Other options go to `kopf run` (see `python -m kopf run --help`), e.g. --log-format=json, "
        "--liveness=http://0.0.0.0:8081/healthz, --verbose."
    )

    verify_concurrency: PositiveInt = setting(
        16, "storage verifications at once (threads; as many again read shard headers)", env=_env("verify_concurrency")
    )
    verify_backoff_seconds: Positive = setting(
        2.0, "first retry delay after a failed storage verification", env=_env("verify_backoff_seconds")
    )
    verify_backoff_max_seconds: Positive = setting(
        300.0, "cap of the doubling verification retry delay", env=_env("verify_backoff_max_seconds")
    )
    release_retry_seconds: Positive = setting(
        300.0,
        "safety net: a blocked release (deletion) is looked at again after this long without any change (a change "
        "of what blocks it wakes it at once)",
        env=_env("release_retry_seconds"),
    )
    watch_timeout_seconds: PositiveInt = setting(
        300, "server-side timeout of each watch request", env=_env("watch_timeout_seconds")
    )
    metrics_address: str = setting(
        "0.0.0.0", "address of the Prometheus /metrics endpoint", env=_env("metrics_address")
    )
    metrics_port: int = setting(
        8080, "port of the /metrics endpoint; 0 = any free port, -1 = off", env=_env("metrics_port")
    )
    s3_endpoint: str | None = setting(
        None, "S3 endpoint for WeightVersions that name none", env=(_env("s3_endpoint"), "AWS_ENDPOINT_URL")
    )
    ambient_credentials: Ambient = setting(
        "",
        "JSON rules that let WeightVersions without a credentialsSecret use the operator's own S3 credentials, per "
        "namespace, bucket/prefix and endpoint (ferry/ambient.py); unset: none may",
        env=ambient.ENV,
        metavar="JSON",
    )
    leader_election: Flag = setting(
        False, "true: run as one of several replicas, one active (Lease election)", env=_env("leader_election")
    )
    leader_election_namespace: str = setting(
        "default", "namespace of the leader-election Lease", env=_env("leader_election_namespace")
    )
    leader_election_lease: str = setting(
        "ferry-operator", "name of the leader-election Lease", env=_env("leader_election_lease")
    )
    leader_election_identity: str | None = setting(
        None, "this replica's identity in the Lease (default: the hostname)", env=_env("leader_election_identity")
    )
    leader_election_lease_seconds: PositiveInt = setting(
        10, "how long a leader's Lease holds without renewal", env=_env("leader_election_lease_seconds")
    )
    leader_election_renew_deadline_seconds: Positive = setting(
        7.0, "a leader that cannot renew this long steps down", env=_env("leader_election_renew_deadline_seconds")
    )
    leader_election_retry_seconds: Positive = setting(
        2.0, "how often the Lease is renewed, or tried by a standby", env=_env("leader_election_retry_seconds")
    )
    standby_healthz: str | None = setting(
        None, "URL a standby serves the liveness probe on (kopf's --liveness)", env=_env("standby_healthz")
    )


CONFIG = OperatorConfig.from_values({}, os.environ)
