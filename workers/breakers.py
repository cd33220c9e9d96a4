"""What a model's loads mean for the queue: its breaker, and the rules for a failed load.

Before a task runs, the model's breaker admits it (closed, or this worker becomes the one
probe of a half-open breaker) or fails it fast. After the engine host reports a load: a
load that worked closes the breaker; a source that failed its pre-check fails its task
only and counts against the breaker; a load that failed half-built fails its task, counts,
and asks the process edge to exit, since only an exit returns what it may hold on the GPU.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from common.schemas import DIARIZER, ErrorCode, TaskState
from common.store import Admission, Task, WorkerStore
from workers.models import LoadReport

log = logging.getLogger("worker")


class ModelBreakers:
    def __init__(self, store: WorkerStore, sources: dict[str, str],
                 exit_after_load_failure: Callable[[], Awaitable[None]]) -> None:
        self.store = store
        self.sources = sources  # model name -> configured source: a breaker is per source
        self.exit_after_load_failure = exit_after_load_failure
        self.probing: set[str] = set()  # what this worker probes the half-open breaker of

    async def admit(self, model: str) -> str | None:
        """None when `model` may be loaded now (its breaker is closed, or this worker just
        became the probe of its half-open breaker), else why its tasks fail fast."""
        admission = await self.store.admit(model, self.sources.get(model, ""))
        if admission.verdict == "open":
            return _unavailable(model, admission)
        if admission.verdict == "probe":
            log.info("breaker of %s is half-open: this load is its probe", model)
            self.probing.add(model)
        return None

    async def open_ones(self) -> dict[str, str]:
        """Models whose breaker is open or half-open, with their load errors."""
        breakers = await self.store.breakers(self.sources)
        return {model: b.error for model, b in breakers.items() if b.state != "closed"}

    async def load_reported(self, task: Task | None, report: LoadReport) -> None:
        """The engine host's report of one acquisition; `task` is the task that asked for it
        (None: a preload or a direct HTTP call). Runs inside the host's engine lock."""
        probing = report.model in self.probing
        self.probing.discard(report.model)
        if report.ok:
            if report.loaded or probing:
                # A load that works ends the run of failures, and closes an open breaker.
                with contextlib.suppress(RedisError):
                    await self.store.clear_breaker(report.model)
            return
        if not report.allocated:
            # Found before anything was allocated: fail this task only, and keep serving.
            log.error("%s", report.error)
            await self._count_failure(report)
            return
        # Fail the task, count the failure, then end the process: only an exit returns what
        # a half-built model may hold on the GPU. supervisord starts a fresh worker.
        log.error("%s; exiting", report.error)
        if task is not None:
            with contextlib.suppress(RedisError):
                await self.fail_loading_task(task, report.error)
        await self._count_failure(report)
        await self.exit_after_load_failure()

    async def fail_loading_task(self, task: Task, error: str) -> None:
        """Store the task FAILED before the exit, so it is not redelivered to crash the next
        worker too; fenced by the attempt this worker opened for it."""
        current = await self.store.get(task.id)
        if (current is None or current.state != TaskState.RUNNING
                or current.worker != self.store.consumer):
            return
        if await self.store.finish(current, TaskState.FAILED, attempt=current.attempt,
                                   entry_id=current.entry_id, error=error,
                                   error_code=ErrorCode.MODEL_LOAD_FAILED.value):
            await self.store.record(("tasks_FAILED",))

    async def _count_failure(self, report: LoadReport) -> None:
        with contextlib.suppress(RedisError):
            await self.store.record(("load_failures",))
            if await self.store.record_load_failure(report.model, report.source, report.error):
                log.error("breaker open for %s/%s: its tasks fail fast until a probe loads it",
                          self.store.backend, report.model)


def _unavailable(model: str, admission: Admission) -> str:
    if admission.reopens_at is None:
        retry = "until a load works or the breaker is reset"
    elif (wait := admission.reopens_at - time.time()) > 0:
        retry = f"next load attempt in {wait:.0f} s"
    else:
        retry = "a probe load is under way"
    error = admission.error or "it failed to load"
    name = "the diarizer" if model == DIARIZER else f"model {model!r}"
    return f"{name} is unavailable ({retry}): {error}"
