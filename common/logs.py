"""Structured JSON logs, one object per line, with the task id on every line about a task."""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator

current_task: contextvars.ContextVar[str | None] = contextvars.ContextVar("task_id", default=None)


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        task_id = getattr(record, "task_id", None) or current_task.get()
        if task_id:
            entry["task_id"] = task_id
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


def configure(service: str, level: str = "INFO") -> None:
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(JsonFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)


@contextlib.contextmanager
def task_context(task_id: str) -> Iterator[None]:
    """Every log line inside (this coroutine or the engine thread it calls) names the task."""
    token = current_task.set(task_id)
    try:
        yield
    finally:
        current_task.reset(token)
