"""The transcription options of an ASR submit, validated against its backend's row."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from common.catalog import UnknownBackend, asr_language, backend_info
from common.schemas import MAX_BEAM_SIZE, MAX_PROMPT_CHARACTERS, text_problem
from common.settings import Settings
from gateway.errors import RequestError
from gateway.submit.inputs import Params, integer_option

ASR_TASKS = ("transcribe", "translate")
#: longest `prompt` (Whisper keeps only its last 224 tokens anyway)


@dataclass(frozen=True, slots=True)
class AsrRequest:
    """What an ASR submit asks for, as typed values: read from a request's params, or built
    by a live session from its config; `asr_options` checks it against the backend."""

    task: str = "transcribe"
    language: str | None = None
    prompt: str | None = None
    prompt_param: str = "prompt"  # the name a refusal of the prompt gives
    beam_size: int | None = None
    temperature: float | None = None
    word_timestamps: bool = False
    vad_filter: bool | None = None

    @classmethod
    def read(cls, params: Params) -> AsrRequest:
        """The request's fields; a 400 naming the one that is not a value of its type."""
        beam_size = integer_option(params, "beam_size", 1, MAX_BEAM_SIZE)
        temperature = params.get("temperature")
        return cls(task=(params.get("task") or "transcribe").strip().lower(),
                   language=params.get("language"),
                   prompt=params.get("prompt", "initial_prompt"),
                   prompt_param="prompt" if params.get("prompt") else "initial_prompt",
                   beam_size=beam_size,
                   temperature=None if temperature is None
                   else number_in_range(temperature, "temperature", 0.0, 1.0),
                   word_timestamps=params.flag("word_timestamps"),
                   vad_filter=None if params.get("vad_filter") is None
                   else params.flag("vad_filter"))


def asr_params(params: Params, settings: Settings, backend: str) -> dict[str, Any]:
    """The transcription options a worker will read, validated against the backend."""
    return asr_options(AsrRequest.read(params), settings, backend)


def asr_options(request: AsrRequest, settings: Settings, backend: str) -> dict[str, Any]:
    """`request` checked against the backend: the options its worker reads; a 400 (404 for
    a backend that is not enabled) naming the field otherwise."""
    try:
        info = backend_info(settings, backend)
    except UnknownBackend as exc:
        raise RequestError(404, str(exc), param="backend", code="unknown_backend") from None
    if info.kind != "asr":
        raise RequestError(400, f"backend {backend!r} does not transcribe", param="backend")
    if request.task not in ASR_TASKS:
        raise RequestError(400, "task must be 'transcribe' or 'translate'", param="task")
    if request.task == "translate" and not info.translate:
        raise RequestError(400, f"backend {backend!r} cannot translate", param="task")
    if request.word_timestamps and not info.word_timestamps:  # not an empty `words` list
        raise RequestError(400, f"backend {backend!r} has no word timestamps",
                           param="word_timestamps")
    options: dict[str, Any] = {"task": request.task,
                               "word_timestamps": request.word_timestamps}
    if request.language:
        try:
            code = asr_language(backend, request.language)
        except ValueError as exc:
            raise RequestError(400, str(exc), param="language",
                               code="unsupported_language") from None
        if code is not None:
            options["language"] = code
    if prompt := request.prompt:
        name = request.prompt_param
        if problem := text_problem(prompt):
            raise RequestError(400, f"{name} {problem}", param=name)
        if len(prompt) > MAX_PROMPT_CHARACTERS:
            raise RequestError(400, f"{name} has {len(prompt)} characters; the limit is "
                                    f"{MAX_PROMPT_CHARACTERS}", param=name)
        options["prompt"] = prompt
    if request.beam_size is not None:
        options["beam_size"] = request.beam_size
    if request.temperature is not None:
        options["temperature"] = request.temperature
    if request.vad_filter is not None:
        options["vad_filter"] = request.vad_filter
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
