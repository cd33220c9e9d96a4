"""What an engine module implements: load, run and unload one model family.

Everything about *when* to load, unload, cap memory, retry or exit lives in
`workers.runtime`; an engine only knows how to drive its library.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import numpy as np

from common.schemas import Segment, Synthesis, SynthesisOptions, Transcription, TranscriptionOptions


@dataclass(frozen=True, slots=True)
class ModelRef:
    """A configured model: its catalog name and where its weights are (dir, file or hub id)."""

    name: str
    source: str


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
class SpeechEngine(Engine, Protocol):
    def synthesize(
        self, handle: Any, options: SynthesisOptions, reference: np.ndarray | None
    ) -> Synthesis:
        """Speak `options.text`; `reference` is the voice clip at `sample_rate`, if given."""
        ...
