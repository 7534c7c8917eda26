"""The failures of `ferry publish`; the CLI prints the message and exits 1."""

from __future__ import annotations

from ferry.errors import Conflict, FerryError


class PublishError(FerryError):
    """A publish that must not go ahead; the message says what to fix."""


class ImmutableConflict(PublishError, Conflict):
    """The object (or WeightVersion) already exists with different content; nothing was overwritten."""
