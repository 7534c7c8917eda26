"""INFO shows transitions: kopf's own per-handler bookkeeping lines ("Handler 'x' succeeded.", "Creation is
processed: 1 succeeded; 0 failed.") are DEBUG-only here. kopf logs them at INFO for every handler run, so at
10,000 objects they would be most of the log."""

from __future__ import annotations

import logging
import re

_BOOKKEEPING = re.compile(
    r"^(Handler|Timer|Daemon) '[^']*' succeeded\.$"  # after each handler run
    r"|^\w+ is processed: \d+ succeeded; \d+ failed\.$"  # after each create/update/delete cycle
)


class DropBookkeeping(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or not _BOOKKEEPING.match(str(record.msg)):
            return True
        return logging.getLogger().isEnabledFor(logging.DEBUG)


def install() -> None:
    logger = logging.getLogger("kopf.objects")
    if not any(isinstance(f, DropBookkeeping) for f in logger.filters):
        logger.addFilter(DropBookkeeping())
