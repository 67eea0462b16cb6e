"""Structured logs: one line per event, the request id on every line about a request.

A handler sets the request id once (``request_scope``); every log call made in that task, at any
depth, carries it, because grpc.aio runs each call in its own task and the id lives in a context
variable. Fields passed with ``extra={"fields": {...}}`` are added to the line. (What a line may say
about a prompt is the gateway's rule: ``gateway/prompt_log.py``.)
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time

REQUEST_ID: contextvars.ContextVar[str | None] = contextvars.ContextVar("request_id", default=None)
_RESERVED = set(logging.LogRecord("", 0, "", 0, "", None, None).__dict__) | {"message", "asctime"}


@contextlib.contextmanager
def request_scope(request_id: str):
    token = REQUEST_ID.set(request_id)
    try:
        yield
    finally:
        try:
            REQUEST_ID.reset(token)
        except ValueError:
            # An async generator closed by asyncio's finalizer runs in another context; the id
            # set here was never visible there, so there is nothing to undo.
            pass


class RequestIdFilter(logging.Filter):
    """Puts the current request id on the record unless the call named one itself."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            record.request_id = REQUEST_ID.get()
        return True


def _fields(record: logging.LogRecord) -> dict:
    out = dict(getattr(record, "fields", None) or {})
    for k, v in record.__dict__.items():  # plain extra={...} keys too
        if k not in _RESERVED and k not in ("fields", "request_id", "process_name"):
            out[k] = v
    return out


class JsonFormatter(logging.Formatter):
    def __init__(self, process_name: str) -> None:
        super().__init__()
        self.process_name = process_name

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "process": self.process_name,
            "pid": record.process,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = getattr(record, "request_id", None)
        if rid is not None:
            line["request_id"] = rid
        line.update(_fields(record))
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """The same fields as key=value pairs after the message, for a terminal."""

    def __init__(self, process_name: str) -> None:
        super().__init__()
        self.process_name = process_name

    def format(self, record: logging.LogRecord) -> str:
        ts = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(record.created))
        parts = [f"{ts}.{int(record.msecs):03d}", f"{self.process_name}[{record.process}]", record.levelname]
        rid = getattr(record, "request_id", None)
        if rid is not None:
            parts.append(f"request_id={rid}")
        parts.append(record.getMessage())
        parts += [f"{k}={json.dumps(v, default=str, ensure_ascii=False)}" for k, v in _fields(record).items()]
        line = " ".join(parts)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(level: str = "INFO", fmt: str = "text", process_name: str = "gateway", stream=None) -> None:
    """Configure the root logger of this process (replacing any handler set before)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter(process_name))
    elif fmt == "text":
        handler.setFormatter(TextFormatter(process_name))
    else:
        raise ValueError(f"log format must be 'text' or 'json', got {fmt!r}")
    handler.addFilter(RequestIdFilter())
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(handler)
    root.setLevel(level.upper() if isinstance(level, str) else level)
