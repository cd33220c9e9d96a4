"""The OpenAI-style API's request and response bodies, as pydantic models, so `/docs` and
`/openapi.json` show them (errors: `gateway.errors.ErrorResponse`).

The request models document; they do not parse. Every submit route reads its parameters
through `gateway.inputs.read_params` (query, form or JSON alike), whose hostile-input rules
FastAPI's parsing would change: a list or a repeated field where one value belongs is a
400 naming the parameter, a NUL or invalid Unicode too, a malformed body a 400 (see
tests/test_hostile_input.py). A route declares its body with `form_body` / `json_body`
(`openapi_extra`), and `gateway.routes.docs` adds the models to the schema's components.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from common.audio import OUTPUT_FORMATS
from common.schemas import (
    MAX_BEAM_SIZE,
    MAX_KNOWN_SPEAKERS,
    MAX_PROMPT_CHARACTERS,
    MAX_SPEAKERS,
    MAX_SPEED,
    MIN_SPEED,
)

TRANSCRIPTION_FORMATS = ("json", "text", "srt", "vtt", "verbose_json", "diarized_json")
SPEECH_FORMATS = tuple(OUTPUT_FORMATS)

Upload = Annotated[bytes, WithJsonSchema({"type": "string", "format": "binary",
                                          "contentMediaType": "application/octet-stream"})]

# --- requests -----------------------------------------------------------------------------


class VoiceId(BaseModel):
    id: str = Field(description="A custom voice of this key (`voice_…`)")


class VoiceConsentRequest(BaseModel):
    """`POST /v1/audio/voice_consents` (multipart form)."""

    recording: Upload = Field(description="The speaker reading the consent phrase of "
                                          "`language` (`/api/config` consent_phrases); 10 MiB "
                                          "at most")
    name: str = Field(max_length=256, description="A label for the consent")
    language: str = Field(description="A BCP 47 tag, e.g. `en-US`")


class VoiceConsentUpdate(BaseModel):
    """`POST /v1/audio/voice_consents/{consent_id}` (JSON)."""

    name: str = Field(max_length=256)


class VoiceRequest(BaseModel):
    """`POST /v1/audio/voices` (multipart form)."""

    audio_sample: Upload = Field(description="The consenting speaker, at most 30 s and 10 MiB")
    consent: str = Field(description="The consent's id (`cons_…`)")
    name: str = Field(max_length=256)
    type: Literal["audio_sample"] = "audio_sample"


class ClientSecretRequest(BaseModel):
    """`POST /v1/realtime/client_secrets` (JSON)."""

    expires_after: dict[str, Any] | None = Field(
        None, description="`{\"anchor\": \"created_at\", \"seconds\": 10…7200}` "
                          "(default SPEECH_CLIENT_SECRET_SECONDS)")
    session: dict[str, Any] | None = Field(
        None, description="A transcription session (as `session.update` takes it) that the "
                          "key's sessions start with")



class _AudioRequest(BaseModel):
    model_config = ConfigDict(populate_by_name=True)

    file: Upload = Field(description="The audio (any format FFmpeg decodes)")
    model: str = Field("whisper-1", description="`whisper-1` (the default ASR model), "
                       "`BACKEND/MODEL`, an alias, or a model name unique to one backend "
                       "(`GET /v1/models`)")
    prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARACTERS,
                               description="Text to condition the decoder on")
    response_format: Literal[TRANSCRIPTION_FORMATS] = Field(  # type: ignore[valid-type]
        "json", description="`diarized_json` needs a backend that identifies speakers")
    temperature: float = Field(0.0, ge=0.0, le=1.0)
    timestamp_granularities: list[Literal["word", "segment"]] = Field(
        ["segment"], alias="timestamp_granularities[]",
        description="Repeated fields or one JSON list (also without `[]`); `word` needs a "
                    "backend with word timestamps (verbose_json)")
    stream: bool = Field(False, description="Server-sent events: `transcript.text.delta` per "
                                            "segment, then `transcript.text.done`")
    beam_size: int = Field(5, ge=1, le=MAX_BEAM_SIZE, description="(extension)")
    vad_filter: bool = Field(False, description="(extension) skip silence, where supported")


class TranscriptionRequest(_AudioRequest):
    """`POST /v1/audio/transcriptions` (multipart form)."""

    language: str | None = Field(None, description="A code of the backend's table "
                                 "(`/api/config`); a regional form means its language; "
                                 "`auto` or none: detect")
    diarize: bool = Field(False, description="(extension) label who spoke each segment and "
                          "word; `diarized_json` implies it")
    num_speakers: int | None = Field(None, ge=1, le=MAX_SPEAKERS,
                                     description="(extension) with diarize: how many speakers")
    min_speakers: int | None = Field(None, ge=1, le=MAX_SPEAKERS,
                                     description="(extension) with diarize: at least")
    max_speakers: int | None = Field(None, ge=1, le=MAX_SPEAKERS,
                                     description="(extension) with diarize: at most")
    known_speaker_names: list[str] = Field(
        [], alias="known_speaker_names[]", max_length=MAX_KNOWN_SPEAKERS,
        description="Names for known speakers, one per reference clip")
    known_speaker_references: list[str] = Field(
        [], alias="known_speaker_references[]", max_length=MAX_KNOWN_SPEAKERS,
        description="2-10 s clips of the known speakers: data URLs, uploads under this name, "
                    "or paths under an allowed root")


class TranslationRequest(_AudioRequest):
    """`POST /v1/audio/translations` (multipart form): into English."""


class SpeechRequest(BaseModel):
    """`POST /v1/audio/speech` (JSON)."""

    model: str = Field("tts-1", description="`tts-1`/`tts-1-hd` (the default XTTS model) or "
                                            "`xtts/MODEL`")
    input: str = Field(description="The text to speak (at most SPEECH_TTS_MAX_CHARACTERS)",
                       min_length=1)
    voice: str | VoiceId | None = Field(
        None, description="A configured voice (`/api/config`; the first one by default), or a "
                          "custom voice: `{\"id\": \"voice_…\"}` (`/v1/audio/voices`)")
    response_format: Literal[SPEECH_FORMATS] = "mp3"  # type: ignore[valid-type]
    speed: float = Field(1.0, ge=MIN_SPEED, le=MAX_SPEED)
    stream_format: Literal["audio", "sse"] | None = Field(
        None, description="Send the audio as it is spoken: `audio` (chunked bytes of "
                          "`response_format`: mp3, opus, aac, wav or pcm) or `sse` "
                          "(`speech.audio.delta` events, then `speech.audio.done`); "
                          "absent: the whole file at once")
    language: str = Field("en", description="(extension) one of XTTS's 17 languages")
    speaker_wav: str | None = Field(None, description="(extension) a reference clip under an "
                                                      "allowed root, instead of `voice`")


# --- responses ----------------------------------------------------------------------------


class Usage(BaseModel):
    type: Literal["duration"] = "duration"
    seconds: int


class Transcription(BaseModel):
    """`response_format=json`."""

    text: str
    usage: Usage


class Segment(BaseModel):
    id: int
    seek: int
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float


class Word(BaseModel):
    word: str
    start: float
    end: float


class TranscriptionVerbose(BaseModel):
    """`response_format=verbose_json`: segments and/or words, per timestamp_granularities."""

    task: Literal["transcribe", "translate"]
    language: str
    duration: float
    text: str
    usage: Usage
    segments: list[Segment] | None = None
    words: list[Word] | None = None


class DiarizedSegment(BaseModel):
    type: Literal["transcript.text.segment"] = "transcript.text.segment"
    id: str
    start: float
    end: float
    text: str
    speaker: str


class TranscriptionDiarized(BaseModel):
    """`response_format=diarized_json`."""

    task: Literal["transcribe", "translate"]
    duration: float
    text: str
    segments: list[DiarizedSegment]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = 0
    owned_by: str = "speech-gateway"
    backend: str
    kind: str = Field(description="`asr` or `tts`")
    alias_of: str | None = Field(None, description="For an alias: the `BACKEND/MODEL` it names")


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TaskView(BaseModel):
    """A task as `GET /v1/tasks/{task_id}` shows it."""

    id: str
    status: Literal["PENDING", "RUNNING", "SUCCEEDED", "FAILED", "CANCELLED"]
    backend: str
    model: str
    created_at: float
    started_at: float | None
    finished_at: float | None
    attempts: int
    deliveries: int
    worker: str
    result: dict[str, Any] | None = Field(None, description="Only when SUCCEEDED")
    error: str | None = None
    error_code: str | None = None
    queue_position: int | None = Field(None, description="PENDING: its place in its lane")
    estimated_start_seconds: float | None = Field(
        None, description="PENDING, once its backend has a measured rate")
    estimated_finish_seconds: float | None = Field(
        None, description="PENDING, once its backend has a measured rate")


class WebhookAttempt(BaseModel):
    """One POST of a task's webhook."""

    at: float = Field(description="When it started (epoch seconds)")
    duration: float = Field(description="Seconds until the answer, or the failure")
    outcome: Literal["delivered", "failed", "gave_up"]
    status: int | None = Field(None, description="The receiver's HTTP status, if it answered")
    error: str | None = Field(None, description="Why it failed")


class WebhookDeliveries(BaseModel):
    """`GET /v1/tasks/{task_id}/deliveries`: a task's webhook attempts (oldest first)."""

    task_id: str
    event_id: str | None = Field(None, description="The `webhook-id` every attempt carries "
                                                   "(once the task is terminal)")
    state: Literal["waiting", "scheduled", "delivered", "gave_up"] = Field(
        description="waiting: the task is not finished; scheduled: an attempt is due (or "
                    "being sent) at `next_attempt_at`; delivered: the last attempt got a 2xx; "
                    "gave_up: no more attempts")
    next_attempt_at: float | None
    attempts: list[WebhookAttempt]


class BreakerView(BaseModel):
    state: Literal["closed", "open", "half-open"]
    failures: int
    error: str | None
    reopens_at: float | None
    trips: int


class BreakerReset(BaseModel):
    backend: str
    model: str
    state: Literal["closed"] = "closed"
    previous: BreakerView



class UsageAmount(BaseModel):
    used: float = Field(description="Charged at submit; a failed or cancelled task's charge "
                                    "is given back")
    limit: float | None = Field(None, description="The quota; null: none")
    remaining: float | None = Field(None, description="limit - used (never below 0); null: "
                                                      "no quota")


class UnitUsage(UsageAmount):
    backends: dict[str, UsageAmount] = Field(
        default_factory=dict, description="Per backend: those used this period or with a quota")


class UsagePeriod(BaseModel):
    period: str = Field(description="The UTC day (2025-06-01) or month (2025-06)")
    resets_at: str = Field(description="When its usage resets: ISO 8601, UTC")
    audio_seconds: UnitUsage
    characters: UnitUsage


class UsageReport(BaseModel):
    """The caller's own usage and quotas: `GET /v1/usage`."""

    key: str | None = Field(description="The key's name (else its owner id); null when API "
                                        "keys are off")
    day: UsagePeriod
    month: UsagePeriod


# --- declaring them on routes --------------------------------------------------------------

#: request models referenced by a route's `openapi_extra`; docs adds them to the components
REQUEST_MODELS: dict[str, type[BaseModel]] = {}


def form_body(model: type[BaseModel]) -> dict[str, Any]:
    return _body(model, "multipart/form-data")


def json_body(model: type[BaseModel]) -> dict[str, Any]:
    return _body(model, "application/json")


def _body(model: type[BaseModel], media_type: str) -> dict[str, Any]:
    REQUEST_MODELS[model.__name__] = model
    return {"requestBody": {"required": True, "content": {media_type: {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


TRANSCRIPTION_CONTENT = {
    "text/plain": {"schema": {"type": "string"}},
    "application/x-subrip": {"schema": {"type": "string"}},
    "text/vtt": {"schema": {"type": "string"}},
    "text/event-stream": {"schema": {"type": "string"}, "description": "with `stream=true`"},
}
