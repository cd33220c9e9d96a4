"""Sage llmage's submit and poll. Every status reply is HTTP 200 JSON with `status`.

Sage stops polling only on SUCCEEDED, FAILED or UNKNOWN, so a cancelled task is reported
as FAILED (with `state: CANCELLED`) and a store outage as PENDING with a `detail`.
"""

from __future__ import annotations

import contextlib
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from common.catalog import kind_of
from common.formats import fastwhisper_legacy
from common.schemas import BATCH, TaskState
from common.settings import Settings
from common.store import StoreError, Task, TaskStore
from common.store.voices import VoiceStore
from gateway.errors import RequestError
from gateway.policy.admission import Estimate, estimate_queued
from gateway.policy.signing import output_url
from gateway.serving.voices import use_custom_voice
from gateway.submit.enqueue import enqueue
from gateway.submit.inputs import read_params
from gateway.submit.kinds import read_task_input, resolve_backend_model
from gateway.submit.terms import SubmitTerms, default_lane


async def submit(request: Request, owner: str, settings: Settings, store: TaskStore,
                  backend: str | None) -> JSONResponse:
    params = await read_params(request)
    backend = backend or params.get("backend")
    if not backend:
        raise RequestError(400, "missing 'backend'", param="backend")
    model = resolve_backend_model(settings, backend, params.get("model"))
    # the terms are checked before any audio_url fetch
    terms = SubmitTerms.of(request, params, default_lane(settings, owner, BATCH), settings)
    await use_custom_voice(params, owner, VoiceStore.of(store))  # "voice_…": a custom voice
    options, audio = await read_task_input(params, settings, backend)
    task = await enqueue(store, settings, backend=backend, model=model, options=options,
                         audio=audio, owner=owner, terms=terms)
    reply: dict[str, Any] = {"task_id": task.id, "taskid": task.id, "status": "PENDING"}
    if task.state != TaskState.PENDING:  # an idempotent replay of a task that moved on
        reply["state"] = task.state.value
    else:
        with contextlib.suppress(StoreError):  # the task is queued: estimates are extras
            estimate = await estimate_queued(store, task, await store.queue_position(task))
            if estimate is not None:
                reply.update(estimate.fields())
    return JSONResponse(reply)


async def status(request: Request, owner: str, settings: Settings,
                  store: TaskStore) -> JSONResponse:
    """A refusal here (a bad key, body or value) is still HTTP 200: gateway.errors renders
    every refusal on these routes so (SAGE_STATUS_ROUTES)."""
    params = await read_params(request)
    task_id = params.get("task_id", "taskid")
    fmt = params.get("format")
    if not task_id:
        raise RequestError(400, "missing task_id", param="task_id")
    try:
        task = await store.get(task_id)
        position = await store.queue_position(task) if task and task.state == "PENDING" else None
        estimate = await estimate_queued(store, task, position) if task and position else None
    except StoreError:
        return JSONResponse({"task_id": task_id, "taskid": task_id, "status": "PENDING",
                             "detail": "the task store is briefly unavailable; keep polling"})
    if task is None or task.owner != owner:  # another key's task does not exist for you
        return JSONResponse({"task_id": task_id, "taskid": task_id, "status": "FAILED",
                             "error": "unknown or expired task"})
    audio_url = None
    if task.state == TaskState.SUCCEEDED and (kind := kind_of(task.backend)) and kind.audio_output:
        audio_url = output_url(request, settings, task.id)
    return JSONResponse(sage_status(task, position, fmt, audio_url, estimate))


def sage_status(task: Task, queue_position: int | None, fmt: str | None,
                audio_url: str | None = None,
                estimate: Estimate | None = None) -> dict[str, Any]:
    reply: dict[str, Any] = {"task_id": task.id, "taskid": task.id, "status": task.state.value}
    if task.state == TaskState.PENDING and queue_position is not None:
        reply["queue_position"] = queue_position
        if estimate is not None:
            reply.update(estimate.fields())
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
