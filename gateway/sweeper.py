"""Queue upkeep by every gateway replica, so that no task waits for ever:

- a task still PENDING `max_queue_seconds` after it was queued is FAILED (`no_worker`);
- a backend without a live worker for `no_worker_seconds` has its PENDING tasks, and its
  RUNNING tasks whose worker's heartbeat is gone, FAILED (`no_worker`);
- stream entries past every retention are trimmed, and orphaned blob files deleted.

Both walks resume where the previous pass stopped (a cursor per backend) and read a
bounded number of entries per pass. Every terminal write is fenced inside its Lua call
(TaskStore.fail_if_unchanged): a task a worker starts between the sweeper's read and its
write is left alone, and two sweeping replicas never conflict."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from redis.exceptions import RedisError, ResponseError

from common import keys
from common.catalog import enabled_backends
from common.schemas import ErrorCode, TaskState
from common.settings import Settings
from common.store import Task, TaskStore, live_workers

log = logging.getLogger("gateway.sweeper")
BATCH = 200
MAX_BATCHES = 5  # per walk, backend and pass: a pass stays short however long the stream
Entries = list[tuple[bytes, dict[bytes, bytes]]]


async def sweep_forever(store: TaskStore, settings: Settings) -> None:
    sweeper = Sweeper(store, settings)
    while True:
        await asyncio.sleep(sweeper.period)
        try:
            await sweeper.sweep()
        except RedisError:
            pass  # the next pass goes on where this one stopped
        except Exception:  # a sweeper that died would leave every backend a blind spot
            log.exception("sweep failed; trying again in %.1f s", sweeper.period)


class Sweeper:
    def __init__(self, store: TaskStore, settings: Settings) -> None:
        self.store = store
        self.settings = settings
        # backend -> the last stream entry each walk has looked at ("(" + id: exclusive)
        self.overdue_cursor: dict[str, str] = {}
        self.owed_cursor: dict[str, str] = {}
        bounds = [limit / 4 for limit in (settings.max_queue_seconds, settings.no_worker_seconds)
                  if limit > 0]
        self.period = max(0.2, min([30.0, *bounds]))

    async def sweep(self) -> None:
        live = {worker["backend"] for worker in await live_workers(self.store.redis)}
        for backend in enabled_backends(self.settings):
            if self.settings.max_queue_seconds > 0:
                await self.fail_overdue(backend, self.settings.max_queue_seconds)
            if self.settings.no_worker_seconds > 0:
                await self.fail_stranded(backend, backend in live)
            await trim(self.store, backend,
                       max(self.settings.retention_seconds, self.settings.max_queue_seconds))
        await self.store.sweep_blob_dir()  # files no task can read any more (SPEECH_BLOB_DIR)

    async def fail_overdue(self, backend: str, limit: float) -> int:
        """FAIL the PENDING tasks of `backend` queued more than `limit` seconds ago. Every
        entry past the cutoff is looked at once: a task seen started or finished never
        becomes PENDING again, so the walk never goes back."""
        cutoff = str(int((time.time() - limit) * 1000))
        error = (f"no {backend} worker started this task within {limit:.0f} s "
                 "(see /ready for live workers)")
        failed = 0
        for _ in range(MAX_BATCHES):
            start = self.overdue_cursor.get(backend, "-")
            entries = await self.store.redis.xrange(keys.queue(backend), start, cutoff,
                                                    count=BATCH)
            if not entries:
                break
            failed += await self.fail_tasks(await self._tasks(entries), lambda task: error
                                       if task.state == TaskState.PENDING else None)
            self.overdue_cursor[backend] = "(" + entries[-1][0].decode()
            if len(entries) < BATCH:
                break
        return failed

    async def fail_stranded(self, backend: str, live: bool) -> int:
        """With no live worker of `backend` for `no_worker_seconds`, FAIL what it still owes:
        its PENDING tasks, and its RUNNING tasks whose worker's heartbeat is gone."""
        redis, since_key = self.store.redis, keys.no_worker_since(backend)
        if live:
            await redis.delete(since_key)
            return 0
        now = time.time()
        # Shared by every replica; kept alive by their passes, gone soon after they stop.
        await redis.set(since_key, repr(now), nx=True)
        await redis.expire(since_key, int(4 * self.period + 60))
        since = float(await redis.get(since_key) or now)
        limit = self.settings.no_worker_seconds
        if now - since < limit:
            return 0
        tasks = await self._tasks(await self._owed_entries(backend))
        running = {task.worker for task in tasks if task.state == TaskState.RUNNING}
        gone = {worker for worker in running
                if not await redis.exists(keys.heartbeat(backend, worker))}
        pending = (f"no {backend} worker has been live for {limit:.0f} s, so none can start "
                   "this task (see /ready)")

        def error(task: Task) -> str | None:
            if task.state == TaskState.PENDING:
                return pending
            if task.state == TaskState.RUNNING and task.worker in gone:
                return (f"its {backend} worker {task.worker} stopped, and no {backend} worker "
                        f"has been live for {limit:.0f} s (see /ready)")
            return None

        return await self.fail_tasks(tasks, error)

    async def _owed_entries(self, backend: str) -> Entries:
        """Entries the backend may still owe a result: handed to a worker and not acked, and
        not handed out yet (from where the last pass stopped); a bounded number."""
        redis, stream, most = self.store.redis, keys.queue(backend), BATCH * MAX_BATCHES
        if not await redis.exists(stream):
            return []
        delivered = "0-0"
        try:
            for group in await redis.xinfo_groups(stream):
                if group["name"] == keys.WORKER_GROUP.encode():
                    delivered = group["last-delivered-id"].decode()
            handed_out = await redis.xpending_range(stream, keys.WORKER_GROUP, min="-",
                                                    max="+", count=most)
        except ResponseError:  # no consumer group yet: no worker ever read this stream
            handed_out = []
        entries: Entries = []
        if handed_out:
            async with redis.pipeline(transaction=False) as pipe:
                for item in handed_out:
                    pipe.xrange(stream, item["message_id"], item["message_id"])
                entries = [entry for found in await pipe.execute() for entry in found]
        start = _later(self.owed_cursor.get(backend, "0-0"), delivered)
        waiting = await redis.xrange(stream, f"({start}", "+", count=most)
        if waiting:
            self.owed_cursor[backend] = waiting[-1][0].decode()
        return entries + waiting

    async def _tasks(self, entries: Entries) -> list[Task]:
        task_ids = [fields[b"task_id"].decode() for _, fields in entries if b"task_id" in fields]
        return [task for task in await self.store.tasks(task_ids) if task is not None]

    async def fail_tasks(self, tasks: list[Task],
                         error_for: Callable[[Task], str | None]) -> int:
        """FAIL each task (as read) for which `error_for` gives an error, fenced on the state
        and attempt it was read with."""
        failed = 0
        for task in tasks:
            error = error_for(task)
            if error is not None and await self.store.fail_if_unchanged(
                    task, error, ErrorCode.NO_WORKER.value):
                log.warning("task %s: %s", task.id, error)
                failed += 1
        return failed


async def trim(store: TaskStore, backend: str, older_than: float) -> None:
    """Drop stream entries older than any task they could still serve: streams stay small."""
    min_id = str(int((time.time() - older_than) * 1000))
    for stream in (keys.queue(backend), keys.dead_letter(backend)):
        await store.redis.xtrim(stream, minid=min_id, approximate=False)


def _later(a: str, b: str) -> str:
    def key(entry: str) -> tuple[int, int]:
        millis, _, seq = entry.partition("-")
        return int(millis), int(seq or 0)

    return max(a, b, key=key)
