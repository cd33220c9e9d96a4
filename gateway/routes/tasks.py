"""REST view of tasks: `GET /v1/tasks/{id}` and `DELETE /v1/tasks/{id}` (cancel if PENDING)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.app_errors import openai_error
from gateway.inputs import RequestError
from gateway.state import store_of
from gateway.submission import guard_store

router = APIRouter()


@router.get("/v1/tasks/{task_id}")
async def get_task(request: Request, task_id: str) -> JSONResponse:
    try:
        task = await guard_store(store_of(request).get(task_id))
        if task is None:
            raise RequestError(404, "unknown or expired task", param="task_id",
                               code="task_not_found")
    except RequestError as exc:
        return openai_error(exc)
    return JSONResponse(task.public_view())


@router.delete("/v1/tasks/{task_id}")
async def cancel_task(request: Request, task_id: str) -> JSONResponse:
    store = store_of(request)
    try:
        task = await guard_store(store.get(task_id))
        if task is None:
            raise RequestError(404, "unknown or expired task", param="task_id",
                               code="task_not_found")
        state = await guard_store(store.cancel(task_id, task.backend))
        if state != "CANCELLED":
            raise RequestError(409, f"only a PENDING task can be cancelled; this one is {state}",
                               param="task_id", code="not_cancellable")
        task = await guard_store(store.get(task_id))
    except RequestError as exc:
        return openai_error(exc)
    return JSONResponse(task.public_view() if task else {"id": task_id, "status": "CANCELLED"})
