"""Process logging: one JSON object per line by default, ``text`` for humans.

Every line carries the time, level, component, logger and message, plus any
``extra=`` keys the call gave (``node``, ``claim``, ``device``...)::

    log.info("allocated", extra={"claim": "team-a/train", "node": "gpu-node-3"})
    {"time": "2025-01-02T03:04:05.678Z", "level": "INFO", "component": "controller",
     "logger": "controller.reconciling", "msg": "allocated", "claim": "team-a/train", "node": "gpu-node-3"}
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import Any, TextIO

FORMATS = ("json", "text")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# Attributes every LogRecord has; anything else on a record came from `extra=`.
_RESERVED = frozenset(
    logging.LogRecord("", 0, "", 0, "", None, None).__dict__.keys() | {"message", "asctime", "taskName"}
)


def _timestamp(created: float) -> str:
    when = datetime.datetime.fromtimestamp(created, datetime.UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z"


def extras(record: logging.LogRecord) -> dict[str, Any]:
    """The ``extra=`` keys a log call attached to ``record``."""
    return {k: v for k, v in record.__dict__.items() if k not in _RESERVED and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": _timestamp(record.created),
            "level": record.levelname,
            "component": self.component,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in extras(record).items():
            line.setdefault(key, value)
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """``time LEVEL component logger: msg key=value ...`` for a terminal."""

    def __init__(self, component: str) -> None:
        super().__init__()
        self.component = component

    def format(self, record: logging.LogRecord) -> str:
        text = (
            f"{_timestamp(record.created)} {record.levelname:<7} {self.component} "
            f"{record.name}: {record.getMessage()}"
        )
        pairs = " ".join(f"{k}={v}" for k, v in extras(record).items())
        if pairs:
            text += " " + pairs
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            text += "\n" + self.formatStack(record.stack_info)
        return text


def formatter(component: str, fmt: str = "json") -> logging.Formatter:
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {', '.join(FORMATS)}")
    return JsonFormatter(component) if fmt == "json" else TextFormatter(component)


def setup(component: str, *, fmt: str = "json", level: str = "INFO", stream: TextIO | None = None) -> None:
    """Send every log record of the process to ``stream`` (stderr) in ``fmt``, at ``level`` and above.

    Replaces the root logger's handlers, so calling it twice does not double lines.
    """
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(formatter(component, fmt))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    # aiohttp logs every probe request at INFO; that is noise, not news.
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
