"""The REST view of tasks: the caller's own task (another key's is a 404), and its webhook's
deliveries."""

from __future__ import annotations

from typing import Any

from common.schemas import TaskState
from common.store import Task, TaskStore
from common.store.connection import within_deadline
from common.store.poll import Poll
from common.store.webhooks import WebhookStore
from gateway.errors import RequestError
from gateway.policy.admission import Outlook, estimate_at
from gateway.policy.webhooks import event_id
from gateway.protocol import WebhookDeliveries
from gateway.submit.enqueue import guard_store


def public_view(task: Task) -> dict[str, Any]:
    """The REST view of `/v1/tasks/{id}` (and a webhook's body)."""
    view: dict[str, Any] = {
        "id": task.id,
        "status": task.state.value,
        "backend": task.backend,
        "model": task.model,
        "created_at": task.created_at,
        "started_at": task.started_at,
        "finished_at": task.finished_at,
        "attempts": task.attempt,
        "deliveries": task.deliveries,
        "worker": task.worker,
    }
    if task.state == TaskState.SUCCEEDED:
        view["result"] = task.result
    if task.error:
        view["error"] = task.error
        view["error_code"] = task.error_code or None
    return view


def queue_fields(poll: Poll) -> dict[str, Any]:
    """A PENDING task's place in line: `queue_position` and, once its backend has a measured
    rate, `estimated_start_seconds` and `estimated_finish_seconds` (SPEC: every PENDING
    reply, the Sage poll's and `/v1/tasks/{id}`'s)."""
    if poll.task.state != TaskState.PENDING or poll.position is None:
        return {}
    fields: dict[str, Any] = {"queue_position": poll.position}
    if poll.position and poll.outlook is not None:
        estimate = estimate_at(Outlook(*poll.outlook), poll.task, poll.position)
        if estimate is not None:
            fields.update(estimate.fields())
    return fields


async def task_view(store: TaskStore, task_id: str, owner: str) -> dict[str, Any]:
    """`GET /v1/tasks/{id}`: the caller's task, and where a PENDING one stands in line."""
    task = await owned_task(store, task_id, owner)
    view = public_view(task)
    if task.state == TaskState.PENDING:
        poll = await guard_store(within_deadline(store.poll.read(task_id)))
        if poll is not None:
            view.update(queue_fields(poll))
    return view


async def owned_task(store: TaskStore, task_id: str, owner: str) -> Task:
    """The caller's task, or a 404: another key's task is as unknown as a missing one."""
    task = await guard_store(within_deadline(store.get(task_id)))
    if task is None or task.owner != owner:
        raise RequestError(404, "unknown or expired task", param="task_id",
                           code="task_not_found")
    return task


def with_callback(task: Task) -> Task:
    if not task.callback_url:
        raise RequestError(409, "this task was submitted without a callback_url",
                           param="task_id", code="no_callback_url")
    return task


async def deliveries_view(webhooks: WebhookStore, task: Task) -> dict[str, Any]:
    attempts, due = await guard_store(webhooks.deliveries(task.id))
    if not task.state.terminal:
        state = "waiting"
    elif due is not None:
        state = "scheduled"
    else:
        state = attempts[-1]["outcome"] if attempts else "scheduled"
    return WebhookDeliveries(
        task_id=task.id, event_id=event_id(task.id, task.state) if task.state.terminal else None,
        state=state, next_attempt_at=due, attempts=attempts).model_dump()


async def cancel(store: TaskStore, task_id: str, owner: str) -> dict[str, Any]:
    """Cancel the caller's PENDING task; a 409 once a worker has started it."""
    task = await owned_task(store, task_id, owner)
    state = await guard_store(store.cancel(task_id, task.backend))
    if state != "CANCELLED":
        raise RequestError(409, f"only a PENDING task can be cancelled; this one is {state}",
                           param="task_id", code="not_cancellable")
    cancelled = await guard_store(store.get(task_id))
    return public_view(cancelled) if cancelled else {"id": task_id, "status": "CANCELLED"}


async def redeliver(store: TaskStore, webhooks: WebhookStore, task_id: str,
                    owner: str, per_minute: int = 0) -> dict[str, Any]:
    """Make the finished task's webhook due again now; a 409 for one still running."""
    task = with_callback(await owned_task(store, task_id, owner))
    done = await guard_store(webhooks.redeliver(task_id, owner, per_minute)) \
        if task.state.terminal else 0
    if done < 0:
        raise RequestError(429, f"this key has asked {per_minute} redeliveries this minute, its "
                                "most (SPEECH_WEBHOOK_REDELIVERIES_PER_MINUTE)",
                           code="too_many_redeliveries", headers={"Retry-After": "60"})
    if not done:
        raise RequestError(409, f"only a finished task's webhook can be sent again; this one "
                                f"is {task.state.value}", param="task_id",
                           code="task_not_finished")
    return await deliveries_view(webhooks, task)
