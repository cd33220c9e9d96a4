"""What an engine module implements: load, run and unload one model family.

Everything about *when* to load, unload, cap memory, retry or exit lives in the worker
(`workers.engine_host`, `workers.consumer`, `workers.runtime`); an engine only knows how to
drive its library. Its class is built with the worker's `Settings` as its first argument
(`workers.engines.create_engine`) and reads its options from them, never from the
environment. An engine may add `check_source(model: ModelRef) -> None`, a cheap look at its
layout on disk that raises before anything is allocated (see `check_source` below, which
always runs first).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from common.schemas import Segment, Synthesis, SynthesisOptions, Transcription, TranscriptionOptions


@dataclass(frozen=True, slots=True)
class ModelRef:
    """A configured model: its catalog name and where its weights are (dir, file or hub id)."""

    name: str
    source: str


#: `org/name`: what a hub id looks like (a relative path with one slash looks the same)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_CHECKPOINT_FILES = frozenset({".nemo", ".bin", ".pt", ".pth", ".ckpt", ".safetensors"})


def local_path(source: str) -> Path | None:
    """The file or directory `source` names, or None for a hub id or an engine's own name."""
    path = Path(source).expanduser()
    if source.startswith(("/", "./", "../", "~")) or source in (".", "..") or path.exists():
        return path
    if os.sep in source and not _HUB_ID.fullmatch(source):
        return path
    return None


def check_source(engine: Any, model: ModelRef) -> None:
    """Raise when `model` cannot load, from what the file system shows, allocating nothing:
    a local path that does not exist, then the engine's own `check_source`, if it has one."""
    path = local_path(model.source)
    if path is not None and not path.exists():
        kind = "file" if path.suffix in _CHECKPOINT_FILES else "directory"
        raise FileNotFoundError(f"model {kind} {path} does not exist")
    engine_check = getattr(engine, "check_source", None)
    if engine_check is not None:
        engine_check(model)


@runtime_checkable
class Engine(Protocol):
    #: sample rate the engine wants its input audio at (the runtime decodes to it, mono float32)
    sample_rate: int
    #: True when the engine runs on torch (the runtime then applies torch's memory cap
    #: and releases torch's cache)
    uses_torch: bool

    def cuda_available(self) -> bool: ...

    def load(self, model: ModelRef, device: str) -> Any:
        """Build the model on `device` ("cpu" or "cuda") and return a handle for the calls below."""
        ...

    def warm_up(self, handle: Any) -> None:
        """Run whatever the engine needs before its first real request (may do nothing)."""
        ...

    def unload(self, handle: Any) -> None:
        """Release engine-specific resources; the runtime drops its references and collects."""
        ...


@runtime_checkable
class TranscriptionEngine(Engine, Protocol):
    #: what its transcript puts between two segments' texts ("" where each segment's text
    #: carries its own leading space, as Whisper's does): streamed deltas add up to the text
    segment_separator: str

    def transcribe(
        self,
        handle: Any,
        audio: np.ndarray,
        options: TranscriptionOptions,
        on_segment: Callable[[Segment], None],
    ) -> Transcription:
        """Transcribe mono float32 audio at `sample_rate`; call `on_segment` as segments appear."""
        ...


@runtime_checkable
class BatchTranscriptionEngine(TranscriptionEngine, Protocol):
    """An engine that transcribes several clips in one model call (workers/batching.py
    decides when, and which tasks share one). An engine declares it only where each clip's
    result is what `transcribe` gives it alone (greedy decoding)."""

    def batch_key(self, options: TranscriptionOptions) -> Hashable | None:
        """Tasks whose keys are equal may share a call; None: this task runs alone."""
        ...

    def transcribe_batch(
        self,
        handle: Any,
        audios: list[np.ndarray],
        options: list[TranscriptionOptions],
        on_segments: list[Callable[[Segment], None]],
    ) -> list[Transcription | Exception]:
        """Each clip's transcription, or the exception that clip alone failed with."""
        ...


@runtime_checkable
class AnalysisEngine(Engine, Protocol):
    def analyze(self, handle: Any, clips: dict[str, np.ndarray],
                params: dict[str, Any]) -> dict[str, Any]:
        """Analyse the task's clips (by the names the backend's row declares, mono float32 at
        `sample_rate`; an optional clip only when given) with its declared params (checked,
        defaults filled in); return its result, a JSON-serialisable dict."""
        ...


@runtime_checkable
class SpeechEngine(Engine, Protocol):
    def speak(self, handle: Any, options: SynthesisOptions, reference: np.ndarray | None,
              start: int = 0) -> Iterator[Synthesis]:
        """Speak `options.text` piece by piece (sentences), yielding each as it is done, from
        the `start`-th piece on (a resumed task has the first ones); the pieces must be a
        pure function of the options. `reference` is the voice clip at `sample_rate`, if
        given."""
        ...
