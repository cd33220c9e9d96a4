"""Every setting of gateway and workers, in one class. Environment prefix: `SPEECH_`.

Each worker process reads the same class; per-worker values (backend, port, memory
cap, idle unload …) come from that process's environment (see deploy/supervisord.conf).
The README's settings table documents each field.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import socket
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.backends import BACKENDS

DEFAULT_MODELS: dict[str, dict[str, str]] = {
    "faster-whisper": {"tiny.en": "bundled"},
}

#: OpenAI's voice names -> XTTS v2 built-in speakers (the tiny test checkpoint has only
#: "Claribel Dervla" and "Ana Florence", i.e. alloy and nova)
DEFAULT_VOICES: dict[str, str] = {
    "alloy": "speaker:Claribel Dervla",
    "nova": "speaker:Ana Florence",
    "ash": "speaker:Craig Gutsy",
    "ballad": "speaker:Viktor Eka",
    "coral": "speaker:Daisy Studious",
    "echo": "speaker:Andrew Chipper",
    "fable": "speaker:Damien Black",
    "onyx": "speaker:Abrahan Mack",
    "sage": "speaker:Gracie Wise",
    "shimmer": "speaker:Sofia Hellen",
    "verse": "speaker:Dionisio Schuyler",
}
VOICE_KINDS = ("speaker", "file")
#: what usage is metered in (a backend's kind says which: common/backends.py) and the periods
#: a quota may cover (UTC days and months)
USAGE_UNITS = ("audio_seconds", "characters")
QUOTA_PERIODS = ("day", "month")
MAX_QUOTA = 1e12  # any quota, in any unit (~30,000 years of audio)
_DIGEST = re.compile(r"[0-9a-f]{64}")
_KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class Quotas(BaseModel):
    """The most usage per UTC day and month, in the units users pay for; None: no limit."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # finite and at most MAX_QUOTA: the submit script compares them as Lua numbers, which
    # read "inf" as nothing, and a huge int is no float at all (no limit: leave it out)
    audio_seconds_per_day: float | None = Field(default=None, ge=0, le=MAX_QUOTA,
                                                allow_inf_nan=False)
    audio_seconds_per_month: float | None = Field(default=None, ge=0, le=MAX_QUOTA,
                                                  allow_inf_nan=False)
    characters_per_day: int | None = Field(default=None, ge=0, le=MAX_QUOTA)
    characters_per_month: int | None = Field(default=None, ge=0, le=MAX_QUOTA)

    def limit(self, unit: str, period: str) -> float | None:
        value = getattr(self, f"{unit}_per_{period}")
        return None if value is None else float(value)


class KeyQuotas(Quotas):
    """A key's quotas over all backends, and per backend (both apply)."""

    backends: dict[str, Quotas] = Field(default_factory=dict)


class ApiKey(BaseModel):
    """One `SPEECH_API_KEYS` entry: a plain "sha256:<hex>" string, or this object."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: the key's SHA-256 digest, "sha256:<64 hex>" (`python -m gateway.auth KEY` prints it)
    key: str
    #: its label on /metrics and /v1/usage (default: its owner id, 16 hex of the digest)
    name: str = ""
    #: the lane of its submits that name no `priority`
    priority: Literal["interactive", "batch"] | None = None
    quotas: KeyQuotas = Field(default_factory=KeyQuotas)

    @field_validator("key")
    @classmethod
    def _check_key(cls, key: str) -> str:
        hex_digest = key.strip().removeprefix("sha256:").lower()
        if not _DIGEST.fullmatch(hex_digest):
            raise ValueError("an API key entry must be a SHA-256 digest, 'sha256:' and 64 hex "
                             "characters (python -m gateway.auth KEY prints it)")
        return "sha256:" + hex_digest

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if name and not _KEY_NAME.fullmatch(name):
            raise ValueError(f"key name {name!r}: 1 to 64 letters, digits, '_', '.' or '-'")
        return name

    @property
    def digest(self) -> str:
        return self.key.removeprefix("sha256:")

    @property
    def owner(self) -> str:
        """The owner id its tasks and usage are recorded under."""
        return self.digest[:16]

    @property
    def label(self) -> str:
        return self.name or self.owner
#: a webhook key id travels in a space-separated header (`webhook-key-id`)
WEBHOOK_KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
#: shortest webhook secret (decoded); Standard Webhooks asks for 24 to 64 bytes
WEBHOOK_SECRET_MIN_BYTES = 24


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPEECH_", extra="ignore")

    # --- shared ---
    redis_url: str = "redis://127.0.0.1:6379/0"
    #: backend -> {model name -> source (local directory/file, hub id, or "bundled")};
    #: the first model of a backend is its default unless `default_models` says otherwise.
    models: dict[str, dict[str, str]] = Field(default_factory=lambda: dict(DEFAULT_MODELS))
    default_models: dict[str, str] = Field(default_factory=dict)
    #: extra public names -> "backend/model" (whisper-1 and tts-1 are built in)
    aliases: dict[str, str] = Field(default_factory=dict)
    retention_seconds: int = 24 * 3600
    max_deliveries: int = 3
    #: a PENDING task no worker started within this long is FAILED (0 = wait forever)
    max_queue_seconds: float = 6 * 3600.0
    visibility_timeout_seconds: float = 60.0
    heartbeat_seconds: float = 2.0
    log_level: str = "INFO"
    #: a directory every host mounts: input/output audio at least `blob_dir_min_kib` large
    #: lives there instead of in Redis (same lifetimes); None = everything in Redis
    blob_dir: Path | None = None
    blob_dir_min_kib: float = 256.0

    # --- gateway ---
    host: str = "127.0.0.1"
    port: int = 8000
    #: accepted API keys: SHA-256 digests ("sha256:<hex>"), or objects adding a name,
    #: a default priority and quotas (`ApiKey`); empty = no keys required
    api_keys: list[ApiKey] = Field(default_factory=list)
    #: how long an OpenAI-style request waits for its task before answering 504
    request_timeout_seconds: float = 600.0
    allowed_roots: list[Path] = Field(default_factory=list)
    max_upload_mib: float = 200.0
    #: hosts `audio_url` may be fetched from ("*" = any); empty = audio_url is refused
    audio_url_hosts: list[str] = Field(default_factory=list)
    max_audio_seconds: float = 4 * 3600.0
    public_url: str = ""
    #: public voice name -> "speaker:<XTTS built-in speaker>" or "file:<reference clip under
    #: an allowed root>"; the first one is the default voice
    voices: dict[str, str] = Field(default_factory=lambda: dict(DEFAULT_VOICES))
    tts_max_characters: int = 4000
    #: HMAC key of the signed audio URLs; every gateway replica needs the same one.
    #: Empty: derived from `api_keys` (see `url_signing_key`).
    url_secret: str = ""

    # --- gateway limits (hostile input) ---
    #: Redis connections one gateway process may hold (plus one shared pub/sub connection);
    #: past it a call waits up to `redis_pool_timeout_seconds` for a free one
    redis_max_connections: int = Field(default=64, ge=2)
    redis_pool_timeout_seconds: float = Field(default=5.0, gt=0)
    #: OpenAI-style calls one gateway process keeps waiting at once; more get a 503
    max_waiting_requests: int = Field(default=500, ge=0)
    #: bearer token a Prometheus scraper sends to /metrics (plain, or "sha256:<hex>")
    metrics_token: str = ""
    #: a whole `audio_url` download must finish within this
    audio_url_timeout_seconds: float = Field(default=30.0, gt=0)
    #: a client must send its request line and headers within this
    header_timeout_seconds: float = Field(default=10.0, gt=0)
    #: the longest pause while a request body streams in
    body_timeout_seconds: float = Field(default=60.0, gt=0)
    #: a streamed reply (live transcription events, streamed speech, `stream=true`) whose
    #: client takes none of its data for this long is dropped, freeing its waiter and session
    send_timeout_seconds: float = Field(default=30.0, gt=0)
    #: a whole request body must arrive within this
    body_deadline_seconds: float = Field(default=900.0, gt=0)

    # --- worker ---
    backend: str = "faster-whisper"
    worker_host: str = "127.0.0.1"
    worker_port: int = 0
    #: stable consumer name; defaults to host + supervisord process slot
    consumer: str = ""
    device: str = "auto"  # auto | cpu | cuda
    compute_type: str = "auto"  # faster-whisper: auto -> float16 on cuda, int8 on cpu
    cpu_threads: int = 0
    idle_unload_seconds: float = 120.0  # 0 = unload after every task, -1 = never
    memory_cap_mib: int = 0  # 0 = no cap
    preload: bool = False
    stop_grace_seconds: float = 20.0
    # --- worker limits ---
    #: bearer token the worker's own HTTP server requires on /transcribe and /synthesize
    #: (and /health, off loopback); it refuses to start on a non-loopback `worker_host`
    #: without one. Its uploads obey `max_upload_mib`, its decodes `max_audio_seconds`.
    worker_secret: str = ""
    # --- engine options (read by the engine modules) ---
    parakeet_window_seconds: float = 360.0  # longer audio is decoded in windows this long
    parakeet_warmup_seconds: list[float] = Field(default_factory=lambda: [1.0, 8.0, 60.0])
    parakeet_cuda_graphs: bool = True  # NeMo's CUDA-graph greedy decoder on GPU
    parakeet_dtype: str = "auto"  # auto (bf16 on cuda, fp32 on cpu) | bfloat16 | float32
    #: speaker diarization (`diarize=true`, workers/diarize.py): `bundled` = silero-vad's
    #: speech regions + Resemblyzer's speaker encoder (weights shipped in their PyPI packages),
    #: spectrally clustered, on CPU; `pyannote:DIR` = a pyannote.audio pipeline from a local
    #: checkpoint directory, on the worker's device (needs .venvs/pyannote; docs/backends.md)
    diarization_model: str = "bundled"
    #: a diarized speaker takes a known speaker's name from this cosine similarity up
    diarization_name_threshold: float = Field(default=0.75, ge=0.0, le=1.0)

    # --- breakers and liveness ---
    #: load failures of one model within the window that open its breaker
    breaker_failures: int = 3
    breaker_window_seconds: float = 600.0
    #: an open breaker half-opens (lets one probe task load the model) after this long;
    #: each failed probe doubles the wait, up to `breaker_cooldown_max_seconds`
    breaker_cooldown_seconds: float = 60.0
    breaker_cooldown_max_seconds: float = 3600.0
    #: a worker whose model load failed exits only once it has run this long: longer than
    #: supervisord's `startsecs` (3), so the exit is a restart and never a failed start
    min_uptime_seconds: float = 5.0
    #: a backend without a live worker this long has its PENDING tasks, and its RUNNING
    #: tasks whose worker is gone, FAILED (`no_worker`); 0 = never
    no_worker_seconds: float = 120.0

    # --- admission ---
    #: a batch task not yet handed to a worker this long is taken before new interactive
    #: work (batch is never starved); 0 = interactive always first
    batch_promotion_seconds: float = Field(default=60.0, ge=0)
    #: backend -> most tasks queued (both lanes) before a submit is refused with 429
    max_queued_tasks: dict[str, int] = Field(default_factory=dict)
    #: backend -> longest predicted wait (seconds) before a submit is refused with 429
    max_queue_seconds_ahead: dict[str, float] = Field(default_factory=dict)

    # --- live transcription (/v1/realtime, gateway/realtime/) ---
    #: WebSocket sessions one gateway process serves at once; past it a session is refused
    #: (an `error` event, then close code 1013)
    realtime_max_sessions: int = Field(default=100, ge=0)
    #: a session ends after this long, counted in wall time and in audio sent (OpenAI's
    #: sessions last 60 min): an `error` event, its pending turns finish, then close 1000
    realtime_max_session_seconds: float = Field(default=3600.0, gt=0)
    #: the most uncommitted audio a session holds: past it an append is refused (manual
    #: commits), or the speech is cut into a turn there (server VAD)
    realtime_max_buffer_seconds: float = Field(default=60.0, gt=0)
    #: a session with no client event and no turn being transcribed this long is closed
    realtime_idle_timeout_seconds: float = Field(default=300.0, gt=0)
    #: turns of one session being transcribed at once; a turn committed past it fails
    #: (`too_many_pending_turns`)
    realtime_max_pending_turns: int = Field(default=8, ge=1)

    # --- webhooks (`callback_url`, gateway/webhooks.py and gateway/deliverer.py) ---
    #: hosts a `callback_url` may point at, as `audio_url_hosts`; empty = callback_url refused
    callback_url_hosts: list[str] = Field(default_factory=list)
    #: key id -> "whsec_<base64>": every delivery is signed with each (so receivers can switch
    #: secrets at their own pace); the first is the current one. Needed for `callback_url`.
    webhook_secrets: dict[str, str] = Field(default_factory=dict)
    #: one delivery attempt (connect, send, the receiver's answer) must finish within this
    webhook_timeout_seconds: float = Field(default=10.0, gt=0)
    #: the wait after the first failed attempt; each further failure multiplies it by the
    #: factor, up to the max
    webhook_retry_seconds: float = Field(default=10.0, gt=0)
    webhook_retry_factor: float = Field(default=2.0, ge=1)
    webhook_retry_max_seconds: float = Field(default=1800.0, gt=0)
    #: no new attempt starts this long after the first one (nor once the task has expired)
    webhook_give_up_seconds: float = Field(default=8 * 3600.0, gt=0)
    #: how often each gateway process looks for due deliveries
    webhook_poll_seconds: float = Field(default=1.0, gt=0)

    # --- device memory broker ---
    #: device ("cpu", "cuda:0") -> MiB the models of every worker on it may reserve together.
    #: Unset: the card's total (from the driver) on cuda, no broker on cpu.
    device_memory_mib: dict[str, int] = Field(default_factory=dict)
    #: "backend/model" -> MiB one load of it reserves; else the worker's `memory_cap_mib`
    #: (else 0); a larger measured peak (recorded in Redis) wins once known
    model_memory_mib: dict[str, int] = Field(default_factory=dict)
    #: a load waiting in line for device memory longer than this fails its task (device_busy)
    device_wait_seconds: float = Field(default=300.0, gt=0)
    #: a reservation (or a place in line) its worker stopped renewing lapses after this long
    device_lease_seconds: float = Field(default=10.0, gt=0)
    #: how often a worker renews its lease, looks for a request to yield, and (waiting) retries
    device_poll_seconds: float = Field(default=0.2, gt=0)

    @field_validator("api_keys", mode="before")
    @classmethod
    def _read_api_keys(cls, entries: Any) -> Any:
        if isinstance(entries, list):
            return [{"key": entry} if isinstance(entry, str) else entry for entry in entries]
        return entries

    @field_validator("api_keys")
    @classmethod
    def _check_api_keys(cls, entries: list[ApiKey]) -> list[ApiKey]:
        for what, values in (("owner id", [e.owner for e in entries]),
                             ("name", [e.label for e in entries])):
            if repeated := sorted({v for v in values if values.count(v) > 1}):
                raise ValueError(f"API keys repeat the {what} {repeated[0]!r}")
        for entry in entries:
            if unknown := sorted(set(entry.quotas.backends) - set(BACKENDS)):
                raise ValueError(f"key {entry.label!r}: quotas for unknown backends {unknown}; "
                                 f"known: {', '.join(BACKENDS)}")
        return entries

    @field_validator("voices")
    @classmethod
    def _check_voices(cls, voices: dict[str, str]) -> dict[str, str]:
        for name, target in voices.items():
            kind, _, value = target.partition(":")
            if kind not in VOICE_KINDS or not value.strip():
                raise ValueError(f"voice {name!r}: {target!r} must be 'speaker:NAME' or "
                                 "'file:PATH'")
        return {name.strip().lower(): target for name, target in voices.items()}

    @field_validator("webhook_secrets")
    @classmethod
    def _check_webhook_secrets(cls, secrets: dict[str, str]) -> dict[str, str]:
        for key_id, secret in secrets.items():
            if not WEBHOOK_KEY_ID.fullmatch(key_id):
                raise ValueError(f"webhook key id {key_id!r}: use 1 to 64 of A-Z a-z 0-9 . _ -")
            try:
                size = len(webhook_key(secret))
            except (ValueError, binascii.Error):
                size = 0
            if size < WEBHOOK_SECRET_MIN_BYTES:
                raise ValueError(f"webhook secret {key_id!r} must be 'whsec_' and the base64 of "
                                 f"at least {WEBHOOK_SECRET_MIN_BYTES} random bytes")
        return secrets

    def voice(self, name: str | None) -> tuple[str, str]:
        """("speaker", built-in name) or ("file", clip path) of a configured voice (the first
        configured one when `name` is empty); KeyError if there is no such voice."""
        key = name.strip().lower() if name else next(iter(self.voices), "")
        kind, _, target = self.voices[key].partition(":")
        return kind, target.strip()

    def url_signing_key(self) -> bytes:
        """`url_secret`, else a key derived from the API key digests (order-free), so
        replicas configured alike sign alike without another secret to distribute."""
        if self.url_secret:
            return self.url_secret.encode()
        digests = sorted(entry.digest for entry in self.api_keys)
        return hashlib.sha256("\n".join(["speech-gateway output urls", *digests]).encode()).digest()

    def api_key(self, owner: str) -> ApiKey | None:
        """The configured key whose tasks are recorded under `owner` (None: keys are off)."""
        return next((entry for entry in self.api_keys if entry.owner == owner), None)

    def backend_models(self, backend: str) -> dict[str, str]:
        return self.models.get(backend, {})

    def default_model(self, backend: str) -> str | None:
        if backend in self.default_models:
            return self.default_models[backend]
        return next(iter(self.backend_models(backend)), None)

    def model_memory(self, backend: str, model: str) -> int:
        """MiB one load of `model` reserves, before any measured peak."""
        return self.model_memory_mib.get(f"{backend}/{model}", self.memory_cap_mib)

    def consumer_name(self) -> str:
        if self.consumer:
            return self.consumer
        slot = os.environ.get("SUPERVISOR_PROCESS_NAME") or f"pid{os.getpid()}"
        return f"{socket.gethostname()}:{slot}"


def webhook_key(secret: str) -> bytes:
    """The HMAC key of a `whsec_<base64>` webhook secret (Standard Webhooks)."""
    if not secret.startswith("whsec_"):
        raise ValueError("not a whsec_ secret")
    return base64.b64decode(secret.removeprefix("whsec_"), validate=True)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
