"""Queue upkeep by every gateway replica, so that no task waits for ever:

- a task still PENDING `max_queue_seconds` after it was queued is FAILED (`no_worker`);
- a backend without a live worker for `no_worker_seconds` has its PENDING tasks, and its
  RUNNING tasks whose worker's heartbeat is gone, FAILED (`no_worker`);
- stream entries past every retention are trimmed, and orphaned blob files deleted (tasks'
  and custom voices');
- every enabled backend's queue has its consumer group (made by a worker otherwise: with its
  workers scaled to zero, KEDA's stream scalers read that group to wake them, and a fresh or
  flushed Redis would have none, so a backend at zero would never wake).

Both walks resume where the previous pass stopped (a cursor per backend) and read a
bounded number of entries per pass. Every terminal write is fenced inside its Lua call
(TaskStore.fail_if_unchanged): a task a worker starts between the sweeper's read and its
write is left alone, and two sweeping replicas never conflict."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

from common.backends import BACKENDS
from common.catalog import enabled_backends
from common.schemas import ErrorCode, TaskState
from common.settings import Settings
from common.store import StoreError, Task, TaskStore, upkeep
from common.store.upkeep import Entry
from common.store.voices import VoiceStore

log = logging.getLogger("gateway.sweeper")
BATCH = 200
MAX_BATCHES = 5  # per walk, backend and pass: a pass stays short however long the stream
#: a consumer of the workers' group idle this long with nothing pending to it is removed (a
#: live worker reads at least every second; a busy one holds its entry pending in that lane,
#: and a read made again after a removal makes the consumer again)
IDLE_CONSUMER_SECONDS = 3600.0


async def sweep_forever(store: TaskStore, settings: Settings) -> None:
    sweeper = Sweeper(store, settings)
    with contextlib.suppress(StoreError):  # else the first pass makes them
        await sweeper.ensure_queues()
    while True:
        await asyncio.sleep(sweeper.period)
        try:
            await sweeper.sweep()
        except StoreError:
            pass  # the next pass goes on where this one stopped
        except Exception:  # a sweeper that died would leave every backend a blind spot
            log.exception("sweep failed; trying again in %.1f s", sweeper.period)


class Sweeper:
    def __init__(self, store: TaskStore, settings: Settings) -> None:
        self.store = store
        self.settings = settings
        self.voices = VoiceStore.of(store)
        # (backend, lane) -> the last stream entry each walk has looked at ("(" + id:
        # exclusive); each walk covers both priority lanes
        self.overdue_cursor: dict[tuple[str, str], str] = {}
        self.owed_cursor: dict[tuple[str, str], str] = {}
        #: whether entries may have come in from keys' lines, younger than their tasks (with
        #: keys off nobody waits in one: the age walk alone is exact)
        self.lines_used = any(settings.lane_share(key.owner) > 0 for key in settings.api_keys)
        bounds = [limit / 4 for limit in (settings.max_queue_seconds, settings.no_worker_seconds)
                  if limit > 0]
        self.period = max(0.2, min([30.0, *bounds]))

    async def ensure_queues(self) -> None:
        for backend in enabled_backends(self.settings):
            await self.store.ensure_queue(backend)

    async def backends(self) -> list[str]:
        """The enabled backends, and any other whose queue still holds tasks: a backend
        taken out of SPEECH_MODELS leaves its accepted tasks to the same bounds (its wait,
        no worker, deadlines), not PENDING for ever."""
        enabled = enabled_backends(self.settings)
        return enabled + [backend for backend in BACKENDS if backend not in enabled
                          and await upkeep.holds_tasks(self.store, backend)]

    async def sweep(self) -> None:
        live = {backend for backend, _ in await self.store.live.consumers()}
        for backend in await self.backends():
            if self.settings.max_queue_seconds > 0:
                await self.fail_overdue(backend, self.settings.max_queue_seconds)
            if self.settings.no_worker_seconds > 0:
                await self.fail_stranded(backend, backend in live)
            await self.fail_past_deadline(backend)
            await trim(self.store, backend,
                       max(self.settings.retention_seconds, self.settings.max_queue_seconds))
            await upkeep.forget_idle_consumers(self.store, backend, IDLE_CONSUMER_SECONDS)
        await self.store.blobs.sweep()  # files no task can read any more (SPEECH_BLOB_DIR)
        await self.voices.sweep()  # voices' files a stopped gateway left without a record
        try:  # last, and apart: a user without XGROUP (a restricted ACL) sweeps the rest
            await self.ensure_queues()
        except StoreError as exc:
            log.warning("could not make the queues' consumer groups: %s", exc)

    async def fail_overdue(self, backend: str, limit: float) -> int:
        """FAIL the PENDING tasks of `backend` queued more than `limit` seconds ago. Every
        entry past the cutoff is looked at once: a task seen started or finished never
        becomes PENDING again, so the walk never goes back. A task that waited in its key's
        line (common/store/shares.py) got its entry when it came in, which would date its wait
        from then: the lines are looked at from their head, and the entries no worker has
        read yet by the submit time they carry (their tasks' records are read only once
        that is past the cutoff)."""
        cutoff_ms = int((time.time() - limit) * 1000)
        error = (f"no {backend} worker started this task within {limit:.0f} s "
                 "(see /ready for live workers)")

        def overdue(task: Task) -> str | None:
            return (error if task.state == TaskState.PENDING and task.created_at * 1000 < cutoff_ms
                    else None)

        unread = [entry for lane in (upkeep.LANES if self.lines_used else ())
                  for entry in await upkeep.undelivered(self.store, backend, BATCH, lane)
                  if entry.queued_ms < cutoff_ms]
        failed = await self.fail_tasks(
            await upkeep.in_lines(self.store, backend, BATCH) + await self._tasks(unread),
            overdue)
        for lane in upkeep.LANES:
            for _ in range(MAX_BATCHES):
                start = self.overdue_cursor.get((backend, lane), "-")
                entries = await upkeep.queued_until(self.store, backend, start, cutoff_ms,
                                                    BATCH, lane)
                if not entries:
                    break
                failed += await self.fail_tasks(await self._tasks(entries), lambda task: error
                                                if task.state == TaskState.PENDING else None)
                self.overdue_cursor[(backend, lane)] = "(" + entries[-1].entry_id
                if len(entries) < BATCH:
                    break
        return failed

    async def fail_stranded(self, backend: str, live: bool) -> int:
        """With no live worker of `backend` for `no_worker_seconds`, FAIL what it still owes:
        its PENDING tasks, and its RUNNING tasks whose worker's heartbeat is gone."""
        if live:
            await upkeep.worker_seen(self.store, backend)
            return 0
        since = await upkeep.no_worker_since(self.store, backend, int(4 * self.period + 60))
        limit = self.settings.no_worker_seconds
        if time.time() - since < limit:
            return 0
        entries, cursors = [], {}
        for lane in upkeep.LANES:
            found, cursors[(backend, lane)] = await upkeep.owed(
                self.store, backend, self.owed_cursor.get((backend, lane), "0-0"),
                BATCH * MAX_BATCHES, lane)
            entries += found
        tasks = await self._tasks(entries) + await upkeep.in_lines(self.store, backend,
                                                                    BATCH * MAX_BATCHES)
        running = {task.worker for task in tasks if task.state == TaskState.RUNNING}
        gone = {worker for worker in running
                if not await upkeep.heartbeat_alive(self.store, backend, worker)}
        pending = (f"no {backend} worker has been live for {limit:.0f} s, so none can start "
                   "this task (see /ready)")

        def error(task: Task) -> str | None:
            if task.state == TaskState.PENDING:
                return pending
            if task.state == TaskState.RUNNING and task.worker in gone:
                return (f"its {backend} worker {task.worker} stopped, and no {backend} worker "
                        f"has been live for {limit:.0f} s (see /ready)")
            return None

        failed = await self.fail_tasks(tasks, error)
        self.owed_cursor.update(cursors)  # past what was read only once it is handled
        return failed

    async def fail_past_deadline(self, backend: str) -> int:
        """FAIL (`deadline_exceeded`) the queued tasks of `backend` whose deadline passed
        before a worker started them (a worker also refuses them at start)."""
        failed = 0
        for _ in range(MAX_BATCHES):
            task_ids = await upkeep.deadlines_passed(self.store, backend, BATCH)
            tasks = [task for task in await self.store.tasks(task_ids) if task is not None]
            failed += await self.fail_tasks(
                tasks, lambda task: "its deadline passed before a worker could start it"
                if task.state == TaskState.PENDING else None, ErrorCode.DEADLINE_EXCEEDED)
            # forgotten once handled: a pass cut short (Redis gone, the gateway stopped)
            # leaves them for the next
            await upkeep.forget_deadlines(self.store, backend, task_ids)
            if len(task_ids) < BATCH:
                break
        return failed

    async def _tasks(self, entries: list[Entry]) -> list[Task]:
        task_ids = [entry.task_id for entry in entries if entry.task_id is not None]
        return [task for task in await self.store.tasks(task_ids) if task is not None]

    async def fail_tasks(self, tasks: list[Task], error_for: Callable[[Task], str | None],
                         code: ErrorCode = ErrorCode.NO_WORKER) -> int:
        """FAIL each task (as read) for which `error_for` gives an error, fenced on the state
        and attempt it was read with."""
        failed = 0
        for task in tasks:
            error = error_for(task)
            if error is not None and await self.store.fail_if_unchanged(
                    task, error, code.value):
                log.warning("task %s: %s", task.id, error)
                failed += 1
        return failed


async def trim(store: TaskStore, backend: str, older_than: float) -> None:
    """Drop stream entries older than any task they could still serve: streams stay small."""
    await upkeep.trim(store, backend, older_than)
