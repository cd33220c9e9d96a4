"""Task states, engine options and results: the types document the wire format."""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any, Literal, get_args


class TaskState(StrEnum):
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({TaskState.SUCCEEDED, TaskState.FAILED, TaskState.CANCELLED})

#: a task's priority lane: interactive entries are read before batch ones (common/store/queue.py)
Lane = Literal["interactive", "batch"]
INTERACTIVE, BATCH = get_args(Lane)
LANES: tuple[str, ...] = get_args(Lane)


class ErrorCode(StrEnum):
    """Why a task FAILED; the HTTP status a synchronous caller gets for it."""

    INVALID_AUDIO = "invalid_audio"  # undecodable or expired input
    AUDIO_TOO_LONG = "audio_too_long"  # more decoded samples than max_audio_seconds
    INVALID_REQUEST = "invalid_request"  # options the engine refused (ValueError)
    # over the worker's memory cap for this file: the server is short of memory (503), not
    # the upload too large (413); a retry may land on a worker with room
    OUT_OF_MEMORY = "out_of_memory"
    MODEL_UNAVAILABLE = "model_unavailable"  # the model's breaker is open
    MODEL_LOAD_FAILED = "model_load_failed"  # its model failed to load for this task
    DELIVERY_LIMIT = "delivery_limit"  # its worker died on every delivery
    NO_WORKER = "no_worker"  # no worker took it in time, or its backend has no live worker
    DEVICE_BUSY = "device_busy"  # its load waited past device_wait_seconds for device memory
    DEADLINE_EXCEEDED = "deadline_exceeded"  # its deadline passed before a worker started it
    # its audio decoded longer than its file declared, and the rest passes its owner's quota
    QUOTA_EXCEEDED = "quota_exceeded"
    ENGINE_ERROR = "engine_error"
    CANCELLED = "cancelled"  # (a CANCELLED task, as its caller reads it: not a FAILED one)

    @property
    def http_status(self) -> int:
        return {ErrorCode.INVALID_AUDIO: 400, ErrorCode.INVALID_REQUEST: 400,
                ErrorCode.AUDIO_TOO_LONG: 413, ErrorCode.OUT_OF_MEMORY: 503,
                ErrorCode.MODEL_UNAVAILABLE: 503, ErrorCode.MODEL_LOAD_FAILED: 503,
                ErrorCode.NO_WORKER: 503, ErrorCode.DEVICE_BUSY: 503,
                ErrorCode.DEADLINE_EXCEEDED: 504, ErrorCode.QUOTA_EXCEEDED: 429,
                ErrorCode.CANCELLED: 409}.get(self, 500)


#: the labels of unknown speakers (SPEAKER_00, SPEAKER_01, …): no known speaker may be named so
AUTOMATIC_LABEL = re.compile(r"SPEAKER_\d{2,}")
#: the name a backend's diarizer is reported and breaker-guarded under, beside its models: a
#: diarizer that fails to load stops diarized tasks, never the model's plain ones
DIARIZER = "diarizer"

#: the widest beam an engine is asked for: each beam costs decoder memory and time
MAX_BEAM_SIZE = 16
#: the longest prompt an ASR task takes (Whisper reads only its last 224 tokens anyway)
MAX_PROMPT_CHARACTERS = 2000


def text_problem(value: str) -> str | None:
    """Why `value` is no usable text (a NUL, a lone surrogate); None when it is."""
    if "\x00" in value:
        return "contains a NUL character"
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate from a JSON \ud800 escape
        return "is not valid Unicode text"
    return None
ASR_TASKS = ("transcribe", "translate")


@dataclass(slots=True)
class TranscriptionOptions:
    language: str | None = None
    task: str = "transcribe"  # transcribe | translate
    word_timestamps: bool = False
    prompt: str | None = None
    beam_size: int = 5
    vad_filter: bool = False
    temperature: float = 0.0

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> TranscriptionOptions:
        """Options from a task's params, checked again here (whatever queued them):
        ValueError for a value out of range."""
        known = {k: params[k] for k in cls.__dataclass_fields__ if params.get(k) is not None}
        options = cls(**known)
        options.validate()
        return options

    def validate(self) -> None:
        if self.prompt is not None:
            if not isinstance(self.prompt, str) or (problem := text_problem(self.prompt)):
                raise ValueError(f"prompt {problem or 'must be text'}")
            if len(self.prompt) > MAX_PROMPT_CHARACTERS:
                raise ValueError(f"prompt has {len(self.prompt)} characters; the limit is "
                                 f"{MAX_PROMPT_CHARACTERS}")
        if isinstance(self.beam_size, bool) or not isinstance(self.beam_size, int) \
                or not 1 <= self.beam_size <= MAX_BEAM_SIZE:
            raise ValueError(f"beam_size must be an integer from 1 to {MAX_BEAM_SIZE}, "
                             f"not {self.beam_size!r}")
        if self.task not in ASR_TASKS:
            raise ValueError(f"task must be 'transcribe' or 'translate', not {self.task!r}")
        if not isinstance(self.temperature, int | float) or not math.isfinite(self.temperature) \
                or not 0.0 <= self.temperature <= 1.0:
            raise ValueError(f"temperature must be from 0 to 1, not {self.temperature!r}")


#: the most speakers a diarization is asked for; known speakers a request names
MAX_SPEAKERS = 32
MAX_KNOWN_SPEAKERS = 4
#: a known speaker's reference clip lasts this long (OpenAI's diarizing model takes the same)
MIN_REFERENCE_SECONDS, MAX_REFERENCE_SECONDS = 2.0, 10.0


@dataclass(slots=True)
class DiarizationOptions:
    """`diarize=true` and its options, as a task carries them (`params["diarization"]`).
    `references` are clip names: an uploaded clip in the task's input blob or, when
    `clip_paths` names it, a file under an allowed root."""

    num_speakers: int | None = None
    min_speakers: int | None = None
    max_speakers: int | None = None
    names: list[str] = field(default_factory=list)
    references: list[str] = field(default_factory=list)

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> DiarizationOptions | None:
        """None when the task does not ask for diarization; ValueError for a bad value
        (checked again here, whatever queued it)."""
        raw = params.get("diarization")
        if raw is None:
            return None
        if not isinstance(raw, dict):
            raise ValueError("diarization options must be an object")
        known = {k: raw[k] for k in cls.__dataclass_fields__ if raw.get(k) is not None}
        options = cls(**known)
        options.validate()
        return options

    def validate(self) -> None:
        for name in ("num_speakers", "min_speakers", "max_speakers"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 1 <= value <= MAX_SPEAKERS):
                raise ValueError(f"{name} must be an integer from 1 to {MAX_SPEAKERS}")
        if (self.min_speakers is not None and self.max_speakers is not None
                and self.min_speakers > self.max_speakers):
            raise ValueError("min_speakers must not exceed max_speakers")
        if len(self.names) != len(self.references):
            raise ValueError("known_speaker_names and known_speaker_references must be lists "
                             "of the same length")
        if len(self.names) > MAX_KNOWN_SPEAKERS:
            raise ValueError(f"at most {MAX_KNOWN_SPEAKERS} known speakers")

    def bounds(self) -> tuple[int, int]:
        """(fewest, most) speakers to find."""
        if self.num_speakers is not None:
            return self.num_speakers, self.num_speakers
        return self.min_speakers or 1, self.max_speakers or MAX_SPEAKERS


#: the speech rates XTTS is asked for (1 = its natural rate)
MIN_SPEED, MAX_SPEED = 0.25, 4.0


@dataclass(slots=True)
class SynthesisOptions:
    text: str
    language: str = "en"
    voice: str | None = None  # a configured voice or built-in speaker name
    speaker_wav: str | None = None  # a path (already resolved under an allowed root) or blob key
    speed: float = 1.0


@dataclass(slots=True)
class Word:
    word: str
    start: float
    end: float
    probability: float | None = None
    speaker: str | None = None  # (diarized) whose word it is


@dataclass(slots=True)
class Segment:
    id: int
    start: float
    end: float
    text: str
    speaker: str | None = None
    words: list[Word] | None = None
    # Fields the OpenAI verbose_json reference lists; engines without them leave the defaults.
    seek: int = 0
    tokens: list[int] = field(default_factory=list)
    temperature: float = 0.0
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0


@dataclass(slots=True)
class Transcription:
    text: str
    language: str | None
    duration: float
    segments: list[Segment]

    #: (diarized) label -> {"seconds": speaking time, "segments": how many segments}
    speakers: dict[str, dict[str, float | int]] | None = None

    def to_result(self, backend: str, model: str, with_words: bool) -> dict[str, Any]:
        """The ASR `result` object of the status reply (SPEC §3)."""
        segments = []
        for segment in self.segments:
            item = asdict(segment)
            if not with_words:
                item.pop("words")
            elif item["words"] is None:
                item["words"] = []
            elif segment.speaker is None:  # a word's speaker only where there are speakers
                for word in item["words"]:
                    word.pop("speaker")
            segments.append(item)
        extra = {} if self.speakers is None else {"speakers": self.speakers}
        return {
            "text": self.text,
            "language": self.language,
            "duration": round(self.duration, 3),
            "segments": segments,
            "usage": {"audio_seconds": round(self.duration, 3)},
            "backend": backend,
            "model": model,
            **extra,
        }


@dataclass(slots=True)
class Synthesis:
    audio: Any  # 1-D float32 numpy array
    sample_rate: int
    characters: int = 0  # of the text, this piece speaks (what it is charged for)

    @property
    def duration(self) -> float:
        return len(self.audio) / self.sample_rate


@dataclass(frozen=True, slots=True)
class SpeechChunk:
    """One spoken piece (a sentence) of a TTS task, as stored while the task runs and sent
    to a streaming client."""

    index: int  # from 0, in the text's order
    pcm: bytes  # 16-bit little-endian mono samples
    sample_rate: int
    characters: int = 0  # of the text, it speaks
