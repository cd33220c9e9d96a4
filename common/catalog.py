"""Backends, their capabilities, models and public names: what `/api/config` serves.

The gateway never imports an engine (engines live in other environments); what it must
know about a backend to validate a request is its row of the table (common/backends.py),
combined here with the settings (which models are configured).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

from common.backends import BACKENDS, KINDS, XTTS_MIN_REFERENCE_SECONDS, Backend, Kind
from common.languages import QWEN3_LANGUAGES, WHISPER_LANGUAGES, XTTS_LANGUAGES
from common.schemas import DIARIZER, MAX_SPEED, MIN_SPEED
from common.settings import Settings

__all__ = ["BACKENDS", "KINDS", "QWEN3_LANGUAGES", "WHISPER_LANGUAGES", "XTTS_LANGUAGES",
           "XTTS_MIN_REFERENCE_SECONDS", "Backend", "Kind"]


#: a language value meaning "detect it" (the same as giving none)
AUTO_LANGUAGE = "auto"
_REGIONAL = re.compile(r"[a-z]{2,3}(-[a-z0-9]{2,8})+")  # BCP 47 style: en-us, zh-hant-tw

#: OpenAI's model names, mapped to the default model of the first enabled backend of a kind
OPENAI_DEFAULTS: dict[str, str] = {
    public: kind.name for kind in KINDS.values() for public in kind.openai_names
}


class UnknownBackend(LookupError):
    pass


class UnknownModel(LookupError):
    pass


def speech_language(backend: str, language: str) -> str:
    """The code the TTS `backend` is given for `language` ("EN" -> "en", for XTTS "zh" ->
    "zh-cn"); ValueError if unsupported."""
    row = BACKENDS[backend]
    code = language.strip().lower().replace("_", "-")
    code = dict(row.language_aliases).get(code, code)
    if code not in row.languages:
        raise ValueError(
            f"language {language!r} is not supported by {row.display_name}; use one of "
            + ", ".join(row.languages)
        )
    return code


def xtts_language(language: str) -> str:
    """The XTTS code for `language` ("EN" -> "en", "zh" -> "zh-cn"); ValueError if unsupported.
    (The XTTS engine module's own rule; the gateway asks `speech_language` of any backend.)"""
    return speech_language("xtts", language)


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
        raise ValueError(f"language {_shown(language)!r} is not supported by {backend}; use one of "
                         + ", ".join(table))
    return code


def model_language_problem(settings: Settings, backend: str, model: str,
                           language: str | None) -> str | None:
    """Why `model` cannot take `language` (a backend code, as `asr_language` gives; None:
    detect): Whisper's English-only checkpoints (tiny.en … medium.en, by their name or their
    source's; the bundled one is tiny.en) take English only, which their worker would
    otherwise find out only once the task runs. None when it can."""
    if language in (None, "en") or backend != "faster-whisper":
        return None
    source = settings.backend_models(backend).get(model, "")
    if not (model.endswith(".en") or source == "bundled"
            or source.rstrip("/").endswith(".en")):
        return None
    return (f"{model} is an English-only model: language {language!r} is not supported "
            "(send 'en', leave the language out, or choose a multilingual model)")


def enabled_backends(settings: Settings) -> list[str]:
    return [name for name in BACKENDS if settings.backend_models(name)]


def guarded(settings: Settings, backend: str) -> dict[str, str]:
    """What has a breaker on `backend` (name -> configured source): each model, and the
    diarizer where the backend's tasks are diarized by ours (its own speakers need none)."""
    found = dict(settings.backend_models(backend))
    row = BACKENDS.get(backend)
    if row is not None and row.diarization and not row.speakers:
        found[DIARIZER] = settings.diarization_model
    return found


def backend_info(settings: Settings, backend: str) -> Backend:
    if backend not in BACKENDS:
        raise UnknownBackend(f"unknown backend {_shown(backend)!r}; known: {', '.join(BACKENDS)}")
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
    # an alias (/api/config lists them, built-in ones too) where it names this backend
    alias = settings.aliases.get(model) or (
        aliases(settings).get(model, "") if model in OPENAI_DEFAULTS else "")
    if alias.startswith(f"{backend}/") and alias.split("/", 1)[1] in models:
        return alias.split("/", 1)[1]
    raise UnknownModel(
        f"unknown model {_shown(model)!r} for backend {backend!r}; available: {', '.join(models)}"
    )


def resolve_public_model(settings: Settings, name: str, kind: str) -> tuple[str, str]:
    """(backend, model) for an OpenAI-style name: whisper-1, BACKEND/MODEL, an alias, or MODEL."""
    if name in settings.aliases:
        name = settings.aliases[name]
    if name in OPENAI_DEFAULTS and OPENAI_DEFAULTS[name] == kind:
        for backend in enabled_backends(settings):  # in table order
            if BACKENDS[backend].kind == kind:
                return backend, settings.default_model(backend) or ""
        raise UnknownModel(f"no {kind} backend is enabled for {_shown(name)!r}")
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
    raise UnknownModel(f"unknown model {_shown(name)!r}")  # callers say where the list is


def _shown(value: str) -> str:
    """A client's value as an error message quotes it: never more than 40 characters."""
    return value if len(value) <= 40 else value[:40] + "…"


def aliases(settings: Settings) -> dict[str, str]:
    """Every public model name -> "backend/model": the configured aliases, then the built-in
    OpenAI names (whisper-1, tts-1 …) where an enabled backend serves their kind."""
    found = dict(settings.aliases)
    for public, kind in OPENAI_DEFAULTS.items():
        with contextlib.suppress(UnknownModel):
            found.setdefault(public, "/".join(resolve_public_model(settings, public, kind)))
    return found


def public_config(settings: Settings) -> dict[str, Any]:
    """The single source of truth for clients: backends, models, aliases and defaults."""
    backends = {}
    for name in enabled_backends(settings):
        backends[name] = {
            **BACKENDS[name].public(),
            "models": list(settings.backend_models(name)),
            "default_model": settings.default_model(name),
        }
    return {
        "backends": backends,
        "aliases": aliases(settings),
        "limits": {
            "max_upload_mib": settings.max_upload_mib,
            "max_audio_seconds": settings.max_audio_seconds,
        },
        "retention_seconds": settings.retention_seconds,
        "tts": tts_config(settings),
        #: what a consent recording must say, per language (POST /v1/audio/voice_consents)
        "consent_phrases": dict(settings.consent_phrases),
    }


def tts_config(settings: Settings) -> dict[str, Any]:
    """What a speech client may choose (the try-it page builds its Speak form from this):
    voice names only (their targets are private paths and speaker names), and the limits."""
    return {
        "voices": list(settings.voices),
        "default_voice": next(iter(settings.voices), None),
        "max_characters": settings.tts_max_characters,
        "speed": {"min": MIN_SPEED, "max": MAX_SPEED, "default": 1.0},
        "min_reference_seconds": _first_of_kind(settings, "tts").min_reference_seconds,
    }


def kind_of(backend: str) -> Kind | None:
    """The kind of a backend of the table; None for a name it does not hold."""
    row = BACKENDS.get(backend)
    return KINDS[row.kind] if row is not None else None


def _first_of_kind(settings: Settings, kind: str) -> Backend:
    """The kind's first enabled backend, else its first row (what a client sees first)."""
    rows = [row for row in BACKENDS.values() if row.kind == kind]
    enabled = set(enabled_backends(settings))
    return next((row for row in rows if row.name in enabled), rows[0])
