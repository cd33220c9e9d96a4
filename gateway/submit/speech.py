"""Text-to-speech submits: validate text, language, voice and speed before anything is queued.

What differs between TTS backends (languages, their spellings, the shortest reference clip)
is read from the backend's row of the table (common/backends.py).
A voice is either a built-in speaker (sent to the worker by name) or a reference clip:
an upload (stored as the task's input blob), a path under an allowed root, or a configured
`file:` voice. Every clip is probed here, so an unreadable or too short one is a 400.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from common.audio import AudioError, AudioInfo, probe_audio
from common.catalog import BACKENDS, speech_language
from common.schemas import MAX_SPEED, MIN_SPEED
from common.settings import Settings
from common.speech_text import unspeakable
from gateway.errors import RequestError
from gateway.submit.audio import AudioInput
from gateway.submit.inputs import Params, read_upload, resolve_allowed_path

NO_REFERENCE = AudioInfo(0.0, 0, 0, "")


async def tts_input(params: Params, settings: Settings, backend: str,
                    text_param: str = "text") -> tuple[dict[str, Any], AudioInput]:
    """(the task params a TTS worker of `backend` reads, its reference clip if any);
    RequestError if invalid."""
    text = (params.get(text_param) or "").strip()
    if not text:
        raise RequestError(400, f"'{text_param}' is empty: give the text to speak",
                           param=text_param)
    if len(text) > settings.tts_max_characters:
        raise RequestError(400, f"'{text_param}' has {len(text)} characters; the limit is "
                                f"{settings.tts_max_characters}", param=text_param,
                           code="text_too_long")
    try:
        language = speech_language(backend, params.get("language") or "en")
    except ValueError as exc:
        raise RequestError(400, str(exc), param="language", code="unsupported_language") from None
    if problem := unspeakable(text, language):
        raise RequestError(400, problem, param=text_param, code="unspeakable_text")
    options: dict[str, Any] = {"text": text, "language": language, "speed": _speed(params)}
    voice = params.get("voice")
    upload = params.upload("speaker_wav")
    raw_path = None if upload is not None else params.get("speaker_wav")
    if voice and (upload is not None or raw_path):
        raise RequestError(400, "give either 'voice' or 'speaker_wav', not both", param="voice")
    if settings.require_voice_consent and (upload is not None or raw_path):
        raise RequestError(403, "this service clones only voices with a recorded consent: "
                                "make one (POST /v1/audio/voice_consents, then "
                                "/v1/audio/voices) and name it in 'voice', or use a "
                                "configured voice", param="speaker_wav", code="consent_required")
    if upload is not None:
        blob = read_upload(upload, settings.max_upload_bytes, "speaker_wav")
        return options, AudioInput(blob, None, await _probe(blob, settings, backend))
    if params.voice_sample is not None:  # a custom voice (gateway/serving/voices.py)
        sample = params.voice_sample
        if params.custom_voice is not None:
            options["custom_voice"], options["consent"] = params.custom_voice
        return options, AudioInput(sample, None, await _probe(sample, settings, backend))
    if raw_path:
        path = resolve_allowed_path(raw_path, settings.allowed_roots, "speaker_wav")
        options["speaker_wav"] = str(path)
        return options, AudioInput(None, path, await _probe(path, settings, backend))
    kind, target = _voice(settings, voice)
    if kind == "speaker":
        options["voice"] = target
        return options, AudioInput(None, None, NO_REFERENCE)
    try:
        path = resolve_allowed_path(target, settings.allowed_roots, "voice")
    except RequestError as exc:
        raise RequestError(400, f"the reference clip of voice {voice!r} is unusable: "
                                f"{exc.message}", param="voice") from None
    options["speaker_wav"] = str(path)
    return options, AudioInput(None, path, await _probe(path, settings, backend))


def _speed(params: Params) -> float:
    raw = params.get("speed")
    try:
        speed = float(raw) if raw is not None else 1.0
    except ValueError:
        speed = float("nan")
    if not MIN_SPEED <= speed <= MAX_SPEED:  # also refuses nan
        raise RequestError(400, f"speed must be a number from {MIN_SPEED} to {MAX_SPEED}",
                           param="speed")
    return speed


def _voice(settings: Settings, voice: str | None) -> tuple[str, str]:
    """("speaker", name) or ("file", path) for a configured voice (the first one by default)."""
    if not settings.voices:
        raise RequestError(400, "no voices are configured: send a 'speaker_wav' reference clip",
                           param="voice")
    try:
        return settings.voice(voice)
    except KeyError:
        raise RequestError(400, f"unknown voice {voice!r}; configured voices: "
                                f"{', '.join(settings.voices)} (or send a 'speaker_wav' clip)",
                           param="voice", code="unknown_voice") from None


async def _probe(source: bytes | Path, settings: Settings, backend: str) -> AudioInfo:
    try:
        info = await asyncio.to_thread(probe_audio, source)
    except AudioError as exc:
        raise RequestError(400, f"the reference clip (speaker_wav) is unusable: {exc}",
                           param="speaker_wav", code="invalid_audio") from None
    except OSError as exc:
        raise RequestError(400, f"cannot read the reference clip ({exc.strerror})",
                           param="speaker_wav") from None
    row = BACKENDS[backend]
    if info.duration < row.min_reference_seconds:
        raise RequestError(400, f"the reference clip lasts {info.duration:.2f} s; "
                                f"{row.display_name} needs at least {row.min_reference_seconds} s "
                                "(5-30 s works best)", param="speaker_wav", code="invalid_audio")
    if info.duration > settings.max_audio_seconds:
        raise RequestError(413, f"the reference clip lasts {info.duration:.0f} s; the limit is "
                                f"{settings.max_audio_seconds:.0f} s", param="speaker_wav")
    return info
