"""Replica liveness through coordination Leases: one rule for the agent (source lists) and the operator (Stale)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

from ferry.api.models import LABEL_NODE

DEFAULT_LEASE_SECONDS = 15


def parse_time(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


def lease_node(lease: Mapping[str, Any]) -> str | None:
    return ((lease.get("metadata") or {}).get("labels") or {}).get(LABEL_NODE)


def lease_is_live(lease: Mapping[str, Any] | None, now: dt.datetime, *, node: str | None = None) -> bool:
    """A Lease renewed within its duration and, given `node` (the replica's spec.nodeName), labelled with that node:
    the admission policy lets an agent write only Leases of its own node, so another node's agent cannot keep a
    replica it does not serve alive under its name. No lease, or no renewTime: not live."""
    if lease is not None and node is not None and lease_node(lease) != node:
        return False
    spec = (lease or {}).get("spec") or {}
    renewed = parse_time(spec.get("renewTime") or spec.get("acquireTime"))
    duration = spec.get("leaseDurationSeconds") or DEFAULT_LEASE_SECONDS
    return renewed is not None and now - renewed <= dt.timedelta(seconds=duration)
