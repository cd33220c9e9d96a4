"""REST view of tasks: `GET /v1/tasks/{id}`, `DELETE /v1/tasks/{id}` (cancel if PENDING), and
its webhook: `GET /v1/tasks/{id}/deliveries`, `POST /v1/tasks/{id}/redeliver`."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from gateway.auth import Owner
from gateway.dependencies import SettingsDep, StoreDep, WebhooksDep
from gateway.errors import openai_errors
from gateway.protocol import TaskView, WebhookDeliveries
from gateway.serving import tasks

router = APIRouter(tags=["Tasks"])


@router.get("/v1/tasks/{task_id}",
            responses={200: {"model": TaskView}, **openai_errors(401, 404, 503)})
async def get_task(task_id: str, owner: Owner, store: StoreDep) -> JSONResponse:
    """Any task's state, and its result once SUCCEEDED (the 504 of a waiting call names it)."""
    return JSONResponse(await tasks.task_view(store, task_id, owner))


@router.delete("/v1/tasks/{task_id}",
               responses={200: {"model": TaskView}, **openai_errors(401, 404, 409, 503)})
async def cancel_task(task_id: str, owner: Owner, store: StoreDep) -> JSONResponse:
    """Cancel a PENDING task (a 409 once a worker has started it)."""
    return JSONResponse(await tasks.cancel(store, task_id, owner))


@router.get("/v1/tasks/{task_id}/deliveries",
            responses={200: {"model": WebhookDeliveries}, **openai_errors(401, 404, 409, 503)})
async def deliveries(task_id: str, owner: Owner, store: StoreDep,
                     webhooks: WebhooksDep) -> JSONResponse:
    """The task's webhook attempts (time, HTTP status or error, duration) and what is next
    (a 409 for a task without a `callback_url`)."""
    task = tasks.with_callback(await tasks.owned_task(store, task_id, owner))
    return JSONResponse(await tasks.deliveries_view(webhooks, task))


@router.post("/v1/tasks/{task_id}/redeliver", status_code=202,
             responses={202: {"model": WebhookDeliveries},
                        **openai_errors(401, 404, 409, 429, 503)})
async def redeliver(task_id: str, owner: Owner, store: StoreDep, webhooks: WebhooksDep,
                    settings: SettingsDep) -> JSONResponse:
    """Send the finished task's webhook again, now, with the same event id (a new series of
    retries); a 409 for a task still running or without a `callback_url`, a 429 past the
    key's redeliveries per minute."""
    return JSONResponse(await tasks.redeliver(store, webhooks, task_id, owner,
                                              settings.webhook_redeliveries_per_minute),
                        status_code=202)
