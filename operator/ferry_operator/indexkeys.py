"""Keys of the operator's kopf indexes. One index over every WeightVersion answers every question asked of them by
key, so no reconcile walks all versions: by name (chain resolution), by model (retention), by base (what
depends on a version) and by storage folder (what shares a version's objects). The keys are tagged tuples so
that the kinds of key never collide."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ferry.chain import VersionView
from ferry.s3 import parse_s3_uri


def named(namespace: str, name: str) -> tuple:
    return ("name", namespace, name)


def of_model(namespace: str, model: str) -> tuple:
    return ("model", namespace, model)


def based_on(namespace: str, base: str) -> tuple:
    return ("base", namespace, base)


def in_folder(bucket: str, folder: str) -> tuple:
    return ("folder", bucket, folder)


def storage_folder(uri: str) -> tuple[str, str] | None:
    try:
        bucket, key = parse_s3_uri(uri)
    except ValueError:
        return None
    return bucket, key.rpartition("/")[0]


def version_keys(view: VersionView) -> dict[tuple, VersionView]:
    keys = {named(view.namespace, view.name): view, of_model(view.namespace, view.model_name): view}
    if view.base_version:
        keys[based_on(view.namespace, view.base_version)] = view
    folder = storage_folder(view.storage_uri) if view.storage_uri else None
    if folder:
        keys[in_folder(*folder)] = view
    return keys


def dependents_of(index: Mapping[tuple, Any], namespace: str, name: str) -> list[VersionView]:
    """The versions whose baseVersion is `name`, in `namespace`: one key, not a walk over every version."""
    return list(index.get(based_on(namespace, name), ()))
