"""OpenAI-compatible audio API: transcriptions, translations, models.

These calls use the same queue and workers as async tasks; the request waits for its
task (pub/sub, not polling) and answers 504 with the task id if it takes too long.
"""

from __future__ import annotations

import json
import math
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from common import formats
from common.catalog import (
    BACKENDS,
    enabled_backends,
    public_config,
)
from common.schemas import TaskState
from common.store import Task
from gateway.app_errors import openai_error
from gateway.auth import caller
from gateway.inputs import Params, RequestError, read_params
from gateway.state import settings_of
from gateway.submission import asr_params, idempotency_key, read_audio_input
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

router = APIRouter()
RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json", "diarized_json")
SEGMENT_FIELDS = ("id", "seek", "start", "end", "text", "tokens", "temperature", "avg_logprob",
                  "compression_ratio", "no_speech_prob")


@router.post("/v1/audio/transcriptions")
async def transcriptions(request: Request) -> Response:
    return await _asr(request, "transcribe")


@router.post("/v1/audio/translations")
async def translations(request: Request) -> Response:
    return await _asr(request, "translate")


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    try:
        caller(request)
    except RequestError as exc:
        return openai_error(exc)
    settings = settings_of(request)
    data = [{"id": f"{backend}/{model}", "object": "model", "created": 0,
             "owned_by": "speech-gateway", "backend": backend, "kind": BACKENDS[backend].kind}
            for backend in enabled_backends(settings) for model in settings.backend_models(backend)]
    for alias, target in public_config(settings)["aliases"].items():
        backend = target.split("/", 1)[0]
        data.append({"id": alias, "object": "model", "created": 0, "owned_by": "speech-gateway",
                     "backend": backend, "kind": BACKENDS[backend].kind, "alias_of": target})
    return JSONResponse({"object": "list", "data": data})


async def _asr(request: Request, task: str) -> Response:
    settings = settings_of(request)
    try:
        owner = caller(request)
        params = await read_params(request)
        if "file" not in params.files:
            raise RequestError(400, "missing the 'file' upload", param="file")
        backend, model = public_model(settings, params, "whisper-1", "asr")
        fmt = response_format(params, RESPONSE_FORMATS, "json")
        if fmt == "diarized_json" and not BACKENDS[backend].speakers:
            raise RequestError(400, f"{backend} does not identify speakers; diarized_json needs "
                                    "a backend that does (vibevoice)", param="response_format")
        granularities = _granularities(params)
        params.override("task", task)
        params.override("word_timestamps", "true" if "word" in granularities else "false")
        if "word" in granularities and not BACKENDS[backend].word_timestamps:
            raise RequestError(400, f"{backend} has no word timestamps",
                               param="timestamp_granularities[]")
        if task == "translate":
            params.override("language", None)  # the output language of a translation is English
        options = asr_params(params, settings, backend)
        stream = params.flag("stream")
        audio = await read_audio_input(params, settings)
        task_id, events = await submit_and_listen(request, settings, backend=backend,
                                                  model=model, options=options, audio=audio,
                                                  owner=owner,
                                                  idempotency_key=idempotency_key(request, params))
    except RequestError as exc:
        return openai_error(exc)
    if stream:
        return StreamingResponse(_sse(events), media_type="text/event-stream",
                                 headers={"x-task-id": task_id, "cache-control": "no-cache"})
    finished = await wait_for(request, events)
    if isinstance(finished, Disconnected):
        return disconnected_reply()
    if finished is None:
        return timeout_reply(task_id)
    return _render(finished, fmt, task, granularities)


def _granularities(params: Params) -> set[str]:
    values = params.lists.get("timestamp_granularities[]", []) + params.lists.get(
        "timestamp_granularities", [])
    found: set[str] = set()
    for value in values:
        items: Any = [value]
        if value.lstrip().startswith("["):  # a JSON list in one field
            try:
                items = json.loads(value)
            except (ValueError, RecursionError):
                items = None
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise RequestError(400, "timestamp_granularities must be 'word', 'segment' or a "
                                    "list of them", param="timestamp_granularities[]")
        found.update(item.strip().lower() for item in items)
    if found - {"word", "segment"}:
        raise RequestError(400, "timestamp_granularities may hold 'word' and 'segment'",
                           param="timestamp_granularities[]")
    return found or {"segment"}


def _render(task: Task, response_format: str, kind: str, granularities: set[str]) -> Response:
    if task.state != TaskState.SUCCEEDED or task.result is None:
        return failed_reply(task)
    result = task.result
    headers = {"x-task-id": task.id}
    seconds = result["usage"]["audio_seconds"]
    usage = {"type": "duration", "seconds": math.ceil(seconds)}
    if response_format == "text":
        return PlainTextResponse(result["text"] + "\n", headers=headers)
    if response_format == "srt":
        return PlainTextResponse(formats.srt(result["segments"]), headers=headers,
                                 media_type="application/x-subrip")
    if response_format == "vtt":
        return PlainTextResponse(formats.vtt(result["segments"]), headers=headers,
                                 media_type="text/vtt")
    if response_format == "json":
        return JSONResponse({"text": result["text"], "usage": usage}, headers=headers)
    if response_format == "diarized_json":
        segments = [{"type": "transcript.text.segment", "id": str(s["id"]), "start": s["start"],
                     "end": s["end"], "text": s["text"], "speaker": s.get("speaker") or "A"}
                    for s in result["segments"]]
        return JSONResponse({"task": kind, "duration": result["duration"], "text": result["text"],
                             "segments": segments, "usage": usage}, headers=headers)
    body: dict[str, Any] = {"task": kind, "language": result["language"],
                            "duration": float(result["duration"]), "text": result["text"],
                            "usage": usage}
    if "segment" in granularities:
        body["segments"] = [{field: s.get(field) for field in SEGMENT_FIELDS}
                            for s in result["segments"]]
    if "word" in granularities:
        body["words"] = [{"word": w["word"], "start": w["start"], "end": w["end"]}
                         for s in result["segments"] for w in s.get("words") or []]
    return JSONResponse(body, headers=headers)


async def _sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    async for event in events:
        if event["type"] == "segment":
            yield _sse_line({"type": "transcript.text.delta", "delta": event["text"]})
        elif event["type"] == "done":
            task: Task = event["task"]
            if task.state == TaskState.SUCCEEDED and task.result is not None:
                seconds = task.result["usage"]["audio_seconds"]
                yield _sse_line({"type": "transcript.text.done", "text": task.result["text"],
                                 "usage": {"type": "duration", "seconds": math.ceil(seconds)}})
            else:
                yield _sse_line({"type": "error", "error": {
                    "message": task.error or "the task failed", "type": "server_error",
                    "param": None, "code": "task_failed"}})
        elif event["type"] == "timeout":
            yield _sse_line({"type": "error", "error": {
                "message": "the task is still running", "type": "timeout", "param": None,
                "code": "task_timeout"}})


def _sse_line(payload: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()
