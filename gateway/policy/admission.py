"""Admission a caller can plan with (issue 18): predicted waits, 429s, deadlines.

Predicted start of a task = the processing time of the work queued ahead of it ÷ live
workers, plus the remaining time of the running tasks (estimated as half their processing
time) ÷ live workers. Processing time is per model: Σ over models of that model's queued
audio-seconds ÷ its measured rate (audio-seconds per wall second, a moving average the
workers record per model), so a backend serving a fast and a slow model weighs each
correctly. A model without a measured rate yet counts at the mean rate of the backend's
models that have one (else the backend's rate over all models); with no rate at all there is
no estimate. The task's own finish uses its model's rate. "Ahead" is O(1): the backlog keeps
running sums per lane and model, so a new task has the whole of its lane and the lanes read
before it ahead; a queued one has (queue_position - 1) tasks of the average queued
processing time ahead. Both are approximations (see the README).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

from common.schemas import BATCH
from common.settings import Settings
from common.store import QueueFull, StoreError, Task, TaskStore
from common.store import admission as facts
from gateway.errors import RequestError

#: Retry-After when there is no rate to compute one from yet
DEFAULT_RETRY_SECONDS = 5


@dataclass(frozen=True, slots=True)
class Estimate:
    start: float  # seconds from now until a worker starts the task
    finish: float  # … until it finishes

    def fields(self) -> dict[str, float]:
        return {"estimated_start_seconds": round(self.start, 2),
                "estimated_finish_seconds": round(self.finish, 2)}


@dataclass(frozen=True, slots=True)
class Outlook:
    """One read of what decides a backend's waits."""

    backlog: facts.Backlog
    rates: facts.Rates
    workers: int

    @property
    def fallback_rate(self) -> float | None:
        """The rate of a model not measured yet: the mean of the measured models' rates,
        else the backend's rate over all models (recorded before per-model rates)."""
        measured = self.rates.models.values()
        return sum(measured) / len(measured) if measured else self.rates.backend

    def rate_of(self, model: str) -> float | None:
        """`model`'s audio-seconds per wall second; None while the backend has no rate."""
        return self.rates.models.get(model) or self.fallback_rate

    def processing(self, seconds: Mapping[str, float]) -> float | None:
        """Wall seconds one worker takes for `seconds` (model -> audio-seconds); None while
        the backend has no rate."""
        fallback = self.fallback_rate
        if fallback is None:
            return None
        return sum(amount / (self.rates.models.get(model) or fallback)
                   for model, amount in seconds.items())

    def ahead(self, lane: str) -> tuple[int, float] | None:
        """(tasks, their processing seconds) queued in `lane` and the lanes read before it;
        None while the backend has no rate."""
        work = self.processing(self.backlog.ahead_by_model(lane))
        return None if work is None else (self.backlog.tasks_ahead(lane), work)

    def running_left(self, now: float) -> float | None:
        """Processing seconds left of the running tasks: per model, its running work less
        the time it has run (what started before start times were counted: half of it)."""
        fallback = self.fallback_rate
        if fallback is None:
            return None
        left = 0.0
        for model, seconds in self.backlog.running_by_model().items():
            total = seconds / (self.rates.models.get(model) or fallback)
            count, since = self.backlog.started.get(model, (0, 0.0))
            if count:
                left += min(total, max(0.0, total - (count * now - since)))
            else:
                left += total / 2
        return left

    def start_after(self, work_ahead: float) -> float | None:
        """Seconds until a task with `work_ahead` processing seconds queued ahead starts."""
        running = self.running_left(time.time())
        if running is None:
            return None
        return (work_ahead + running) / max(1, self.workers)

    def estimate(self, work_ahead: float, model: str, own_seconds: float) -> Estimate | None:
        start, rate = self.start_after(work_ahead), self.rate_of(model)
        if start is None or rate is None:
            return None
        return Estimate(start, start + own_seconds / rate)


async def outlook(store: TaskStore, backend: str) -> Outlook:
    return Outlook(*await store.outlook.facts(backend))


async def estimate_queued(store: TaskStore, task: Task, position: int | None) -> Estimate | None:
    """The estimate of a PENDING task `position` in line (None without a measured rate)."""
    if position is None:
        return None
    return estimate_at(await outlook(store, task.backend), task, position)


def estimate_at(view: Outlook, task: Task, position: int) -> Estimate | None:
    """`estimate_queued` from an outlook already read (a status poll reads it with the task)."""
    ahead, own = view.ahead(task.lane), view.processing({task.model: task.work_units})
    if ahead is None or own is None:
        return None
    tasks, work = ahead
    mean = work / tasks if tasks else own
    return view.estimate(max(0, position - 1) * mean, task.model, task.work_units)


async def admit(store: TaskStore, settings: Settings, task: Task) -> None:
    """Refuse (429) a task whose predicted start is past the backend's limit or its deadline;
    the queued-task limit itself is checked inside the submit (see `submitted`)."""
    limit = settings.max_queue_seconds_ahead.get(task.backend, 0)
    if not limit and task.deadline is None:
        return
    view = await outlook(store, task.backend)
    ahead = view.ahead(task.lane)
    if ahead is not None and settings.lane_share(task.owner):
        # the owner's own tasks in line go before it too, and are in no backlog yet
        # (common/store/shares.py); taken as its size each
        own = view.processing({task.model: task.work_units}) or 0.0
        ahead = (ahead[0], ahead[1] + own * await store.positions.in_line(task))
    start = (view.start_after(ahead[1]) if ahead else None) or 0.0
    if task.deadline is not None:
        left = task.deadline - time.time()
        if start > left or left <= 0:
            raise RequestError(429, f"the predicted start ({start:.1f} s from now) misses "
                                    f"the deadline ({left:.1f} s from now)",
                               param="deadline", code="deadline_unreachable",
                               headers=retry_after(start - max(left, 0.0)))
    if limit and start > limit:
        raise RequestError(429, f"the {task.backend} queue is full: the predicted wait is "
                                f"{start:.0f} s; the limit is {limit:.0f} s",
                           code="queue_full", headers=retry_after(start - limit))


async def queue_full(store: TaskStore, task: Task, full: QueueFull, most: int) -> RequestError:
    """The 429 of a submit the queued-task limit refused, with a computed Retry-After: how
    long the excess tasks take at the measured rate."""
    try:
        view = await outlook(store, task.backend)
    except StoreError:
        view = None
    wait = None
    if full.own:  # its share is freed as its own tasks start: at the rate, one of them
        return RequestError(429, f"this key holds {full.queued} of the {task.backend} "
                                 f"queue's tasks, its share of the limit {most}; retry "
                                 "when some have started", code="queue_full",
                            headers=retry_after(None if view is None else view.start_after(0)))
    if view is not None and (ahead := view.ahead(BATCH)) is not None:
        tasks, work = ahead
        mean = work / tasks if tasks else 0.0
        wait = view.start_after(mean * (full.queued - most + 1))
    return RequestError(429, f"the {task.backend} queue is full: {full.queued} tasks are "
                             f"queued; the limit is {most}",
                        code="queue_full", headers=retry_after(wait))


def retry_after(seconds: float | None) -> dict[str, str]:
    if seconds is None:
        return {"Retry-After": str(DEFAULT_RETRY_SECONDS)}
    return {"Retry-After": str(max(1, math.ceil(seconds)))}


def deadline_of(raw_deadline: str | None, raw_wait: str | None,
                past_ok: bool = False) -> float | None:
    """The task's deadline (epoch seconds) from `deadline` or `max_wait_seconds`; one already
    past is a 400 unless `past_ok` (then `refuse_past` checks it later)."""
    try:
        if raw_deadline:
            value = float(raw_deadline)
            name = "deadline"
        elif raw_wait:
            value = time.time() + float(raw_wait)
            name = "max_wait_seconds"
        else:
            return None
    except ValueError:
        value, name = math.nan, "deadline" if raw_deadline else "max_wait_seconds"
    if not math.isfinite(value):
        raise RequestError(400, f"{name} must be a number of seconds", param=name)
    if not past_ok:
        refuse_past(value, name)
    return value


def refuse_past(deadline: float | None, name: str = "deadline") -> None:
    """A 400 when `deadline` has passed: no wait could meet it (not a 429 to retry)."""
    if deadline is not None and deadline <= time.time():
        raise RequestError(400, f"{name} is already past: give a deadline in the future "
                                "(epoch seconds) or a positive max_wait_seconds",
                           param=name, code="deadline_passed")
