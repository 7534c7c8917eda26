"""Typed API objects for unit tests of the pure domain functions: what `X.from_body` makes of a kopf body."""

from __future__ import annotations

from typing import Any

from ferry.api.models import ObjectMeta, WeightVersion, WeightVersionSpec

DELETED_AT = "2026-01-01T00:00:00Z"


def meta(name: str, *, namespace: str = "ns", generation: int | None = 1, deleting: bool = False) -> ObjectMeta:
    return ObjectMeta(
        name=name,
        namespace=namespace,
        uid=f"uid-{name}",
        generation=generation,
        deletionTimestamp=DELETED_AT if deleting else None,
    )


def weight_version(
    name: str = "v2",
    *,
    status: Any = None,
    generation: int | None = 1,
    deleting: bool = False,
    model: str = "m",
    fmt: str = "PeerOnly",
    **spec: Any,
) -> WeightVersion:
    """A version; `status` a WeightVersionStatus or its dict (as the apiserver returns it)."""
    return WeightVersion.from_body(
        {
            "metadata": meta(name, generation=generation, deleting=deleting).model_dump(exclude_none=True),
            "spec": WeightVersionSpec(modelName=model, format=fmt, **spec).model_dump(exclude_none=True),
            "status": status.model_dump(mode="json", exclude_none=True) if hasattr(status, "model_dump") else status,
        }
    )
