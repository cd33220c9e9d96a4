"""Sage llmage endpoints: submit, then poll. Every status reply is HTTP 200 JSON with `status`.

Sage stops polling only on SUCCEEDED, FAILED or UNKNOWN, so a cancelled task is reported
as FAILED (with `state: CANCELLED`) and a store outage as PENDING with a `detail`.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from common.catalog import kind_of
from common.formats import fastwhisper_legacy
from common.schemas import TaskState
from common.store import Task
from gateway.app_errors import sage_error
from gateway.auth import caller
from gateway.inputs import RequestError, read_params
from gateway.kinds import read_task_input
from gateway.state import settings_of, store_of
from gateway.submission import enqueue, idempotency_key, resolve_backend_model
from gateway.tts import output_url

router = APIRouter()
BOTH = ["GET", "POST"]


@router.api_route("/api/submit", methods=BOTH)
async def submit(request: Request) -> JSONResponse:
    return await _submit(request, None)


@router.api_route("/api/{backend}-submit", methods=BOTH)
async def submit_to(request: Request, backend: str) -> JSONResponse:
    return await _submit(request, backend)


@router.api_route("/api/status", methods=BOTH)
async def status(request: Request) -> JSONResponse:
    return await _status(request)


@router.api_route("/api/{backend}-status", methods=BOTH)
async def status_of(request: Request, backend: str) -> JSONResponse:
    del backend  # ids are unique across backends
    return await _status(request)


async def _submit(request: Request, backend: str | None) -> JSONResponse:
    settings = settings_of(request)
    try:
        owner = caller(request)
        params = await read_params(request)
        backend = backend or params.get("backend")
        if not backend:
            raise RequestError(400, "missing 'backend'", param="backend")
        model = resolve_backend_model(settings, backend, params.get("model"))
        options, audio = await read_task_input(params, settings, backend)
        task = await enqueue(store_of(request), settings, backend=backend, model=model,
                             options=options, audio=audio, owner=owner,
                             idempotency_key=idempotency_key(request, params))
    except RequestError as exc:
        return sage_error(exc)
    reply = {"task_id": task.id, "taskid": task.id, "status": "PENDING"}
    if task.state != TaskState.PENDING:  # an idempotent replay of a task that moved on
        reply["state"] = task.state.value
    return JSONResponse(reply)


async def _status(request: Request) -> JSONResponse:
    try:
        owner = caller(request)
        params = await read_params(request)
        task_id = params.get("task_id", "taskid")
        fmt = params.get("format")
    except RequestError as exc:  # a bad key, body or value: still HTTP 200, as Sage expects
        return JSONResponse({"status": "FAILED", "error": exc.message})
    if not task_id:
        return JSONResponse({"status": "FAILED", "error": "missing task_id"})
    store = store_of(request)
    try:
        task = await store.get(task_id)
        position = await store.queue_position(task) if task and task.state == "PENDING" else None
    except RedisError:
        return JSONResponse({"task_id": task_id, "taskid": task_id, "status": "PENDING",
                             "detail": "the task store is briefly unavailable; keep polling"})
    if task is None or task.owner != owner:  # another key's task does not exist for you
        return JSONResponse({"task_id": task_id, "taskid": task_id, "status": "FAILED",
                             "error": "unknown or expired task"})
    audio_url = None
    if task.state == TaskState.SUCCEEDED and (kind := kind_of(task.backend)) and kind.audio_output:
        audio_url = output_url(request, settings_of(request), task.id)
    return JSONResponse(sage_status(task, position, fmt, audio_url))


def sage_status(task: Task, queue_position: int | None, fmt: str | None,
                audio_url: str | None = None) -> dict[str, Any]:
    reply: dict[str, Any] = {"task_id": task.id, "taskid": task.id, "status": task.state.value}
    if task.state == TaskState.PENDING and queue_position is not None:
        reply["queue_position"] = queue_position
    elif task.state == TaskState.SUCCEEDED and task.result is not None:
        result = task.result
        reply["usage"] = result.get("usage", {})
        kind = kind_of(task.backend)
        legacy = fmt == "fastwhisper" and kind is not None and kind.name == "asr"
        reply["result"] = fastwhisper_legacy(result) if legacy else result
        if audio_url:
            reply["output_url"] = audio_url
    elif task.state == TaskState.FAILED:
        reply["error"] = task.error or "the task failed"
    elif task.state == TaskState.CANCELLED:
        reply.update(status="FAILED", state="CANCELLED", error=task.error or "task was cancelled")
    return reply
