"""Queue upkeep by every gateway replica: a task no worker started within
`max_queue_seconds` is FAILED (the one fault a worker cannot fix is that no worker of its
backend runs at all), and stream entries past every retention are trimmed. The terminal
write is atomic and idempotent, so two sweeping replicas never conflict."""

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
    period = min(30.0, limit / 4) if limit > 0 else 30.0
    while True:
        await asyncio.sleep(period)
        with contextlib.suppress(RedisError):
            for backend in enabled_backends(settings):
                if limit > 0:
                    await sweep(store, backend, limit)
                await trim(store, backend, max(settings.retention_seconds, limit))


async def trim(store: TaskStore, backend: str, older_than: float) -> None:
    """Drop stream entries older than any task they could still serve: streams stay small."""
    min_id = str(int((time.time() - older_than) * 1000))
    for stream in (keys.queue(backend), keys.dead_letter(backend)):
        await store.redis.xtrim(stream, minid=min_id, approximate=False)


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
