"""Speech output: `POST /v1/audio/speech` (OpenAI shape, through the queue) and
`GET /v1/tasks/{id}/audio` (a finished TTS task's WAV, by signed URL or by its owner's key).
"""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from common.audio import OUTPUT_FORMATS, AudioError, transcode
from common.schemas import TaskState
from common.store import Task
from gateway.app_errors import openai_error
from gateway.auth import caller
from gateway.inputs import RequestError, read_params
from gateway.state import settings_of, store_of
from gateway.submission import guard_store, idempotency_key
from gateway.sync_calls import (
    Disconnected,
    disconnected_reply,
    failed_reply,
    public_model,
    response_format,
    submit_and_listen,
    timeout_reply,
    wait_for,
)
from gateway.tts import output_url, token_valid, tts_input

router = APIRouter()


@router.get("/v1/tasks/{task_id}/audio")
async def task_audio(request: Request, task_id: str, token: str | None = None) -> Response:
    try:
        store = store_of(request)
        task = await guard_store(store.get(task_id))
        audio = None
        if task is not None and task.state == TaskState.SUCCEEDED and _may_read(request, task,
                                                                                 token):
            audio = await guard_store(store.output_blob(task_id))
        if audio is None:  # unknown, not yours, not finished or expired: all look the same
            raise RequestError(404, "unknown or expired audio", param="task_id",
                               code="audio_not_found")
    except RequestError as exc:
        return openai_error(exc)
    return Response(audio, media_type="audio/wav",
                    headers={"content-disposition": f'inline; filename="{task_id}.wav"'})


def _may_read(request: Request, task: Task, token: str | None) -> bool:
    """A valid signed token, or (when API keys are on) the key that submitted the task."""
    settings = settings_of(request)
    if token_valid(settings, task.id, token):
        return True
    if not settings.api_keys:
        return False  # no keys: the signed URL is the only credential
    try:
        return caller(request) == task.owner
    except RequestError:
        return False


@router.post("/v1/audio/speech")
async def speech(request: Request) -> Response:
    settings = settings_of(request)
    try:
        owner = caller(request)
        params = await read_params(request)
        backend, model = public_model(settings, params, "tts-1", "tts")
        fmt = response_format(params, OUTPUT_FORMATS, "mp3")
        if (params.get("stream_format") or "audio") != "audio":
            raise RequestError(400, "only stream_format 'audio' is supported",
                               param="stream_format")
        options, audio = await tts_input(params, settings, backend, text_param="input")
        task_id, events = await submit_and_listen(request, settings, backend=backend,
                                                  model=model, options=options, audio=audio,
                                                  owner=owner,
                                                  idempotency_key=idempotency_key(request, params))
    except RequestError as exc:
        return openai_error(exc)
    finished = await wait_for(request, events)
    if isinstance(finished, Disconnected):
        return disconnected_reply()
    if finished is not None:
        return await _audio_reply(request, finished, fmt)
    response = timeout_reply(task_id)  # the audio stays fetchable (as WAV) once it finishes
    response.headers["x-output-url"] = output_url(request, settings, task_id)
    return response


async def _audio_reply(request: Request, task: Task, response_format: str) -> Response:
    if task.state != TaskState.SUCCEEDED:
        return failed_reply(task)
    headers = {"x-task-id": task.id}
    try:
        wav = await guard_store(store_of(request).output_blob(task.id))
        if wav is None:
            raise RequestError(500, "the synthesized audio is missing", code="audio_missing")
        body, content_type = await asyncio.to_thread(transcode, wav, response_format)
    except (RequestError, AudioError) as exc:
        error = exc if isinstance(exc, RequestError) else RequestError(500, str(exc))
        response = openai_error(error)
        response.headers.update(headers)
        return response
    return Response(body, media_type=content_type, headers=headers)
