"""Backends, their capabilities, models and public names: what `/api/config` serves.

The gateway never imports an engine (engines live in other environments); what it
must know about a backend to validate a request is written here once.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from typing import Any

from common.settings import Settings


@dataclass(frozen=True, slots=True)
class BackendInfo:
    name: str
    kind: str  # "asr" | "tts"
    translate: bool = False
    word_timestamps: bool = False
    speakers: bool = False
    #: "many", one code, or the exact codes a backend accepts (the gateway checks those)
    languages: str | tuple[str, ...] = "many"


#: languages XTTS v2 speaks, as its config names them. Kept here, not in the engine module,
#: so the gateway can refuse a language before queueing without importing an engine.
XTTS_LANGUAGES: tuple[str, ...] = (
    "en", "es", "fr", "de", "it", "pt", "pl", "tr", "ru", "nl", "cs", "ar", "zh-cn", "hu",
    "ko", "ja", "hi",
)  # fmt: skip
#: shortest reference clip XTTS clones from (5-30 s works best)
XTTS_MIN_REFERENCE_SECONDS = 0.5

BACKENDS: dict[str, BackendInfo] = {
    info.name: info
    for info in (
        BackendInfo("faster-whisper", "asr", translate=True, word_timestamps=True),
        BackendInfo("qwen3", "asr"),
        BackendInfo("vibevoice", "asr", speakers=True),
        BackendInfo("parakeet", "asr", word_timestamps=True, languages="en"),
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
    }
