"""REST view of tasks: `GET /v1/tasks/{id}` and `DELETE /v1/tasks/{id}` (cancel if PENDING)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from common.store import Task
from gateway.app_errors import openai_error
from gateway.auth import caller
from gateway.inputs import RequestError
from gateway.state import store_of
from gateway.submission import guard_store

router = APIRouter()


async def owned_task(request: Request, task_id: str) -> Task:
    """The caller's task, or a 404: another key's task is as unknown as a missing one."""
    owner = caller(request)
    task = await guard_store(store_of(request).get(task_id))
    if task is None or task.owner != owner:
        raise RequestError(404, "unknown or expired task", param="task_id",
                           code="task_not_found")
    return task


@router.get("/v1/tasks/{task_id}")
async def get_task(request: Request, task_id: str) -> JSONResponse:
    try:
        task = await owned_task(request, task_id)
    except RequestError as exc:
        return openai_error(exc)
    return JSONResponse(task.public_view())


@router.delete("/v1/tasks/{task_id}")
async def cancel_task(request: Request, task_id: str) -> JSONResponse:
    store = store_of(request)
    try:
        task = await owned_task(request, task_id)
        state = await guard_store(store.cancel(task_id, task.backend))
        if state != "CANCELLED":
            raise RequestError(409, f"only a PENDING task can be cancelled; this one is {state}",
                               param="task_id", code="not_cancellable")
        task = await guard_store(store.get(task_id))
    except RequestError as exc:
        return openai_error(exc)
    return JSONResponse(task.public_view() if task else {"id": task_id, "status": "CANCELLED"})
