"""The OpenAI Realtime transcription protocol's events and session config, as the `openai`
SDK's `types/realtime` define them: server events are built here, client events read here,
and every refusal is a `ProtocolError`, sent back as an `error` event."""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass, field, replace
from typing import Any

from common import g711
from gateway.realtime.vad import VadConfig

#: the client events a transcription session answers
CLIENT_EVENTS = ("session.update", "input_audio_buffer.append", "input_audio_buffer.commit",
                 "input_audio_buffer.clear")
#: input sample rates taken for `audio/pcm` (`audio.input.format.rate`); OpenAI's is 24000
SAMPLE_RATES = (24000, 16000)
PCM = "audio/pcm"
#: the input formats: 16-bit PCM, and G.711 μ-law / A-law (8 kHz, one byte a sample)
FORMATS = (PCM, *g711.TABLES)
#: `audio.input.transcription.delay` (GA): the beam size each asks of the backend (None: its
#: default); more beams read more accurately and take longer
DELAYS: dict[str, int | None] = {"minimal": 1, "low": 2, "medium": None, "high": 8,
                                 "xhigh": 10}
#: GA session fields taken and not honoured (docs/api.md): `include`'s one value,
#: `noise_reduction.type` and `semantic_vad`'s `eagerness`
INCLUDABLE = ("item.input_audio_transcription.logprobs",)
NOISE_REDUCTIONS = ("near_field", "far_field")
EAGERNESS = ("low", "medium", "high", "auto")
MAX_KEYWORDS = 100
MAX_KEYWORD_CHARACTERS = 100
#: candidate languages: a handful of tags (the longest BCP 47 tags run ~35 characters)
MAX_LANGUAGES = 20
MAX_LANGUAGE_CHARACTERS = 35
MAX_EVENT_ID = 128
#: the fields each object of a session.update may hold (GA's, our extensions, and `id` /
#: `object` / `expires_at`, so that a session object echoed back from session.created or a
#: client secret's reply applies); any other
#: is refused as OpenAI's GA server refuses it (`unknown_parameter`), which is how a
#: beta-shaped update (`input_audio_format`, `input_audio_transcription`) is told apart from
#: one that applies: it is never half-applied
SESSION_FIELDS = ("type", "audio", "include", "id", "object", "expires_at")
AUDIO_FIELDS = ("input",)
INPUT_FIELDS = ("format", "noise_reduction", "transcription", "turn_detection")
FORMAT_FIELDS = ("type", "rate")
NOISE_REDUCTION_FIELDS = ("type", "strength")
TRANSCRIPTION_FIELDS = ("model", "language", "prompt", "languages", "keywords", "delay",
                        "previous_turns_prompt")
VAD_FIELDS = {"server_vad": ("type", "threshold", "prefix_padding_ms", "silence_duration_ms",
                             "create_response", "interrupt_response", "idle_timeout_ms"),
              "semantic_vad": ("type", "eagerness", "create_response", "interrupt_response")}
MAX_MS = 10_000  # the longest prefix padding or silence a server VAD config may ask for
#: room in a client message for what is not audio: the event's JSON, an event_id, a
#: session.update's prompt (2,000 characters, ≤ 12 bytes each as JSON escapes)
EVENT_OVERHEAD_BYTES = 64 * 1024


class ProtocolError(Exception):
    """A client event refused: sent as an `error` event, and the session goes on."""

    def __init__(self, code: str, message: str, param: str | None = None,
                 event_id: str | None = None, type: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.code, self.message, self.param = code, message, param
        self.event_id, self.type = event_id, type


def max_message_bytes(buffer_seconds: float) -> int:
    """The largest client message a session can use (uvicorn's `ws_max_size`): an append of
    the whole input buffer at the highest input rate, base64, plus the event around it.
    Anything larger could only be refused once read, so the server refuses it unread (close
    1009) rather than hold it: the default 16 MiB per message, in every session at once."""
    pcm = int(buffer_seconds * max(SAMPLE_RATES)) * 2
    return (pcm + 2) // 3 * 4 + EVENT_OVERHEAD_BYTES


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_urlsafe(15)}"


def server_event(type: str, **fields: Any) -> dict[str, Any]:
    return {"type": type, "event_id": new_id("event"), **fields}


def error_event(error: ProtocolError) -> dict[str, Any]:
    return server_event("error", error={"type": error.type, "code": error.code,
                                        "message": error.message, "param": error.param,
                                        "event_id": error.event_id})


@dataclass(frozen=True, slots=True)
class ClientEvent:
    type: str
    event_id: str | None
    body: dict[str, Any]


LONE_SURROGATE = "the JSON holds a lone surrogate escape (\\ud800-\\udfff): not Unicode text"


def holds_lone_surrogate(raw: str | bytes | bytearray, body: Any) -> bool:
    """Whether parsed JSON holds a lone surrogate (from a \\ud800 escape): no text to pass
    on, since a reply or a task would fail to encode it. Only JSON with a \\u escape can, so
    an audio append's body is not walked."""
    if ("\\u" if isinstance(raw, str) else b"\\u") not in raw:
        return False
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def read_event(text: str) -> ClientEvent:
    """One client message as an event of a type this session answers; ProtocolError if not."""
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError("invalid_json", f"the event is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise ProtocolError("invalid_json", "an event must be a JSON object")
    if holds_lone_surrogate(text, body):
        raise ProtocolError("invalid_json", LONE_SURROGATE)
    event_id = body.get("event_id")
    if event_id is not None and (not isinstance(event_id, str) or len(event_id) > MAX_EVENT_ID):
        raise ProtocolError("invalid_value", f"event_id must be a string of at most "
                                             f"{MAX_EVENT_ID} characters", "event_id")
    kind = body.get("type")
    if not isinstance(kind, str) or not kind:
        raise ProtocolError("missing_required_parameter", "the event has no 'type'", "type",
                            event_id)
    if kind not in CLIENT_EVENTS:
        raise ProtocolError("invalid_value", f"unknown or unsupported event type "
                                             f"{kind[:80]!r}: a transcription session takes "
                                             f"{', '.join(CLIENT_EVENTS)}", "type", event_id)
    return ClientEvent(kind, event_id, body)


# --- the session's configuration ---------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class Transcription:
    model: str = "whisper-1"
    language: str | None = None
    prompt: str = ""
    #: GA fields: candidate languages (the first the backend takes wins), words to expect
    #: (they join the prompt), and how long to wait for accuracy (DELAYS)
    languages: tuple[str, ...] = ()
    keywords: tuple[str, ...] = ()
    delay: str | None = None
    #: our extension: earlier turns' text goes into the next turn's prompt (None: the
    #: setting SPEECH_REALTIME_PREVIOUS_TURNS_PROMPT decides)
    previous_turns_prompt: bool | None = None

    def public(self) -> dict[str, Any]:
        return {"model": self.model, "language": self.language, "prompt": self.prompt,
                "languages": list(self.languages) or None,
                "keywords": list(self.keywords) or None, "delay": self.delay,
                "previous_turns_prompt": self.previous_turns_prompt}


@dataclass(frozen=True, slots=True)
class SessionConfig:
    rate: int = 24000
    encoding: str = PCM
    transcription: Transcription | None = field(default_factory=Transcription)
    turn_detection: VadConfig | None = field(default_factory=VadConfig)

    @property
    def bytes_per_sample(self) -> int:
        return 2 if self.encoding == PCM else 1

    def format(self) -> dict[str, Any]:
        return {"type": PCM, "rate": self.rate} if self.encoding == PCM else {
            "type": self.encoding}

    def public(self, session_id: str) -> dict[str, Any]:
        """The session object of session.created / session.updated."""
        vad = self.turn_detection
        t = self.transcription
        return {
            "type": "transcription", "id": session_id, "object": "realtime.transcription_session",
            "audio": {"input": {
                "format": self.format(),
                "transcription": None if t is None else t.public(),
                "noise_reduction": None,
                "turn_detection": None if vad is None else {
                    "type": "server_vad", "threshold": vad.threshold,
                    "prefix_padding_ms": vad.prefix_padding_ms,
                    "silence_duration_ms": vad.silence_duration_ms},
            }},
            "include": [],
        }


def updated(config: SessionConfig, session: Any, event_id: str | None) -> SessionConfig:
    """`config` with a session.update's `session` applied: only the fields present change
    (null turns a field off). ProtocolError naming the field if a value is unusable."""
    def fail(code: str, message: str, param: str) -> ProtocolError:
        return ProtocolError(code, message, param, event_id)

    def section(parent: dict[str, Any], name: str, path: str) -> dict[str, Any]:
        value = parent.get(name)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise fail("invalid_type", f"{path} must be an object", path)
        return value

    if not isinstance(session, dict):
        raise fail("missing_required_parameter" if session is None else "invalid_type",
                   "session.update needs a 'session' object", "session")
    _known(session, SESSION_FIELDS, "session", fail)
    if session.get("type", "transcription") != "transcription":
        raise fail("invalid_value", "this endpoint serves transcription sessions only: "
                                    "session.type must be 'transcription'", "session.type")
    _include(session.get("include"), fail)
    audio = section(session, "audio", "session.audio")
    _known(audio, AUDIO_FIELDS, "session.audio", fail)
    source = section(audio, "input", "session.audio.input")
    path = "session.audio.input"
    _known(source, INPUT_FIELDS, path, fail)
    _noise_reduction(source.get("noise_reduction"), fail, f"{path}.noise_reduction")
    if "format" in source:
        encoding, rate = _format(section(source, "format", f"{path}.format"), fail)
        config = replace(config, encoding=encoding, rate=rate)
    if "transcription" in source:
        given = _object_or_null(source, "transcription", path, fail)
        config = replace(config, transcription=None if given is None else _transcription(
            config.transcription or Transcription(), given, fail))
    if "turn_detection" in source:
        given = _object_or_null(source, "turn_detection", path, fail)
        config = replace(config, turn_detection=None if given is None else _vad(
            config.turn_detection or VadConfig(), given, fail))
    return config


def _known(given: dict[str, Any], fields: tuple[str, ...], path: str, fail: Any) -> None:
    for name in given:
        if name not in fields:
            param = f"{path}.{str(name)[:60]}"
            raise fail("unknown_parameter", f"Unknown parameter: '{param}'.", param)


def _include(value: Any, fail: Any) -> None:
    """`include`: the one GA value is taken and not honoured (no backend gives per-token
    logprobs; the transcription events simply have none), so session.updated shows []."""
    if value is None:
        return
    if not isinstance(value, list) or any(item not in INCLUDABLE for item in value):
        raise fail("invalid_value", f"include may hold {', '.join(INCLUDABLE)}",
                   "session.include")


def _noise_reduction(value: Any, fail: Any, path: str) -> None:
    """`noise_reduction`: null, or {type: near_field | far_field, strength}: taken and not
    applied (the audio reaches the VAD and the model as sent), so session.updated shows null."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise fail("invalid_type", f"{path} must be an object or null", path)
    _known(value, NOISE_REDUCTION_FIELDS, path, fail)
    if value.get("type") is not None and value["type"] not in NOISE_REDUCTIONS:
        raise fail("invalid_value", f"noise_reduction.type must be one of "
                                    f"{', '.join(NOISE_REDUCTIONS)}", f"{path}.type")
    if value.get("strength") is not None and not _number(value["strength"]):
        raise fail("invalid_value", "noise_reduction.strength must be a number",
                   f"{path}.strength")


def _object_or_null(source: dict[str, Any], name: str, path: str,
                    fail: Any) -> dict[str, Any] | None:
    given = source[name]
    if given is not None and not isinstance(given, dict):
        raise fail("invalid_type", f"{path}.{name} must be an object or null", f"{path}.{name}")
    return given


def _format(given: dict[str, Any], fail: Any) -> tuple[str, int]:
    path = "session.audio.input.format"
    _known(given, FORMAT_FIELDS, path, fail)
    kind = given.get("type", PCM)
    if kind not in FORMATS:
        raise fail("invalid_value", f"unsupported audio format {str(kind)[:40]!r}: send "
                                    "'audio/pcm' (16-bit little-endian mono), 'audio/pcmu' or "
                                    "'audio/pcma' (G.711, 8 kHz)", f"{path}.type")
    if kind != PCM:
        if given.get("rate", g711.RATE) != g711.RATE:
            raise fail("invalid_value", f"{kind} is 8000 Hz", f"{path}.rate")
        return kind, g711.RATE
    rate = given.get("rate", 24000)
    if rate not in SAMPLE_RATES or isinstance(rate, bool):
        raise fail("invalid_value", f"unsupported sample rate {str(rate)[:20]}: audio/pcm is "
                                    "taken at 24000 or 16000 Hz", f"{path}.rate")
    return PCM, int(rate)


def _transcription(current: Transcription, given: dict[str, Any], fail: Any) -> Transcription:
    path = "session.audio.input.transcription"
    _known(given, TRANSCRIPTION_FIELDS, path, fail)
    result = current
    for name in ("model", "language", "prompt"):
        if name not in given:
            continue
        value = given[name]
        if value is not None and not isinstance(value, str):
            raise fail("invalid_type", f"{path}.{name} must be a string", f"{path}.{name}")
        if name == "model":
            result = replace(result, model=value or "whisper-1")
        elif name == "language":
            result = replace(result, language=value or None)
        else:
            result = replace(result, prompt=value or "")
    if "languages" in given:
        result = replace(result, languages=_strings(
            given["languages"], f"{path}.languages", fail, MAX_LANGUAGES,
            MAX_LANGUAGE_CHARACTERS))
    if "keywords" in given:
        result = replace(result, keywords=_strings(given["keywords"], f"{path}.keywords", fail))
    if "delay" in given:
        delay = given["delay"]
        if delay is not None and (not isinstance(delay, str) or delay not in DELAYS):
            raise fail("invalid_value", f"delay must be one of {', '.join(DELAYS)} (or null)",
                       f"{path}.delay")
        result = replace(result, delay=delay)
    if "previous_turns_prompt" in given:
        value = given["previous_turns_prompt"]
        if value is not None and not isinstance(value, bool):
            raise fail("invalid_type", "previous_turns_prompt must be true, false or null",
                       f"{path}.previous_turns_prompt")
        result = replace(result, previous_turns_prompt=value)
    return result


def _strings(value: Any, path: str, fail: Any, most: int = MAX_KEYWORDS,
             characters: int = MAX_KEYWORD_CHARACTERS) -> tuple[str, ...]:
    if value is None:
        return ()
    if (not isinstance(value, list) or len(value) > most
            or not all(isinstance(item, str) and 0 < len(item) <= characters
                       for item in value)):
        raise fail("invalid_value", f"{path.rsplit('.', 1)[-1]} must be a list of at most "
                                    f"{most} non-empty strings of at most {characters} "
                                    "characters", path)
    return tuple(value)


def _vad(current: VadConfig, given: dict[str, Any], fail: Any) -> VadConfig:
    """Server VAD's settings; `semantic_vad` (no model judges turns here) runs server VAD
    as it is set, its `eagerness` checked and not used."""
    path = "session.audio.input.turn_detection"
    kind = given.get("type", "server_vad")
    if not isinstance(kind, str) or kind not in VAD_FIELDS:
        raise fail("invalid_value", "turn_detection.type must be 'server_vad' or "
                                    "'semantic_vad' (served by server VAD), or send null for "
                                    "manual commits", f"{path}.type")
    _known(given, VAD_FIELDS[kind], path, fail)
    for name in ("create_response", "interrupt_response"):
        if given.get(name) is not None and not isinstance(given[name], bool):
            raise fail("invalid_type", f"{name} must be true or false", f"{path}.{name}")
    if (value := given.get("idle_timeout_ms")) is not None and (
            not _number(value) or value != int(value) or value < 0):
        raise fail("invalid_value", "idle_timeout_ms must be a whole number of milliseconds "
                                    "or null", f"{path}.idle_timeout_ms")
    if kind == "semantic_vad":
        if given.get("eagerness") is not None and given["eagerness"] not in EAGERNESS:
            raise fail("invalid_value", f"eagerness must be one of {', '.join(EAGERNESS)}",
                       f"{path}.eagerness")
        return current
    result = current
    if (value := given.get("threshold")) is not None:
        if not _number(value) or not 0.0 <= value <= 1.0:
            raise fail("invalid_value", "threshold must be a number between 0 and 1",
                       f"{path}.threshold")
        result = replace(result, threshold=float(value))
    for name in ("prefix_padding_ms", "silence_duration_ms"):
        if (value := given.get(name)) is not None:
            if not _number(value) or value != int(value) or not 0 <= value <= MAX_MS:
                raise fail("invalid_value", f"{name} must be an integer from 0 to {MAX_MS}",
                           f"{path}.{name}")
            result = replace(result, **{name: int(value)})
    return result


def _number(value: Any) -> bool:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int past a float's range: no setting's value
        return False
