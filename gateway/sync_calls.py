"""What the OpenAI-style calls share: they queue a task like any other, then wait for it.

The caller subscribes to the task's events before the task exists (so no segment is
missed), answers from the terminal state, or 504 with the task id if it takes too long.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from common.catalog import UnknownBackend, UnknownModel, resolve_public_model
from common.schemas import ErrorCode, TaskState
from common.settings import Settings
from common.store import Task, new_task_id
from gateway.app_errors import openai_error
from gateway.inputs import Params, RequestError
from gateway.state import redis_of, store_of
from gateway.submission import AudioInput, enqueue
from gateway.waiting import task_events


def public_model(settings: Settings, params: Params, default: str, kind: str) -> tuple[str, str]:
    """(backend, model) for the request's OpenAI-style `model`; 404 if unknown."""
    try:
        return resolve_public_model(settings, params.get("model") or default, kind)
    except (UnknownModel, UnknownBackend) as exc:
        raise RequestError(404, f"{exc}; GET /v1/models lists them", param="model",
                           code="model_not_found") from None


def response_format(params: Params, allowed: tuple[str, ...], default: str) -> str:
    value = (params.get("response_format") or default).lower()
    if value not in allowed:
        raise RequestError(400, f"response_format must be one of {', '.join(allowed)}",
                           param="response_format")
    return value


async def submit_and_listen(request: Request, settings: Settings, *, backend: str, model: str,
                            options: dict[str, Any], audio: AudioInput,
                            owner: str) -> tuple[str, AsyncGenerator[dict[str, Any], None]]:
    """Queue the task, already subscribed to its events; RequestError if refused."""
    task_id = new_task_id()
    events = task_events(redis_of(request), store_of(request), task_id,
                         settings.request_timeout_seconds)
    await anext(events)  # subscribed before the task exists
    try:
        await enqueue(store_of(request), settings, backend=backend, model=model,
                      options=options, audio=audio, owner=owner, task_id=task_id)
    except RequestError:
        await events.aclose()
        raise
    return task_id, events


async def wait_for(events: AsyncGenerator[dict[str, Any], None]) -> Task | None:
    """The finished task, or None when the wait timed out (the task goes on)."""
    async for event in events:
        if event["type"] == "done":
            return event["task"]
    return None


def failed_reply(task: Task) -> JSONResponse:
    if task.state == TaskState.CANCELLED:
        error = RequestError(409, "the task was cancelled", code="task_cancelled")
    else:
        code = ErrorCode(task.error_code or ErrorCode.ENGINE_ERROR)
        error = RequestError(code.http_status, task.error or "the task failed", code=code.value)
    response = openai_error(error)
    response.headers["x-task-id"] = task.id
    return response


def timeout_reply(task_id: str) -> JSONResponse:
    body = {"error": {"message": f"the task is still running; poll /v1/tasks/{task_id}",
                      "type": "timeout", "param": None, "code": "task_timeout"},
            "task_id": task_id}
    return JSONResponse(body, status_code=504, headers={"x-task-id": task_id})
