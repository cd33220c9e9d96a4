"""Bounds how long a task may wait for a worker: the one fault a worker cannot fix is that
no worker of its backend runs at all. Every gateway replica sweeps; the terminal write is
atomic and idempotent, so two sweeps never conflict."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from redis.exceptions import RedisError

from common import keys
from common.catalog import enabled_backends
from common.schemas import ErrorCode, TaskState
from common.settings import Settings
from common.store import TaskStore

log = logging.getLogger("gateway.sweeper")
BATCH = 200


async def sweep_forever(store: TaskStore, settings: Settings) -> None:
    limit = settings.max_queue_seconds
    if limit <= 0:
        return
    while True:
        await asyncio.sleep(min(30.0, limit / 4))
        with contextlib.suppress(RedisError):
            for backend in enabled_backends(settings):
                await sweep(store, backend, limit)


async def sweep(store: TaskStore, backend: str, limit: float) -> int:
    """FAIL the PENDING tasks of `backend` queued longer than `limit` seconds."""
    cutoff_ms = int((time.time() - limit) * 1000)
    entries = await store.redis.xrange(keys.queue(backend), "-", str(cutoff_ms), count=BATCH)
    failed = 0
    for entry_id, fields in entries:
        task_id = fields.get(b"task_id", b"").decode()
        task = await store.get(task_id) if task_id else None
        if task is None or task.state != TaskState.PENDING:
            continue
        error = (f"no {backend} worker started this task within {limit:.0f} s "
                 "(see /ready for live workers)")
        if await store.finish(task, TaskState.FAILED, attempt=None, entry_id=entry_id.decode(),
                              error=error, error_code=ErrorCode.NO_WORKER.value):
            log.warning("task %s: %s", task_id, error)
            failed += 1
    return failed
