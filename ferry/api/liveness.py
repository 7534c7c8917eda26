"""Replica liveness through coordination Leases: one rule for the agent (source lists) and the operator (Stale)."""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any

DEFAULT_LEASE_SECONDS = 15


def parse_time(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    return dt.datetime.fromisoformat(value.replace("Z", "+00:00"))


def lease_is_live(lease: Mapping[str, Any] | None, now: dt.datetime) -> bool:
    """A Lease renewed within its duration. No lease, or no renewTime: not live."""
    spec = (lease or {}).get("spec") or {}
    renewed = parse_time(spec.get("renewTime") or spec.get("acquireTime"))
    duration = spec.get("leaseDurationSeconds") or DEFAULT_LEASE_SECONDS
    return renewed is not None and now - renewed <= dt.timedelta(seconds=duration)
