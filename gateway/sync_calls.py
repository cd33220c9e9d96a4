"""What the OpenAI-style calls share: they queue a task like any other, then wait for it.

The caller subscribes to the task's events before the task exists (so no segment is
missed), answers from the terminal state, or 504 with the task id if it takes too long.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from common.catalog import UnknownBackend, UnknownModel, resolve_public_model
from common.schemas import ErrorCode, TaskState
from common.settings import Settings
from common.store import Task, new_task_id
from gateway.app_errors import openai_error
from gateway.inputs import Params, RequestError
from gateway.limits import BodyRefused
from gateway.state import hub_of, store_of
from gateway.submission import AudioInput, enqueue


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
                            options: dict[str, Any], audio: AudioInput, owner: str,
                            idempotency_key: str = "",
                            ) -> tuple[str, AsyncGenerator[dict[str, Any], None]]:
    """Queue the task, already subscribed to its events; RequestError if refused (a 503
    with Retry-After when this process has too many waiting calls). A repeated
    idempotency key listens to the original task instead."""
    task_id = new_task_id()
    events = hub_of(request).events(store_of(request), task_id,
                                     settings.request_timeout_seconds)
    await anext(events)  # subscribed before the task exists
    try:
        task = await enqueue(store_of(request), settings, backend=backend, model=model,
                             options=options, audio=audio, owner=owner, task_id=task_id,
                             idempotency_key=idempotency_key)
    except RequestError:
        await events.aclose()
        raise
    if task.id != task_id:
        await events.aclose()
        # The subscription comes before the state is read, so a finished original is seen.
        events = hub_of(request).events(store_of(request), task.id,
                                         settings.request_timeout_seconds)
        await anext(events)
    return task.id, events


class Disconnected:
    """The caller hung up while waiting: nobody reads the reply (the task goes on)."""


async def wait_for(request: Request,
                   events: AsyncGenerator[dict[str, Any], None]) -> Task | Disconnected | None:
    """The finished task, None when the wait timed out (the task goes on), or Disconnected
    as soon as the client hangs up, which releases the waiter at once."""
    waiting = asyncio.ensure_future(_done(events))
    hung_up = asyncio.ensure_future(_client_gone(request))
    try:
        await asyncio.wait({waiting, hung_up}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for future in (waiting, hung_up):
            future.cancel()
        await asyncio.gather(waiting, hung_up, return_exceptions=True)
        await events.aclose()
    if waiting.done() and not waiting.cancelled():
        return waiting.result()
    return Disconnected()


async def _done(events: AsyncGenerator[dict[str, Any], None]) -> Task | None:
    async for event in events:
        if event["type"] == "done":
            return event["task"]
    return None


async def _client_gone(request: Request) -> None:
    """Returns when the client disconnects (the request body has been read by then)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except BodyRefused:  # a body nobody read: stop watching, the wait has its own deadline
        await asyncio.Event().wait()


def disconnected_reply() -> Response:
    return Response(status_code=499)  # never delivered: the client is gone


def failed_reply(task: Task) -> JSONResponse:
    if task.state == TaskState.CANCELLED:
        error = RequestError(409, "the task was cancelled", code="task_cancelled")
    else:
        code = ErrorCode(task.error_code or ErrorCode.ENGINE_ERROR)
        message = task.error or "the task failed"
        if code == ErrorCode.OUT_OF_MEMORY:
            message = ("the worker has too little memory for this file right now (not an "
                       f"upload size limit); retry later or with shorter audio: {message}")
        error = RequestError(code.http_status, message, code=code.value)
    response = openai_error(error)
    response.headers["x-task-id"] = task.id
    return response


def timeout_reply(task_id: str) -> JSONResponse:
    body = {"error": {"message": f"the task is still running; poll /v1/tasks/{task_id}",
                      "type": "timeout", "param": None, "code": "task_timeout"},
            "task_id": task_id}
    return JSONResponse(body, status_code=504, headers={"x-task-id": task_id})
