"""Every setting of gateway and workers, in one class. Environment prefix: `SPEECH_`.

Each worker process reads the same class; per-worker values (backend, port, memory
cap, idle unload …) come from that process's environment (see deploy/supervisord.conf).
The docs/configuration.md's settings table documents each field.
"""

from __future__ import annotations

import hashlib
import math
import os
import socket
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from common.api_keys import ApiKey
from common.backends import BACKENDS
from common.webhook_keys import check_webhook_secrets, webhook_key
from common.words import normalise

__all__ = ["ApiKey", "Settings", "get_settings", "webhook_key"]

MULTIPART_OVERHEAD_BYTES = 64 * 1024

DEFAULT_MODELS: dict[str, dict[str, str]] = {
    "faster-whisper": {"tiny.en": "bundled"},
}

#: how the placeholders of the shipped Secret (deploy/k8s/base/secrets.yaml) begin: a secret
#: that still does is refused at start
PLACEHOLDER_SECRET = "replace-me"
#: the shortest SPEECH_WORKER_SECRET / SPEECH_URL_SECRET taken
MIN_SECRET_CHARACTERS = 16
#: the default consent phrases (OpenAI asks for a fixed sentence per language, too)
CONSENT_PHRASES: dict[str, str] = {
    "en": "I consent to my voice being recorded and used to create a synthetic voice.",
    "de": "Ich bin damit einverstanden, dass meine Stimme aufgenommen und für eine "
          "synthetische Stimme verwendet wird.",
    "fr": "J'accepte que ma voix soit enregistrée et utilisée pour créer une voix "
          "synthétique.",
    "es": "Doy mi consentimiento para que mi voz sea grabada y utilizada para crear una voz "
          "sintética.",
}

#: the fewest words a consent phrase may have (SPEECH_CONSENT_PHRASES)
MIN_CONSENT_WORDS = 5
#: speech's characters per second, what a TTS backend's work (characters) counts as in
#: `queued_seconds_per_key`
CHARACTERS_PER_SECOND = 15.0

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
    "marin": "speaker:Tammie Ema",
    "cedar": "speaker:Baldur Sanjin",
}
VOICE_KINDS = ("speaker", "file")
class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SPEECH_", extra="ignore")

    # --- shared ---
    redis_url: str = "redis://127.0.0.1:6379/0"
    #: Redis Sentinel: "host:port" of each sentinel; set, the primary is the one they name
    #: `redis_sentinel_master` and `redis_url` is not used (docs/configuration.md)
    redis_sentinels: list[str] = Field(default_factory=list)
    redis_sentinel_master: str = "speech"
    redis_password: str = ""  # Redis's own (AUTH); with a URL it may also be in the URL
    redis_sentinel_password: str = ""  # the sentinels' (their `requirepass`)
    #: replicas that must hold a submit and a terminal write before either counts as done
    #: (WAIT); None: 1 with sentinels, 0 (no wait) without
    redis_wait_replicas: int | None = Field(default=None, ge=0)
    redis_wait_timeout_ms: int = Field(default=500, ge=1)
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
    #: the request bodies one gateway process holds at once, together: past it a further
    #: upload is a 503 `overloaded` with Retry-After (a request alone always passes). Its
    #: uploads are held whole, two or three times over while parsed: size the process's
    #: memory limit to about three times this. 0 = no bound
    upload_budget_mib: float = Field(default=512.0, ge=0)
    #: hosts `audio_url` may be fetched from ("*" = any); empty = audio_url is refused
    audio_url_hosts: list[str] = Field(default_factory=list)
    max_audio_seconds: float = 4 * 3600.0
    public_url: str = ""
    #: public voice name -> "speaker:<XTTS built-in speaker>" or "file:<reference clip under
    #: an allowed root>"; the first one is the default voice
    voices: dict[str, str] = Field(default_factory=lambda: dict(DEFAULT_VOICES))
    tts_max_characters: int = 4096  # OpenAI's own limit on `input`
    #: the most speech one TTS task may make: a task whose next sentence would take it past
    #: this fails there (`audio_too_long`; a stream keeps the charge of the sentences it
    #: heard), so a slow `speed` and long spelled-out numbers cannot put a gigabyte of one
    #: task's audio in Redis
    tts_max_output_seconds: float = Field(default=1800.0, gt=0)
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
    #: client takes none of its data for this long is dropped, freeing its waiter and session;
    #: any reply's write that waits this long on a full connection its client took none of
    #: meanwhile aborts the connection
    send_timeout_seconds: float = Field(default=30.0, gt=0)
    #: each client connection's kernel send buffer (SO_SNDBUF), 0: the kernel's autotuning
    #: (up to net.ipv4.tcp_wmem's maximum, 4 MB by default): what a client that stops
    #: reading holds of this host's memory before the send timeout starts counting
    send_buffer_bytes: int = Field(default=0, ge=0)
    #: a streamed reply sends something at least this often while its task waits or between
    #: its pieces (an SSE comment; a WebSocket ping on live sessions), so that no proxy's idle
    #: timeout (nginx: 60 s) cuts it
    stream_keepalive_seconds: float = Field(default=15.0, gt=0, le=300)
    #: a whole request body must arrive within this
    body_deadline_seconds: float = Field(default=900.0, gt=0)
    #: a RUNNING task's Sage status poll sooner than this after its last reply waits out the
    #: rest, or until the task's state changes (common/store/running_polls.py); 0: never
    poll_pace_seconds: float = Field(default=0.05, ge=0, le=0.5)

    # --- worker ---
    backend: str = "faster-whisper"
    worker_host: str = "127.0.0.1"
    worker_port: int = 0
    #: stable consumer name; defaults to host + supervisord process slot
    consumer: str = ""
    device: str = "auto"  # auto | cpu | cuda
    #: the card this worker uses on a host with several: set as its CUDA_VISIBLE_DEVICES (an
    #: index or a GPU UUID) before anything touches CUDA; "" = what the environment sets
    gpu: str = ""
    compute_type: str = "auto"  # faster-whisper: auto -> float16 on cuda, int8 on cpu
    cpu_threads: int = 0
    #: OpenMP's wait policy for the engine's threads (workers/openmp.py): auto = the library's
    #: own (spin a while, then sleep) where `host_workers` is 1, PASSIVE elsewhere; an
    #: OMP_WAIT_POLICY already in the environment stands under auto
    omp_wait_policy: Literal["auto", "passive", "library"] = "auto"
    #: how many worker processes share this host (scripts/run_stack.sh counts its own); 0 =
    #: unknown, as in a Kubernetes pod
    host_workers: int = Field(default=0, ge=0)
    idle_unload_seconds: float = 120.0  # 0 = unload after every task, -1 = never
    #: after an idle unload, a worker whose RSS is still above this many times its fresh
    #: RSS re-execs itself (same pid, a fresh interpreter: what the imports, the allocator's
    #: arenas and a CUDA context kept goes back); 0 = never (workers/runtime.py)
    reexec_rss_ratio: float = Field(default=1.15, ge=0)
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

    # --- cross-request batching (workers/batching.py; engines with a batch call) ---
    #: most tasks one engine call takes together (1 = off)
    batch_max_size: int = Field(default=8, ge=1)
    #: once a burst is seen, a batch waits up to this long after its first task arrived
    #: for more (a lone task never waits); 0 = off
    batch_window_ms: float = Field(default=50.0, ge=0)
    #: MiB each further clip of a batch needs (a batch is split to fit the memory cap and
    #: the device reservation); 0 = learned from measured batch peaks
    batch_item_mib: float = Field(default=0.0, ge=0)

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
    #: how a worker leaves a model load that failed half-way: "exit" (supervisord starts a
    #: new process at once) or "reexec" (a fresh image in the same process, as the idle
    #: re-exec: where every exit is a container restart with a growing back-off, as in
    #: Kubernetes, the worker's other models would wait out that back-off)
    load_failure: Literal["exit", "reexec"] = "exit"
    #: the longest one engine call may run (its load not counted): past it its tasks FAIL
    #: and the worker restarts (a call stuck in a driver never returns, and its worker would
    #: look alive holding them RUNNING); 0 = 600 s plus 20 s for each second of the call's
    #: audio, -1 = no bound
    max_engine_call_seconds: float = 0.0
    #: a backend without a live worker this long has its PENDING tasks, and its RUNNING
    #: tasks whose worker is gone, FAILED (`no_worker`); 0 = never
    no_worker_seconds: float = 120.0

    # --- admission ---
    #: a batch task not yet handed to a worker this long is taken before new interactive
    #: work (batch is never starved); 0 = interactive always first
    batch_promotion_seconds: float = Field(default=60.0, ge=0)
    #: … but only once a worker has taken this many interactive entries since its last batch
    #: one: an aged backlog gets one entry in (this + 1), never all of it first
    batch_promotion_every: int = Field(default=4, ge=1)
    #: tasks one API key may have queued or running at once (0 = no limit); per key:
    #: `max_in_flight` in its entry
    max_in_flight_per_key: int = Field(default=64, ge=0)
    #: entries one API key may have waiting (not yet read by a worker) in one lane of one
    #: backend; its further tasks wait in a line of their own and enter the lane one by one
    #: as its entries there are read, so other keys' work is queued behind at most this many
    #: of its own (0 = no limit; keys off: not applied, one caller has no one to be fair to)
    queued_per_key: int = Field(default=8, ge=0)
    #: … and at most this much of its work (audio-seconds; a TTS backend's characters at 15
    #: a second): eight four-hour files are not "eight entries" to the key whose two-second
    #: clip waits behind them (one task alone always enters, whatever its size; 0 = no limit)
    queued_seconds_per_key: float = Field(default=900.0, ge=0)
    #: tasks one API key may submit in a minute (from its first; keys off: not applied): a
    #: loop of submits cancelled at once is refunded, and each leaves a record for the
    #: retention. Past it a 429 with the minute's end in Retry-After. 0 = no limit
    submits_per_minute_per_key: int = Field(default=600, ge=0)
    #: the input (uploads, reference clips) one API key's unfinished tasks may hold at once,
    #: in Redis or SPEECH_BLOB_DIR: past it its next upload is a 429 (a task alone always
    #: passes; keys off: not counted). 0 = no bound
    queued_input_mib_per_key: float = Field(default=512.0, ge=0)
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
    #: one key may hold at most this share of a process's sessions, of its waiting calls
    #: (`max_waiting_requests`), of its upload budget (`upload_budget_mib`) and of a
    #: backend's queued tasks (`max_queued_tasks`, counted with its lane share; keys on)
    realtime_key_share: float = Field(default=0.5, gt=0, le=1)
    #: one key's live sessions in every gateway process together (0: its share of one
    #: process's, `realtime_key_share` x `realtime_max_sessions`)
    realtime_sessions_per_key: int = Field(default=0, ge=0)
    #: audio faster than this x real time (after one buffer's burst) ends the session
    realtime_max_speed: float = Field(default=2.0, gt=0)
    #: earlier turns' text goes into the next turn's prompt (a session's
    #: `transcription.previous_turns_prompt` overrides); a turn waits this long at most for
    #: the one before it to finish
    realtime_previous_turns_prompt: bool = True
    realtime_previous_turn_wait_seconds: float = Field(default=10.0, ge=0)
    #: POST /v1/realtime/client_secrets: a minted key's lifetime unless asked (10 s to 2 h)
    client_secret_seconds: int = Field(default=600, ge=10, le=7200)
    #: … and how many one API key may have alive at once (keys on; each is a record kept
    #: until it expires): past it a mint is a 429. 0 = no bound
    client_secrets_per_key: int = Field(default=100, ge=0)

    # --- custom voices (/v1/audio/voice_consents, /v1/audio/voices) ---
    #: language -> the sentence a consent recording must say (its base language is tried
    #: too: "en-US" -> "en")
    consent_phrases: dict[str, str] = Field(default_factory=lambda: dict(CONSENT_PHRASES))
    #: the most word error a consent recording's transcript may have against its phrase
    consent_max_wer: float = Field(default=0.25, ge=0, le=1)
    #: the voiceprint score (cosine) from which a sample is the consenting speaker:
    #: docs/voices.md has the measurements behind the default
    voice_match_threshold: float = Field(default=0.75, ge=-1, le=1)
    #: … and every 3 s part of the sample's voice must score at least this against it (a
    #: sample mostly of another voice can score high as a whole): docs/voices.md
    voice_match_part_threshold: float = Field(default=0.70, ge=-1, le=1)
    max_voices_per_key: int = Field(default=20, ge=0)
    #: consents one key may hold (each keeps its recording until withdrawn)
    max_consents_per_key: int = Field(default=20, ge=0)
    #: every cloned voice needs a consent: a client's own reference clip (`speaker_wav`, an
    #: upload or a path) is refused, leaving the configured voices and consented custom ones
    require_voice_consent: bool = False
    #: the voiceprint backend's model that checks a sample against its consent
    voice_match_model: str = "resemblyzer"

    # --- webhooks (`callback_url`, gateway/policy/webhooks.py and gateway/jobs/deliverer.py) ---
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
    #: deliveries one gateway process sends at once (each on its own: none waits for another)
    webhook_concurrency: int = Field(default=64, ge=1)
    #: one key's deliveries on the way at once, in every gateway process together (its other
    #: due ones wait their turn)
    webhook_concurrency_per_key: int = Field(default=4, ge=1)
    #: redeliver calls one key may make per minute (0 = no limit); past it a 429
    webhook_redeliveries_per_minute: int = Field(default=30, ge=0)

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
    #: a recorded peak (per model and class: plain or diarized) is measured again after this
    #: long (0 = kept); one past the whole budget after one lease
    device_peak_max_age_seconds: float = Field(default=3600.0, ge=0)

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

    @field_validator("blob_dir", mode="before")
    @classmethod
    def _read_blob_dir(cls, value: Any) -> Any:
        # an empty SPEECH_BLOB_DIR (a template's blank) means none, not the working directory
        return None if isinstance(value, str) and not value.strip() else value

    @field_validator("url_secret", "worker_secret")
    @classmethod
    def _check_secret(cls, value: str) -> str:
        # the shipped manifests' placeholder (deploy/k8s/base/secrets.yaml) is public: with it
        # anyone could call the workers' endpoints or sign audio URLs
        if value.startswith(PLACEHOLDER_SECRET):
            raise ValueError("is the shipped placeholder: set a random secret of your own "
                             "(openssl rand -hex 32)")
        if value and len(value) < MIN_SECRET_CHARACTERS:  # "x" is guessed in one request
            raise ValueError(f"has {len(value)} characters; a secret needs at least "
                             f"{MIN_SECRET_CHARACTERS} (openssl rand -hex 32)")
        return value

    @field_validator("redis_sentinels")
    @classmethod
    def _check_sentinels(cls, entries: list[str]) -> list[str]:
        for entry in entries:
            host, _, port = entry.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"sentinel {entry!r}: expected host:port")
        return entries

    @property
    def wait_replicas(self) -> int:
        """Replicas a submit and a terminal write wait for (see `redis_wait_replicas`)."""
        if self.redis_wait_replicas is not None:
            return self.redis_wait_replicas
        return 1 if self.redis_sentinels else 0

    @field_validator("voices")
    @classmethod
    def _check_voices(cls, voices: dict[str, str]) -> dict[str, str]:
        for name, target in voices.items():
            kind, _, value = target.partition(":")
            if kind not in VOICE_KINDS or not value.strip():
                raise ValueError(f"voice {name!r}: {target!r} must be 'speaker:NAME' or "
                                 "'file:PATH'")
        return {name.strip().lower(): target for name, target in voices.items()}

    @field_validator("consent_phrases")
    @classmethod
    def _check_consent_phrases(cls, phrases: dict[str, str]) -> dict[str, str]:
        for tag, phrase in phrases.items():  # a phrase of no words: any silence would say it
            if len(normalise(phrase)) < MIN_CONSENT_WORDS:
                raise ValueError(f"consent phrase {tag!r}: {phrase!r} has fewer than "
                                 f"{MIN_CONSENT_WORDS} words")
        return phrases

    @model_validator(mode="after")
    def _check_roots_apart_from_blobs(self) -> Settings:
        # a path submit under the blob directory would read other keys' inputs, outputs and
        # custom voices' clips (stored there under guessable names)
        if self.blob_dir is not None:
            blobs = self.blob_dir.resolve()
            for root in self.allowed_roots:
                resolved = root.resolve()
                if blobs.is_relative_to(resolved) or resolved.is_relative_to(blobs):
                    raise ValueError(f"allowed root {str(root)!r} overlaps the blob directory "
                                     f"{str(self.blob_dir)!r}: a path submit could read "
                                     "other keys' audio; keep them apart")
        return self

    @field_validator("webhook_secrets")
    @classmethod
    def _check_webhook_secrets(cls, secrets: dict[str, str]) -> dict[str, str]:
        return check_webhook_secrets(secrets)

    def webhook_secrets_of(self, owner: str) -> dict[str, str]:
        """What the webhooks of `owner`'s tasks are signed with: its key's own secrets if it
        has any, else `webhook_secrets`."""
        key = self.api_key(owner)
        return key.webhook_secrets if key is not None and key.webhook_secrets else \
            self.webhook_secrets

    def voice(self, name: str | None) -> tuple[str, str]:
        """("speaker", built-in name) or ("file", clip path) of a configured voice (the first
        configured one when `name` is empty); KeyError if there is no such voice."""
        key = name.strip().lower() if name else next(iter(self.voices), "")
        kind, _, target = self.voices[key].partition(":")
        return kind, target.strip()

    @property
    def max_upload_bytes(self) -> int:
        """The largest file a request may carry (an upload, a fetched `audio_url`, a clip)."""
        return int(self.max_upload_mib * 1024 * 1024)

    @property
    def max_body_bytes(self) -> int:
        """The largest request body: the largest file plus multipart fields and boundaries."""
        return self.max_upload_bytes + MULTIPART_OVERHEAD_BYTES

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

    def in_flight_limit(self, owner: str) -> int | None:
        """The most tasks `owner` may have queued or running (0: no limit; None: keys are
        off, nothing is counted)."""
        key = self.api_key(owner)
        if key is None:
            return None
        return self.max_in_flight_per_key if key.max_in_flight is None else key.max_in_flight

    def lane_share(self, owner: str) -> int:
        """The most entries `owner` may have waiting in one lane (0: no limit, as with keys
        off: one caller has no one to be fair to)."""
        key = self.api_key(owner)
        if key is None:
            return 0
        return self.queued_per_key if key.max_queued is None else key.max_queued

    def lane_share_work(self, owner: str, unit: str) -> float:
        """The most work (in `unit`) of `owner`'s entries waiting in one lane (0: no limit;
        keys off: none, as `lane_share`)."""
        if self.api_key(owner) is None:
            return 0.0
        per_second = CHARACTERS_PER_SECOND if unit == "characters" else 1.0
        return self.queued_seconds_per_key * per_second

    def submit_rate(self, owner: str) -> int:
        """The most tasks `owner` may submit a minute (0: no limit; keys off: none)."""
        return self.submits_per_minute_per_key if self.api_key(owner) is not None else 0

    def input_bytes_limit(self, owner: str) -> int:
        """The most input bytes `owner`'s unfinished tasks may hold (0: not counted)."""
        if self.api_key(owner) is None:
            return 0
        return int(self.queued_input_mib_per_key * 1024 * 1024)

    def queued_share(self, owner: str, backend: str) -> int:
        """The most of `backend`'s queued tasks (`max_queued_tasks`) `owner` may hold: its
        `realtime_key_share`, at least one (0: no limit; keys off, no limit set, or a key
        without a lane share, whose queued tasks are not counted apart: docs/fairness.md)."""
        most = self.max_queued_tasks.get(backend, 0)
        if most <= 0 or self.api_key(owner) is None or self.lane_share(owner) <= 0:
            return 0
        return max(1, math.floor(most * self.realtime_key_share))

    def lane_for(self, owner: str, lane: str) -> str:
        """`lane`, unless it is interactive and `owner`'s key may not use it (then batch);
        with keys off every caller may."""
        key = self.api_key(owner)
        if lane == "interactive" and key is not None and not key.may_use_interactive:
            return "batch"
        return lane

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


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()
