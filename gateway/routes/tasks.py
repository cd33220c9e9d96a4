"""REST view of tasks: `GET /v1/tasks/{id}` and `DELETE /v1/tasks/{id}` (cancel if PENDING)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from common.store import Task, TaskStore
from gateway.auth import Owner
from gateway.dependencies import StoreDep
from gateway.errors import RequestError, openai_errors
from gateway.protocol import TaskView
from gateway.submission import guard_store

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
