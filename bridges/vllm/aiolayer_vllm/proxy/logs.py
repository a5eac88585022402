"""The proxy's logging: one handler, plain text or one JSON object per line, for its and uvicorn's loggers."""

from __future__ import annotations

import datetime
import json
import logging

FORMATS = ("text", "json")
# a request's fields, given as ``extra=`` by the lines about one request
FIELDS = ("request_id", "stage", "status", "error_type")


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message, the request's fields, any traceback."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc)
               .isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        for field in FIELDS:
            if hasattr(record, field):
                out[field] = getattr(record, field)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def configure(level: str, fmt: str) -> None:
    """The proxy's and uvicorn's loggers write through one handler to stderr, in ``fmt`` (text|json).

    uvicorn's own lines (start-up, access log) show at debug only: at info the proxy's start-up line
    already says where it listens, and each failed request has its own line."""
    handler = logging.StreamHandler()
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    for name, lvl in (("aiolayer_vllm", level), ("uvicorn", uvicorn_level(level))):
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.propagate = False
        logger.setLevel(lvl.upper())


def uvicorn_level(level: str) -> str:
    return level if level in ("debug", "warning", "error", "critical") else "warning"
