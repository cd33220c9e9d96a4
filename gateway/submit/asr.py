"""The transcription options of an ASR submit, validated against its backend's row."""

from __future__ import annotations

import math
import re
from typing import Any

from common.catalog import UnknownBackend, asr_language, backend_info
from common.schemas import MAX_BEAM_SIZE
from common.settings import Settings
from gateway.errors import RequestError
from gateway.submit.inputs import Params

ASR_TASKS = ("transcribe", "translate")
#: longest `prompt` (Whisper keeps only its last 224 tokens anyway)
MAX_PROMPT_CHARACTERS = 2000
_INTEGER = re.compile(r"\+?[0-9]{1,4}")


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
