"""Turn validated request parameters into a queued task: shared by the Sage and OpenAI routes."""

from __future__ import annotations

import asyncio
import math
import re
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from fastapi import Request

from common.audio import AudioError, AudioInfo, probe_audio
from common.catalog import (
    UnknownBackend,
    UnknownModel,
    asr_language,
    backend_info,
    resolve_model,
)
from common.schemas import MAX_BEAM_SIZE, TaskState
from common.settings import Settings
from common.store import (
    BreakerPolicy,
    Duplicate,
    QueueFull,
    QuotaExceeded,
    StoreError,
    Task,
    TaskStore,
    new_task_id,
)
from gateway.admission import admit, deadline_of, queue_full
from gateway.errors import RequestError, store_unavailable
from gateway.fetch import fetch_audio_url
from gateway.inputs import Params, read_upload, resolve_allowed_path
from gateway.quotas import charge_of, quota_exceeded
from gateway.webhooks import callback_url

ASR_TASKS = ("transcribe", "translate")
#: longest `prompt` (Whisper keeps only its last 224 tokens anyway)
MAX_PROMPT_CHARACTERS = 2000
_INTEGER = re.compile(r"\+?[0-9]{1,4}")
MAX_IDEMPOTENCY_KEY = 255
#: the priority lanes a submit may ask for (`priority`); interactive is read first
PRIORITIES = ("interactive", "batch")
T = TypeVar("T")


@dataclass(slots=True)
class AudioInput:
    blob: bytes | None
    path: Path | None
    info: AudioInfo


async def read_audio_input(params: Params, settings: Settings) -> AudioInput:
    """The request's audio (upload or allowed path), probed so garbage never reaches a queue."""
    upload = params.files.get("file")
    raw_path = params.get("audio_file", "audio_path")
    if upload is not None:
        blob = await read_upload(upload, int(settings.max_upload_mib * 1024 * 1024))
        source: bytes | Path = blob
        path = None
    elif raw_path is not None:
        path = resolve_allowed_path(raw_path, settings.allowed_roots,
                                    "audio_file" if params.get("audio_file") else "audio_path")
        blob, source = None, path
    elif audio_url := params.get("audio_url"):
        blob = await fetch_audio_url(audio_url, settings)
        source, path = blob, None
    else:
        raise RequestError(400, "no audio given: send a 'file' upload or an 'audio_path'",
                           param="file")
    try:
        info = await asyncio.to_thread(probe_audio, source)
    except AudioError as exc:
        raise RequestError(400, str(exc), param="file" if blob is not None else "audio_path",
                           code="invalid_audio") from None
    except OSError as exc:
        raise RequestError(400, f"cannot read the audio file ({exc.strerror})") from None
    if info.duration > settings.max_audio_seconds:
        raise RequestError(413, f"the audio lasts {info.duration:.0f} s; the limit is "
                                f"{settings.max_audio_seconds:.0f} s", param="file")
    return AudioInput(blob, path, info)


async def probe_clip(source: bytes | Path, param: str, what: str) -> AudioInfo:
    """Demux a further clip (a reference, a second input) before queueing, as the main input
    is: a 400 naming `param` when it is unusable; `what` names the clip in the message."""
    try:
        return await asyncio.to_thread(probe_audio, source)
    except AudioError as exc:
        raise RequestError(400, f"{what} is unusable: {exc}", param=param,
                           code="invalid_audio") from None
    except OSError as exc:
        raise RequestError(400, f"cannot read {what} ({exc.strerror})", param=param) from None


def resolve_backend_model(settings: Settings, backend: str, model: str | None) -> str:
    try:
        return resolve_model(settings, backend, model)
    except UnknownBackend as exc:
        raise RequestError(404, str(exc), param="backend", code="unknown_backend") from None
    except UnknownModel as exc:
        raise RequestError(404, str(exc), param="model", code="model_not_found") from None


def asr_params(params: Params, settings: Settings, backend: str) -> dict[str, Any]:
    """The transcription options a worker will read, validated against the backend."""
    try:
        info = backend_info(settings, backend)
    except UnknownBackend as exc:
        raise RequestError(404, str(exc), param="backend", code="unknown_backend") from None
    if info.kind != "asr":
        raise RequestError(400, f"backend {backend!r} does not transcribe", param="backend")
    task = (params.get("task") or "transcribe").strip().lower()
    if task not in ASR_TASKS:
        raise RequestError(400, "task must be 'transcribe' or 'translate'", param="task")
    if task == "translate" and not info.translate:
        raise RequestError(400, f"backend {backend!r} cannot translate", param="task")
    options: dict[str, Any] = {"task": task, "word_timestamps": params.flag("word_timestamps")}
    if language := params.get("language"):
        try:
            code = asr_language(backend, language)
        except ValueError as exc:
            raise RequestError(400, str(exc), param="language",
                               code="unsupported_language") from None
        if code is not None:
            options["language"] = code
    if prompt := params.get("prompt", "initial_prompt"):
        if len(prompt) > MAX_PROMPT_CHARACTERS:
            name = "prompt" if params.get("prompt") else "initial_prompt"
            raise RequestError(400, f"{name} has {len(prompt)} characters; the limit is "
                                    f"{MAX_PROMPT_CHARACTERS}", param=name)
        options["prompt"] = prompt
    if (raw := params.get("beam_size")) is not None:
        if not _INTEGER.fullmatch(raw.strip()) or not 1 <= int(raw) <= MAX_BEAM_SIZE:
            raise RequestError(400, f"beam_size must be an integer from 1 to {MAX_BEAM_SIZE}",
                               param="beam_size")
        options["beam_size"] = int(raw)
    if (raw := params.get("temperature")) is not None:
        options["temperature"] = number_in_range(raw, "temperature", 0.0, 1.0)
    if params.get("vad_filter") is not None:
        options["vad_filter"] = params.flag("vad_filter")
    return options


def number_in_range(raw: str, name: str, low: float, high: float) -> float:
    """`raw` as a finite number from `low` to `high`; a 400 naming `name` otherwise."""
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not low <= value <= high:  # also refuses nan and ±inf
        raise RequestError(400, f"{name} must be a number from {low:g} to {high:g}", param=name)
    return value


def idempotency_key(request: Request, params: Params) -> str:
    """The caller's `Idempotency-Key` header (or `idempotency_key` param); "" when absent."""
    key = request.headers.get("idempotency-key") or params.get("idempotency_key") or ""
    if len(key) > MAX_IDEMPOTENCY_KEY or not key.isprintable():
        raise RequestError(400, f"the idempotency key must be at most {MAX_IDEMPOTENCY_KEY} "
                                "printable characters", param="idempotency_key")
    return key


def priority(params: Params, default: str) -> str:
    """The `priority` param (interactive | batch), `default` when absent."""
    value = (params.get("priority") or default).strip().lower()
    if value not in PRIORITIES:
        raise RequestError(400, "priority must be 'interactive' or 'batch'", param="priority")
    return value


def default_lane(settings: Settings, owner: str, route_default: str) -> str:
    """The lane of a submit that names no `priority`: its key's default, else the route's."""
    key = settings.api_key(owner)
    return key.priority if key is not None and key.priority else route_default


@dataclass(frozen=True, slots=True)
class SubmitTerms:
    """What any submit may ask besides its work: an idempotency key, a lane, a deadline, a
    webhook."""

    idempotency_key: str = ""
    lane: str = "batch"
    deadline: float | None = None  # epoch seconds
    callback_url: str = ""  # checked against SPEECH_CALLBACK_URL_HOSTS

    @classmethod
    def of(cls, request: Request, params: Params, default_lane: str,
           settings: Settings) -> SubmitTerms:
        return cls(idempotency_key(request, params), priority(params, default_lane),
                   deadline_of(params.get("deadline"), params.get("max_wait_seconds")),
                   callback_url(params.get("callback_url"), settings))


async def enqueue(store: TaskStore, settings: Settings, *, backend: str, model: str,
                  options: dict[str, Any], audio: AudioInput, owner: str,
                  terms: SubmitTerms = SubmitTerms(), task_id: str | None = None) -> Task:
    """Queue a new task charged to its owner's usage, or return the original one for a
    repeated idempotency key; a 429 when the backend's queue is full or the deadline cannot
    be met (gateway/admission.py), or when the charge would pass a quota (gateway/quotas.py)."""
    # An open breaker refuses at once; past its cool-down the task goes through as its probe.
    source = settings.backend_models(backend).get(model, "")
    breakers = await guard_store(store.breakers(backend, {model: source},
                                                BreakerPolicy.of(settings)))
    breaker = breakers[model]
    if breaker.state == "open":
        raise RequestError(503, f"model {backend}/{model} is unavailable: {breaker.error}",
                           param="model", code="model_unavailable")
    seconds = round(audio.info.duration, 3)
    # what it costs its key is also its size for the backlog: audio-seconds, or characters
    charge = charge_of(settings, owner, backend, options, seconds)
    task = Task(id=task_id or new_task_id(), backend=backend, model=model, state=TaskState.PENDING,
                params=options, input_path=str(audio.path or ""), owner=owner,
                audio_seconds=seconds, work=charge.amount, lane=terms.lane,
                deadline=terms.deadline, callback_url=terms.callback_url)
    await guard_store(admit(store, settings, task))
    most = settings.max_queued_tasks.get(backend, 0)
    try:
        await guard_store(store.submit(task, audio.blob, terms.idempotency_key, most, charge))
    except QueueFull as full:
        raise await queue_full(store, task, full, most) from None
    except QuotaExceeded as refused:
        raise quota_exceeded(refused, time.time()) from None
    except Duplicate as repeat:
        original = await guard_store(store.get(repeat.task_id))
        if original is None:
            raise RequestError(409, "this idempotency key was used for a task that has expired",
                               param="idempotency_key", code="idempotency_key_expired") from None
        return original
    return task


async def guard_store(awaitable: Awaitable[T], headers: dict[str, str] | None = None) -> T:
    """The store call's result; a 503 (with `headers`) while the store is unavailable."""
    try:
        return await awaitable
    except StoreError as exc:
        raise store_unavailable(exc, headers) from None
