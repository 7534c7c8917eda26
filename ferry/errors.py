"""Ferry's exception hierarchy: a failure's type says what its caller should do with it.

- `NotFound`: a miss; the thing is not there (yet). A load tries its next source.
- `Transient`: the thing may be fine but could not be reached (network, timeout, 5xx). Retry later.
- `InvalidInput`: what was asked for is wrong (a malformed URI, wrong credentials, a bad argument). Retrying
  the same request fails the same way; the user has to change something.
- `IntegrityError`: the bytes are there but wrong (truncated, corrupt, not what the index promised). Fatal for
  this copy: discard it rather than use it.
- `Conflict`: something already exists with other content; nothing was overwritten.

Modules raise subclasses that add what they know (`ferry.s3.AccessDenied`, `ferry.publish.ImmutableConflict`, ...).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class FerryError(Exception):
    """Every failure Ferry classifies. Catch a subclass to act on the class of failure."""


class NotFound(FerryError):
    """A miss: the object, version or source does not exist. Try the next source."""


class Transient(FerryError):
    """Could not be reached now; the same request may succeed later."""


class InvalidInput(FerryError, ValueError):
    """The request or its configuration is wrong; a retry of the same request fails the same way."""


class IntegrityError(FerryError):
    """The data exists but is not what it claims to be; it must not be used."""


class Conflict(FerryError):
    """It already exists with different content; nothing was overwritten."""


class LoadFailed(FerryError, RuntimeError):
    """A replica's load (of one rank or of many) failed: no source delivered it. `attempts` are what goes into
    its `status.attempts[]`."""

    def __init__(self, message: str, attempts: Sequence[Mapping[str, Any]] = ()) -> None:
        super().__init__(message)
        self.attempts = list(attempts)
