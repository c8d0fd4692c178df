"""Structured logs: one JSON object per line, naming the request and volume.

Fields set in the request context (request id, RPC method, volume id, target
path) are attached to every record logged while that request is served.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time

log_fields: contextvars.ContextVar[dict] = contextvars.ContextVar("log_fields", default={})


def bind(**fields) -> None:
    """Add fields to every log record of the current request."""
    log_fields.set({**log_fields.get(), **{k: v for k, v in fields.items() if v}})


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update(log_fields.get())
        extra = getattr(record, "fields", None)
        if extra:
            entry.update(extra)
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def setup(level: str = "info", json_format: bool = True) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if json_format:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
