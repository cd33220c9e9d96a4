"""The backend table: one row per engine, and every other place reads it.

A row says what the gateway must know to check a request before queueing it (kind,
capabilities, languages), where a worker finds its engine class and interpreter (engine,
env), how supervisord runs it (prefix, enabled and the program defaults), how often Sage
polls it, and what the tests run it on (fixture). From it come common.catalog's BACKENDS
(what `/api/config` serves), workers.engines.ENGINE_CLASSES, the worker programs of
deploy/supervisord.conf, the worker lines of deploy/defaults.env and
deploy/sage/llm_api_map.csv (written by scripts/gen_deploy.py; a test checks the committed
files match), scripts/make_tiny_models.py's recipes and the tests' backend matrices.

Row order matters once: the first enabled backend of a kind answers that kind's OpenAI
names (`whisper-1`, `tts-1`).

Standard library only: the gateway, every worker environment and the deploy scripts import it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.languages import QWEN3_LANGUAGES, WHISPER_LANGUAGES, XTTS_LANGUAGES


@dataclass(frozen=True, slots=True)
class Kind:
    """What backends of one kind share: how a task's input is read, where a worker takes a
    direct call, which Sage templates render it."""

    name: str
    #: the worker's direct endpoint (workers/http.py), used by the smoke test
    worker_path: str
    #: deploy/sage/ templates
    sage_request: str
    sage_response: str
    #: OpenAI model names meaning "the default model of this kind's first enabled backend"
    openai_names: tuple[str, ...] = ()
    #: a finished task's output is audio, served at its `output_url`
    audio_output: bool = False
    #: its requests name a language, so each of its backends lists the languages it takes
    languages: bool = True
    #: what its tasks are metered (and quotas counted) in: "audio_seconds" (the input's
    #: probed duration) or "characters" (of the text)
    usage_unit: str = "audio_seconds"


KINDS: dict[str, Kind] = {
    kind.name: kind
    for kind in (
        Kind("asr", "/transcribe", "asr_submit_request.json.j2", "asr_status_response.json.j2",
             # every transcription model the openai SDK names (its AudioModel and realtime
             # AudioTranscription literals): a client's default must not refuse its session
             openai_names=("whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe",
                           "gpt-4o-mini-transcribe-2025-12-15", "gpt-4o-transcribe-diarize",
                           "gpt-transcribe", "gpt-live-transcribe", "gpt-realtime-whisper")),
        Kind("tts", "/synthesize", "tts_submit_request.json.j2", "tts_status_response.json.j2",
             openai_names=("tts-1", "tts-1-hd", "gpt-4o-mini-tts",
                           "gpt-4o-mini-tts-2025-12-15"), audio_output=True,
             usage_unit="characters"),
        # audio in, a JSON result out; the row declares its clips and params, so the gateway,
        # the worker's direct endpoint, Sage and the smoke test need nothing of their own
        Kind("analysis", "/analyze", "analysis_submit_request.json.j2",
             "analysis_status_response.json.j2", languages=False),
    )
}


@dataclass(frozen=True, slots=True)
class Clip:
    """An audio input of an `analysis` backend. The first is the task's main clip, named
    `file` and given like an ASR input (a `file` upload, `audio_path`, `audio_url`); any other
    is an upload under its name, or a path under an allowed root given as its value."""

    name: str
    required: bool = True
    doc: str = ""

    def public(self) -> dict[str, object]:
        return {"name": self.name, "required": self.required, "doc": self.doc}


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
PARAM_TYPES = ("number", "integer", "boolean")


@dataclass(frozen=True, slots=True)
class Param:
    """An option of an `analysis` backend: the gateway checks it before queueing (a 400 naming
    it), the worker again before its engine sees it."""

    name: str
    type: str = "number"  # one of PARAM_TYPES
    default: float | int | bool | None = None
    #: the range of a number or integer (None: unbounded)
    low: float | None = None
    high: float | None = None
    doc: str = ""

    def value(self, raw: object) -> float | int | bool | None:
        """`default` when `raw` is absent, else `parse(raw)`."""
        return self.default if raw is None or raw == "" else self.parse(raw)

    def parse(self, raw: object) -> float | int | bool:
        """The value a request's text or a task's JSON gives; ValueError naming the param."""
        if self.type == "boolean":
            text = str(raw).strip().lower() if not isinstance(raw, bool) else str(raw).lower()
            if text in _TRUE or text in _FALSE:
                return text in _TRUE
            raise ValueError(f"{self.name} must be true or false")
        try:
            number = math.nan if isinstance(raw, bool) else float(raw)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            number = math.nan
        low = -math.inf if self.low is None else self.low
        high = math.inf if self.high is None else self.high
        integral = self.type != "integer" or number.is_integer()
        if not (math.isfinite(number) and low <= number <= high and integral):  # refuses nan
            what = "an integer" if self.type == "integer" else "a number"
            bounds = (f" from {self.low:g} to {self.high:g}"
                      if self.low is not None and self.high is not None else "")
            raise ValueError(f"{self.name} must be {what}{bounds}")
        return int(number) if self.type == "integer" else number

    def public(self) -> dict[str, object]:
        return {"name": self.name, "type": self.type, "default": self.default,
                "min": self.low, "max": self.high, "doc": self.doc}


@dataclass(frozen=True, slots=True)
class Fixture:
    """The model the tests (and a CPU demo) run a backend on: a fixed `source` ("bundled":
    weights a package ships), or a tiny checkpoint that scripts/make_tiny_models.py builds
    with scripts/tiny_models/`builder` in the backend's environment."""

    model: str = "tiny"  # the model name tests give it in SPEECH_MODELS
    source: str = ""
    builder: str = ""
    #: the builder's arguments; one naming a file of the repository is written relative to it
    args: tuple[str, ...] = ()
    #: other files of scripts/tiny_models/ the builder imports (a change rebuilds)
    helpers: tuple[str, ...] = ()
    #: the file in the built directory that SPEECH_MODELS names ("" = the directory)
    entry: str = ""
    #: words the fixture's transcript of tests/audio/jfk.flac contains ("" = nothing sensible)
    transcript: str = ""


@dataclass(frozen=True, slots=True)
class Backend:
    name: str
    kind: str  # a key of KINDS
    #: the engine class, "module:Class", imported only by the worker that runs it
    engine: str
    #: its environment: deploy/envs/ENV.txt, installed as .venvs/ENV by scripts/install.sh
    env: str
    #: its supervisord program's variables: PREFIX_ENABLED, _REPLICAS, _DEVICE, _MEMORY_CAP_MIB,
    #: _IDLE_UNLOAD_SECONDS (deploy/defaults.env)
    prefix: str
    fixture: Fixture
    #: its worker starts by default (PREFIX_ENABLED)
    enabled: bool = False
    #: Sage's query_period for it, in seconds (llm_api_map.csv)
    sage_poll_seconds: int = 2
    # --- capabilities: the gateway refuses what a backend cannot do before queueing ---
    translate: bool = False
    word_timestamps: bool = False
    #: the engine names its own speakers (diarize=true keeps them, as SPEAKER_00 …)
    speakers: bool = False
    #: diarize=true works: the worker's diarizer (workers/diarize.py, needs its packages in the
    #: row's environment), or the engine's own speakers
    diarization: bool = False
    #: the language codes it accepts
    languages: tuple[str, ...] = ()
    #: other spellings of a language -> its code ("zh" -> "zh-cn")
    language_aliases: tuple[tuple[str, str], ...] = ()
    #: the name its messages give it ("" = `name`)
    label: str = ""
    #: (tts) the shortest voice reference clip it clones from, in seconds
    min_reference_seconds: float = 0.0
    #: (analysis) its audio inputs, the first the main clip `file`
    inputs: tuple[Clip, ...] = ()
    #: (analysis) its options, with their defaults
    params: tuple[Param, ...] = ()
    # --- program defaults (deploy/defaults.env) ---
    replicas: int = 1
    device: str = "auto"
    memory_cap_mib: int = 0
    idle_unload_seconds: int = 120

    def public(self) -> dict[str, object]:
        """What `/api/config` shows of it: its capabilities, none of its deployment."""
        public: dict[str, object] = {
            "name": self.name, "kind": self.kind, "translate": self.translate,
            "word_timestamps": self.word_timestamps, "speakers": self.speakers,
            "diarization": self.diarization, "languages": list(self.languages)}
        if self.inputs or self.params:  # what a client sends an analysis backend
            public["inputs"] = [clip.public() for clip in self.inputs]
            public["params"] = [param.public() for param in self.params]
        return public

    @property
    def display_name(self) -> str:
        return self.label or self.name


#: shortest reference clip XTTS clones from (5-30 s works best)
XTTS_MIN_REFERENCE_SECONDS = 0.5
_JFK = "tests/audio/jfk.flac"
_JFK_WORDS = "ask not what your country"

BACKENDS: dict[str, Backend] = {
    row.name: row
    for row in (
        Backend("faster-whisper", "asr", "workers.engines.faster_whisper:FasterWhisperEngine",
                env="core", prefix="FW", enabled=True,
                fixture=Fixture(model="tiny.en", source="bundled"),
                translate=True, word_timestamps=True, diarization=True,
                languages=WHISPER_LANGUAGES),
        Backend("parakeet", "asr", "workers.engines.parakeet:ParakeetEngine",
                env="nemo", prefix="PARAKEET", sage_poll_seconds=1,
                fixture=Fixture(builder="parakeet.py", entry="parakeet-tiny.nemo"),
                word_timestamps=True, diarization=True, languages=("en",)),
        Backend("qwen3", "asr", "workers.engines.qwen3:Qwen3Engine",
                env="hf", prefix="QWEN3",
                fixture=Fixture(builder="qwen3.py", args=("--teach", _JFK),
                                helpers=("hf_tiny.py",), transcript=_JFK_WORDS),
                diarization=True, languages=QWEN3_LANGUAGES),
        # VibeVoice-ASR publishes no language list ("over 50"), detects the language itself
        # and only echoes a given one: Whisper's codes stand in for "a real language"
        Backend("vibevoice", "asr", "workers.engines.vibevoice:VibeVoiceEngine",
                env="hf", prefix="VIBEVOICE", sage_poll_seconds=5,
                fixture=Fixture(builder="vibevoice.py", args=("--teach", _JFK),
                                helpers=("hf_tiny.py",), transcript=_JFK_WORDS),
                speakers=True, diarization=True, languages=WHISPER_LANGUAGES),
        Backend("xtts", "tts", "workers.engines.xtts:XttsEngine",
                env="xtts", prefix="XTTS", fixture=Fixture(builder="xtts.py"),
                languages=XTTS_LANGUAGES, label="XTTS",
                language_aliases=(("zh", "zh-cn"), ("zh-hans", "zh-cn")),
                min_reference_seconds=XTTS_MIN_REFERENCE_SECONDS),
        # Resemblyzer's speaker encoder, shipped inside its package: the fixture is the real model
        Backend("voiceprint", "analysis", "workers.engines.voiceprint:VoiceprintEngine",
                env="voiceprint", prefix="VOICEPRINT", sage_poll_seconds=1,
                fixture=Fixture(model="resemblyzer", source="bundled"),
                inputs=(Clip("file", doc="the clip whose speaker embedding is returned"),
                        Clip("reference", required=False,
                             doc="a second clip: adds score (cosine similarity) and same_speaker")),
                params=(Param("threshold", default=0.8, low=0.0, high=1.0,
                              doc="the score from which the two clips count as one speaker"),)),
    )
}


#: request names an analysis backend's clips and params may not take: the submit's own, and
#: the task option that carries clip paths to the worker
RESERVED_NAMES = frozenset({"backend", "model", "audio_path", "audio_file", "audio_url",
                            "idempotency_key", "task_id", "taskid", "clip_paths"})


def check_row(row: Backend) -> None:
    """ValueError naming what is wrong with a row (run on the whole table at import)."""
    where = f"backend {row.name!r}"
    if row.kind not in KINDS:
        raise ValueError(f"{where}: unknown kind {row.kind!r}")
    if ":" not in row.engine:
        raise ValueError(f"{where}: engine must be 'module:Class'")
    if not row.prefix.isidentifier() or not row.prefix.isupper():
        raise ValueError(f"{where}: prefix {row.prefix!r} is no VARIABLE name")
    if bool(row.fixture.source) == bool(row.fixture.builder):
        raise ValueError(f"{where}: its fixture needs a source or a builder")
    if KINDS[row.kind].languages and not row.languages:
        raise ValueError(f"{where}: a {row.kind} backend lists the languages it takes")
    if (row.kind == "analysis") != bool(row.inputs):
        raise ValueError(f"{where}: an analysis backend, and only one, declares its inputs")
    if row.inputs and (row.inputs[0].name != "file" or not row.inputs[0].required):
        raise ValueError(f"{where}: its first input is the required main clip 'file'")
    names = [item.name for item in (*row.inputs[1:], *row.params)]
    if len(set(names)) != len(names) or RESERVED_NAMES & {"file", *names}:
        raise ValueError(f"{where}: input and param names must be distinct and not reserved")
    for param in row.params:
        if param.type not in PARAM_TYPES:
            raise ValueError(f"{where}: param {param.name!r} has an unknown type")
        if param.default is not None:
            param.parse(param.default)  # a default out of its own range is a typo


def check_table(rows: dict[str, Backend]) -> None:
    """A row with a typo fails every process at import, not one request at a time."""
    prefixes = [row.prefix for row in rows.values()]
    if len(set(prefixes)) != len(prefixes):
        raise ValueError(f"two backends share a supervisord prefix: {prefixes}")
    for row in rows.values():
        check_row(row)


check_table(BACKENDS)


#: what every worker process runs with, however it is deployed (supervisord, Kubernetes, the
#: tests' harness): two malloc arenas, so an idle unload gives back what per-thread arenas
#: would keep (idle RSS 159 -> 138 MiB, no slowdown). OpenMP's wait policy is the worker's
#: own choice (SPEECH_OMP_WAIT_POLICY, workers/openmp.py), made before its engine loads.
WORKER_PROCESS_ENV: dict[str, str] = {"MALLOC_ARENA_MAX": "2"}
