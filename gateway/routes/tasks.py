"""REST view of tasks: `GET /v1/tasks/{id}`, `DELETE /v1/tasks/{id}` (cancel if PENDING), and
its webhook: `GET /v1/tasks/{id}/deliveries`, `POST /v1/tasks/{id}/redeliver`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from common.store import Task, TaskStore
from common.store.webhooks import WebhookStore
from gateway.auth import Owner
from gateway.dependencies import StoreDep, WebhooksDep
from gateway.errors import RequestError, openai_errors
from gateway.protocol import TaskView, WebhookDeliveries
from gateway.submission import guard_store
from gateway.webhooks import event_id

router = APIRouter(tags=["Tasks"])


async def owned_task(store: TaskStore, task_id: str, owner: str) -> Task:
    """The caller's task, or a 404: another key's task is as unknown as a missing one."""
    task = await guard_store(store.get(task_id))
    if task is None or task.owner != owner:
        raise RequestError(404, "unknown or expired task", param="task_id",
                           code="task_not_found")
    return task


@router.get("/v1/tasks/{task_id}",
            responses={200: {"model": TaskView}, **openai_errors(401, 404, 503)})
async def get_task(task_id: str, owner: Owner, store: StoreDep) -> JSONResponse:
    """Any task's state, and its result once SUCCEEDED (the 504 of a waiting call names it)."""
    task = await owned_task(store, task_id, owner)
    return JSONResponse(task.public_view())


@router.delete("/v1/tasks/{task_id}",
               responses={200: {"model": TaskView}, **openai_errors(401, 404, 409, 503)})
async def cancel_task(task_id: str, owner: Owner, store: StoreDep) -> JSONResponse:
    """Cancel a PENDING task (a 409 once a worker has started it)."""
    task = await owned_task(store, task_id, owner)
    state = await guard_store(store.cancel(task_id, task.backend))
    if state != "CANCELLED":
        raise RequestError(409, f"only a PENDING task can be cancelled; this one is {state}",
                           param="task_id", code="not_cancellable")
    cancelled = await guard_store(store.get(task_id))
    return JSONResponse(cancelled.public_view() if cancelled
                        else {"id": task_id, "status": "CANCELLED"})


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


@router.get("/v1/tasks/{task_id}/deliveries",
            responses={200: {"model": WebhookDeliveries}, **openai_errors(401, 404, 409, 503)})
async def deliveries(task_id: str, owner: Owner, store: StoreDep,
                     webhooks: WebhooksDep) -> JSONResponse:
    """The task's webhook attempts (time, HTTP status or error, duration) and what is next
    (a 409 for a task without a `callback_url`)."""
    task = with_callback(await owned_task(store, task_id, owner))
    return JSONResponse(await deliveries_view(webhooks, task))


@router.post("/v1/tasks/{task_id}/redeliver", status_code=202,
             responses={202: {"model": WebhookDeliveries}, **openai_errors(401, 404, 409, 503)})
async def redeliver(task_id: str, owner: Owner, store: StoreDep,
                    webhooks: WebhooksDep) -> JSONResponse:
    """Send the finished task's webhook again, now, with the same event id (a new series of
    retries); a 409 for a task still running or without a `callback_url`."""
    task = with_callback(await owned_task(store, task_id, owner))
    if not task.state.terminal or not await guard_store(webhooks.redeliver(task_id)):
        raise RequestError(409, f"only a finished task's webhook can be sent again; this one "
                                f"is {task.state.value}", param="task_id",
                           code="task_not_finished")
    return JSONResponse(await deliveries_view(webhooks, task), status_code=202)
