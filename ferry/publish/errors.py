"""The failures of `ferry publish`. Each is also the `ferry.errors` class of what went wrong, so that the CLI's exit
status tells a script what to do (docs/publish.md): fix the input, pick a new name, or retry."""

from __future__ import annotations

from ferry.errors import Conflict, FerryError, InvalidInput, NotFound, Transient


class PublishError(FerryError):
    """A publish that must not go ahead; the message says what to fix. A plain PublishError: the version itself
    failed (the operator refused it)."""


class InvalidPublish(PublishError, InvalidInput):
    """The input, the options or the credentials are wrong: the same command fails the same way."""


class PublishNotFound(PublishError, NotFound):
    """Something the publish needs is not there: the source path, the base version, the bucket."""


class PublishUnavailable(PublishError, Transient):
    """S3 or the Kubernetes API could not be reached, or the version was not Ready in time: run it again."""


class ImmutableConflict(PublishError, Conflict):
    """The object (or WeightVersion) already exists with different content; nothing was overwritten."""


def publish_error(cause: FerryError, message: str | None = None) -> PublishError:
    """`cause` (e.g. a translated S3 error) as the PublishError of its class."""
    for kind, error in ((Conflict, ImmutableConflict), (InvalidInput, InvalidPublish), (NotFound, PublishNotFound)):
        if isinstance(cause, kind):
            return error(message or str(cause))
    return PublishUnavailable(message or str(cause))
