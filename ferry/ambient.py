"""Who may use the platform's own S3 credentials: the cluster admin's policy, read by the operator and the agents.

A WeightVersion without `spec.storage.credentialsSecret` would be read with the operator's and the agents' own
credentials (their environment: an instance role, IRSA, `operator.s3CredentialsSecret`): "ambient" credentials,
which cover every tenant's objects. So they are used only where a rule of this policy allows it, for the version's
namespace, endpoint, bucket and key prefix; nothing else is ever signed with them. No rule (the default): nobody.

The policy is JSON, a list of rules (chart value `ambientCredentials`, env `FERRY_AMBIENT_CREDENTIALS`, the same
text for the operator and the agents):

    [{"namespaces": ["team-a"], "prefixes": ["s3://models/team-a"], "endpoints": ["https://s3.internal:9000"]},
     {"namespaces": ["*"], "prefixes": ["s3://models/{namespace}/"]}]

- `namespaces`: names, or "*" for every namespace.
- `prefixes`: `s3://bucket[/key/prefix]`; the key prefix matches whole path segments (`s3://b/a` covers `a/x`,
  not `ab/x`); `{namespace}` stands for the version's namespace; the bucket `*` is any bucket.
- `endpoints` (optional): the S3 endpoints (URLs) the rule covers. Without it, only the default endpoint: the one
  a WeightVersion gets when it names none (FERRY_S3_ENDPOINT, else AWS itself).
"""

from __future__ import annotations

import json
import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ferry.errors import InvalidInput
from ferry.s3 import BUCKET, InvalidUri, parse_s3_uri

ENV = "FERRY_AMBIENT_CREDENTIALS"
CHART_VALUE = "ambientCredentials"
ANY = "*"
NAMESPACE_FIELD = "{namespace}"
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_KEYS = {"namespaces", "prefixes", "endpoints"}


class AmbientCredentialsDenied(InvalidInput):
    """A WeightVersion without a credentialsSecret that no rule allows the platform's own credentials for."""


def normalize_endpoint(endpoint: str | None) -> str:
    """An endpoint as rules compare it: scheme and host lowercased, no trailing slash; "" for AWS's own."""
    if not endpoint:
        return ""
    parts = urllib.parse.urlsplit(endpoint.strip())
    return urllib.parse.urlunsplit((parts.scheme.lower(), parts.netloc.lower(), parts.path.rstrip("/"), "", ""))


def _where(endpoint: str) -> str:
    return endpoint or "AWS's own endpoint"


@dataclass(frozen=True)
class Prefix:
    bucket: str  # or ANY
    key: str  # "" (the whole bucket) or ending in "/"; may hold NAMESPACE_FIELD

    @classmethod
    def parse(cls, text: str) -> Prefix:
        if not isinstance(text, str) or not text.startswith("s3://"):
            raise ValueError(f"prefix {text!r} is not an s3://bucket[/prefix] URI")
        bucket, _, key = text[len("s3://") :].partition("/")
        sample = bucket.replace(NAMESPACE_FIELD, "ns")
        if bucket != ANY and not BUCKET.fullmatch(sample):
            raise ValueError(f"prefix {text!r}: {bucket!r} is not a bucket name (or {ANY!r}: any bucket)")
        key = key.strip("/")
        parts = key.replace(NAMESPACE_FIELD, "ns").split("/") if key else []
        if any(not p or p in {".", ".."} or any(c.isspace() for c in p) for p in parts):
            raise ValueError(f"prefix {text!r} has an invalid key prefix")
        return cls(bucket, f"{key}/" if key else "")

    def covers(self, namespace: str, bucket: str, key: str) -> bool:
        want = self.bucket.replace(NAMESPACE_FIELD, namespace)
        return (self.bucket == ANY or want == bucket) and key.startswith(self.key.replace(NAMESPACE_FIELD, namespace))


@dataclass(frozen=True)
class Rule:
    namespaces: tuple[str, ...]
    prefixes: tuple[Prefix, ...]
    endpoints: tuple[str, ...]  # normalized; empty: the default endpoint only

    @classmethod
    def parse(cls, raw: Any, where: str) -> Rule:
        if not isinstance(raw, Mapping):
            raise ValueError(f"{where} is not an object with namespaces and prefixes")
        unknown = set(raw) - _KEYS
        if unknown:
            raise ValueError(f"{where} has unknown keys {sorted(unknown)} (allowed: {sorted(_KEYS)})")
        namespaces, prefixes = _strings(raw, "namespaces", where), _strings(raw, "prefixes", where)
        endpoints = _strings(raw, "endpoints", where, required=False)
        for ns in namespaces:
            if ns != ANY and not _NAMESPACE.fullmatch(ns):
                raise ValueError(f"{where}: {ns!r} is not a namespace name (or {ANY!r}: every namespace)")
        for endpoint in endpoints:
            if urllib.parse.urlsplit(endpoint).scheme not in ("http", "https"):
                raise ValueError(f"{where}: endpoint {endpoint!r} is not an http(s):// URL")
        return cls(
            tuple(namespaces),
            tuple(Prefix.parse(p) for p in prefixes),
            tuple(normalize_endpoint(e) for e in endpoints),
        )

    def allows(self, namespace: str, endpoint: str, default: str, bucket: str, key: str) -> bool:
        return (
            (ANY in self.namespaces or namespace in self.namespaces)
            and endpoint in (self.endpoints or (default,))
            and any(p.covers(namespace, bucket, key) for p in self.prefixes)
        )


def _strings(raw: Mapping, name: str, where: str, *, required: bool = True) -> list[str]:
    value = raw.get(name)
    if value is None and not required:
        return []
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{where}: {name} must be a non-empty list of strings")
    return value


@dataclass(frozen=True)
class AmbientPolicy:
    """The admin's rules; no rule: the platform's credentials are used for nobody."""

    rules: tuple[Rule, ...] = ()
    text: str = field(default="", compare=False)  # as given: what the agent hands its rank processes

    @classmethod
    def parse(cls, text: str | None) -> AmbientPolicy:
        """The policy of `text` (JSON; empty: no rule); ValueError says what is wrong, and where."""
        if not text or not text.strip():
            return cls()
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{ENV} is not JSON: {exc}") from exc
        if not isinstance(raw, list):
            raise ValueError(f"{ENV} must be a JSON list of rules")
        return cls(tuple(Rule.parse(r, f"{ENV} rule {i}") for i, r in enumerate(raw)), text)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> AmbientPolicy:
        return cls.parse((os.environ if environ is None else environ).get(ENV))

    def check(self, namespace: str, uri: str, endpoint: str | None, default_endpoint: str | None) -> None:
        """Raise AmbientCredentialsDenied unless a rule lets `namespace` read `uri` from `endpoint` (the version's
        spec.storage.endpoint; None: `default_endpoint`, this component's own default) with the platform's own
        credentials. The shards of a checkpoint lie beside its index, so the index's key decides for them too."""
        used = normalize_endpoint(endpoint or default_endpoint)
        try:
            bucket, key = parse_s3_uri(uri)
        except InvalidUri:
            bucket, key = "", ""  # matches no rule
        # S3 keys are not paths, but some S3-compatible servers resolve `..`: such a key matches no prefix.
        safe = bool(key) and not any(p in {".", ".."} for p in key.split("/")) and "//" not in key
        default = normalize_endpoint(default_endpoint)
        if safe and any(r.allows(namespace, used, default, bucket, key) for r in self.rules):
            return
        raise AmbientCredentialsDenied(
            f"Namespace {namespace} may not read {uri} at {_where(used)} with the platform's own S3 credentials: the "
            f"WeightVersion names no spec.storage.credentialsSecret, and no rule of the cluster admin's "
            f"{CHART_VALUE} (chart value; {ENV}) allows that namespace, bucket, key prefix and endpoint. Name a "
            f"Secret of the namespace in spec.storage.credentialsSecret, or have the admin allow it (docs/security.md)"
        )
