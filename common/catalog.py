"""Backends, their capabilities, models and public names: what `/api/config` serves.

The gateway never imports an engine (engines live in other environments); what it
must know about a backend to validate a request is written here once.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import asdict, dataclass
from typing import Any

from common.schemas import MAX_SPEED, MIN_SPEED
from common.settings import Settings


@dataclass(frozen=True, slots=True)
class BackendInfo:
    name: str
    kind: str  # "asr" | "tts"
    translate: bool = False
    word_timestamps: bool = False
    speakers: bool = False
    #: the language codes a backend accepts; the gateway refuses any other before queueing
    languages: tuple[str, ...] = ()


#: languages XTTS v2 speaks, as its config names them. Kept here, not in the engine module,
#: so the gateway can refuse a language before queueing without importing an engine.
XTTS_LANGUAGES: tuple[str, ...] = (
    "en", "es", "fr", "de", "it", "pt", "pl", "tr", "ru", "nl", "cs", "ar", "zh-cn", "hu",
    "ko", "ja", "hi",
)  # fmt: skip
#: Whisper's language codes (faster_whisper.tokenizer._LANGUAGE_CODES)
WHISPER_LANGUAGES: tuple[str, ...] = (
    "af", "am", "ar", "as", "az", "ba", "be", "bg", "bn", "bo", "br", "bs", "ca", "cs", "cy",
    "da", "de", "el", "en", "es", "et", "eu", "fa", "fi", "fo", "fr", "gl", "gu", "ha", "haw",
    "he", "hi", "hr", "ht", "hu", "hy", "id", "is", "it", "ja", "jw", "ka", "kk", "km", "kn",
    "ko", "la", "lb", "ln", "lo", "lt", "lv", "mg", "mi", "mk", "ml", "mn", "mr", "ms", "mt",
    "my", "ne", "nl", "nn", "no", "oc", "pa", "pl", "ps", "pt", "ro", "ru", "sa", "sd", "si",
    "sk", "sl", "sn", "so", "sq", "sr", "su", "sv", "sw", "ta", "te", "tg", "th", "tk", "tl",
    "tr", "tt", "uk", "ur", "uz", "vi", "yi", "yo", "zh", "yue",
)  # fmt: skip
#: Qwen3-ASR's languages (workers/engines/qwen3_text.py LANGUAGE_NAMES, and its aliases)
QWEN3_LANGUAGES: tuple[str, ...] = (
    "ar", "yue", "zh", "cs", "da", "nl", "en", "fil", "fi", "fr", "de", "el", "hi", "hu", "id",
    "it", "ja", "ko", "mk", "ms", "fa", "pl", "pt", "ro", "ru", "es", "sv", "th", "tr", "vi",
    "tl", "cmn", "zh-cn", "zh-tw", "pt-br",
)  # fmt: skip
#: a language value meaning "detect it" (the same as giving none)
AUTO_LANGUAGE = "auto"
_REGIONAL = re.compile(r"[a-z]{2,3}(-[a-z0-9]{2,8})+")  # BCP 47 style: en-us, zh-hant-tw
#: shortest reference clip XTTS clones from (5-30 s works best)
XTTS_MIN_REFERENCE_SECONDS = 0.5

BACKENDS: dict[str, BackendInfo] = {
    info.name: info
    for info in (
        BackendInfo("faster-whisper", "asr", translate=True, word_timestamps=True,
                    languages=WHISPER_LANGUAGES),
        BackendInfo("qwen3", "asr", languages=QWEN3_LANGUAGES),
        # VibeVoice-ASR publishes no language list ("over 50"), detects the language itself
        # and only echoes a given one: Whisper's codes stand in for "a real language"
        BackendInfo("vibevoice", "asr", speakers=True, languages=WHISPER_LANGUAGES),
        BackendInfo("parakeet", "asr", word_timestamps=True, languages=("en",)),
        BackendInfo("xtts", "tts", languages=XTTS_LANGUAGES),
    )
}

#: OpenAI's model names, mapped to the default model of the first configured backend of a kind
OPENAI_DEFAULTS: dict[str, str] = {"whisper-1": "asr", "tts-1": "tts", "tts-1-hd": "tts"}
ASR_PREFERENCE = ("faster-whisper", "parakeet", "qwen3", "vibevoice")


class UnknownBackend(LookupError):
    pass


class UnknownModel(LookupError):
    pass


def xtts_language(language: str) -> str:
    """The XTTS code for `language` ("EN" -> "en", "zh" -> "zh-cn"); ValueError if unsupported."""
    code = language.strip().lower().replace("_", "-")
    code = "zh-cn" if code in ("zh", "zh-hans") else code
    if code not in XTTS_LANGUAGES:
        raise ValueError(
            f"language {language!r} is not supported by XTTS; use one of "
            + ", ".join(XTTS_LANGUAGES)
        )
    return code


def asr_language(backend: str, language: str) -> str | None:
    """The code `backend` is given for `language` ("EN" -> "en", "en-US" -> "en"), None for
    "auto"; ValueError if the backend does not list it."""
    code = language.strip().lower().replace("_", "-")
    if code == AUTO_LANGUAGE:
        return None
    table = BACKENDS[backend].languages
    if code not in table and _REGIONAL.fullmatch(code) and code.split("-", 1)[0] in table:
        code = code.split("-", 1)[0]
    if code not in table:
        shown = language if len(language) <= 40 else language[:40] + "…"
        raise ValueError(f"language {shown!r} is not supported by {backend}; use one of "
                         + ", ".join(table))
    return code


def enabled_backends(settings: Settings) -> list[str]:
    return [name for name in BACKENDS if settings.backend_models(name)]


def backend_info(settings: Settings, backend: str) -> BackendInfo:
    if backend not in BACKENDS:
        raise UnknownBackend(f"unknown backend {backend!r}; known: {', '.join(BACKENDS)}")
    if backend not in enabled_backends(settings):
        raise UnknownBackend(f"backend {backend!r} is not enabled on this server")
    return BACKENDS[backend]


def resolve_model(settings: Settings, backend: str, model: str | None) -> str:
    """The model name a task for `backend` runs with; raises UnknownModel/UnknownBackend."""
    backend_info(settings, backend)
    models = settings.backend_models(backend)
    if not model:
        return settings.default_model(backend) or ""
    if model.startswith(f"{backend}/"):
        model = model.removeprefix(f"{backend}/")
    if model in models:
        return model
    alias = settings.aliases.get(model, "")
    if alias.startswith(f"{backend}/") and alias.split("/", 1)[1] in models:
        return alias.split("/", 1)[1]
    raise UnknownModel(
        f"unknown model {model!r} for backend {backend!r}; available: {', '.join(models)}"
    )


def resolve_public_model(settings: Settings, name: str, kind: str) -> tuple[str, str]:
    """(backend, model) for an OpenAI-style name: whisper-1, BACKEND/MODEL, an alias, or MODEL."""
    if name in settings.aliases:
        name = settings.aliases[name]
    if name in OPENAI_DEFAULTS and OPENAI_DEFAULTS[name] == kind:
        for backend in (*ASR_PREFERENCE, "xtts"):
            if BACKENDS[backend].kind == kind and backend in enabled_backends(settings):
                return backend, settings.default_model(backend) or ""
        raise UnknownModel(f"no {kind} backend is enabled for {name!r}")
    if "/" in name:
        backend, model = name.split("/", 1)
        if backend in BACKENDS and BACKENDS[backend].kind == kind:
            return backend, resolve_model(settings, backend, model)
    matches = [
        (backend, name)
        for backend in enabled_backends(settings)
        if BACKENDS[backend].kind == kind and name in settings.backend_models(backend)
    ]
    if len(matches) == 1:
        return matches[0]
    raise UnknownModel(f"unknown model {name!r}; see /v1/models for valid names")


def public_config(settings: Settings) -> dict[str, Any]:
    """The single source of truth for clients: backends, models, aliases and defaults."""
    backends = {}
    for name in enabled_backends(settings):
        backends[name] = {
            **asdict(BACKENDS[name]),
            "models": list(settings.backend_models(name)),
            "default_model": settings.default_model(name),
        }
    aliases = dict(settings.aliases)
    for public, kind in OPENAI_DEFAULTS.items():
        with contextlib.suppress(UnknownModel):
            aliases.setdefault(public, "/".join(resolve_public_model(settings, public, kind)))
    return {
        "backends": backends,
        "aliases": aliases,
        "limits": {
            "max_upload_mib": settings.max_upload_mib,
            "max_audio_seconds": settings.max_audio_seconds,
        },
        "retention_seconds": settings.retention_seconds,
        "tts": tts_config(settings),
    }


def tts_config(settings: Settings) -> dict[str, Any]:
    """What a speech client may choose (the try-it page builds its Speak form from this):
    voice names only (their targets are private paths and speaker names), and the limits."""
    return {
        "voices": list(settings.voices),
        "default_voice": next(iter(settings.voices), None),
        "max_characters": settings.tts_max_characters,
        "speed": {"min": MIN_SPEED, "max": MAX_SPEED, "default": 1.0},
        "min_reference_seconds": XTTS_MIN_REFERENCE_SECONDS,
    }
