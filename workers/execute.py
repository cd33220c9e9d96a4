"""One engine call for one task: decode the input, run the engine, shape the result."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.audio import decode_audio, encode_wav
from common.schemas import Segment, SynthesisOptions, TranscriptionOptions
from workers.engines.base import Engine, SpeechEngine, TranscriptionEngine


@dataclass(slots=True)
class Outcome:
    result: dict[str, Any]
    output: bytes | None = None  # synthesized audio (WAV), stored as the task's output blob


def run_engine(
    engine: Engine,
    handle: Any,
    *,
    backend: str,
    model: str,
    params: dict[str, Any],
    source: bytes | Path | None,
    on_segment: Callable[[Segment], None],
) -> Outcome:
    if isinstance(engine, SpeechEngine):
        return _synthesize(engine, handle, backend, model, params, source)
    assert isinstance(engine, TranscriptionEngine)
    if source is None:
        raise ValueError("no input audio")
    options = TranscriptionOptions.from_params(params)
    audio = decode_audio(source, engine.sample_rate)
    transcription = engine.transcribe(handle, audio, options, on_segment)
    del audio
    return Outcome(transcription.to_result(backend, model, options.word_timestamps))


def _synthesize(engine: SpeechEngine, handle: Any, backend: str, model: str,
                params: dict[str, Any], reference_source: bytes | Path | None) -> Outcome:
    options = SynthesisOptions(**{k: v for k, v in params.items()
                                  if k in SynthesisOptions.__dataclass_fields__})
    reference = (decode_audio(reference_source, engine.sample_rate)
                 if reference_source is not None else None)
    synthesis = engine.synthesize(handle, options, reference)
    seconds = round(synthesis.duration, 3)
    usage = {"characters": len(options.text), "audio_seconds": seconds}
    result = {"audio_seconds": seconds, "sample_rate": synthesis.sample_rate, "format": "wav",
              "characters": len(options.text), "usage": usage, "backend": backend,
              "model": model}
    return Outcome(result, encode_wav(synthesis.audio, synthesis.sample_rate))
