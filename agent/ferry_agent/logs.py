"""The agent's logs, plain or JSON (`--log-format`). JSON lines carry the fields of the operator's (kopf's):
`message`, `timestamp`, `severity`, plus the logger's name and, with an exception, its traceback in `exc_info`."""

from __future__ import annotations

import datetime as dt
import json
import logging
import sys
from enum import StrEnum
from typing import TextIO


class LogFormat(StrEnum):
    PLAIN = "plain"
    JSON = "json"


PLAIN_FORMAT = "%(asctime)s %(name)s %(levelname)s %(message)s"
_configured = False  # `configure` ran: library loggers with handlers of their own are routed through ours


def _severity(levelno: int) -> str:
    if levelno <= logging.DEBUG:
        return "debug"
    if levelno <= logging.INFO:
        return "info"
    if levelno <= logging.WARNING:
        return "warn"
    return "error" if levelno <= logging.ERROR else "fatal"


class JsonFormatter(logging.Formatter):
    """One JSON object a line; `fields` are added to every record (e.g. a rank process's rank)."""

    def __init__(self, **fields: object) -> None:
        super().__init__()
        self._fields = fields

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "message": record.getMessage(),
            "timestamp": dt.datetime.fromtimestamp(record.created, dt.UTC).isoformat(),
            "severity": _severity(record.levelno),
            "logger": record.name,
            **self._fields,
        }
        if record.exc_info:
            doc["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure(log_format: LogFormat, *, stream: TextIO = sys.stderr, prefix: str = "", **fields: object) -> None:
    """Log INFO and above to `stream` in `log_format`; `prefix` goes before the logger name of plain lines and
    `fields` into every JSON line."""
    handler = logging.StreamHandler(stream)
    if log_format == LogFormat.JSON:
        handler.setFormatter(JsonFormatter(**fields))
    else:
        handler.setFormatter(logging.Formatter(PLAIN_FORMAT.replace("%(name)s", f"{prefix}%(name)s")))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    global _configured
    _configured = True
    logging.getLogger("urllib3.connectionpool").setLevel(logging.ERROR)  # each retry's warning; ours say it once


def adopt(name: str) -> None:
    """Once `configure` ran, send logger `name` (and its children) through the agent's handler instead of its own:
    NIXL installs a plain-text handler on stdout when it is imported, which would break JSON lines."""
    if not _configured:
        return
    logger = logging.getLogger(name)
    logger.handlers.clear()
    logger.propagate = True
