"""Qwen3-ASR on transformers' built-in classes (no remote code): many languages, no timestamps."""

from __future__ import annotations

from collections.abc import Callable, Hashable

import numpy as np

from common.schemas import Segment, Transcription, TranscriptionOptions
from workers.engines import hf_common
from workers.engines.base import ModelRef
from workers.engines.qwen3_text import model_language, parse_output

# A random or looping model never stops: bound the answer by the audio's length
# (generous for speech: ~3 tokens/s in English, ~6 in Chinese).
MIN_NEW_TOKENS = 512
NEW_TOKENS_PER_SECOND = 12


class Qwen3Engine(hf_common.HfAsrEngine):
    name = "qwen3"
    sample_rate = 16000

    def load(self, model: ModelRef, device: str) -> hf_common.HfHandle:
        from transformers import Qwen3ASRForConditionalGeneration

        return hf_common.load(Qwen3ASRForConditionalGeneration, model.source, device)

    def warm_up(self, handle: hf_common.HfHandle) -> None:
        silence = np.zeros(self.sample_rate, dtype=np.float32)
        request = handle.processor.apply_transcription_request(audio=silence, language="English")
        hf_common.generate(handle, request, max_new_tokens=2)

    def transcribe(
        self,
        handle: hf_common.HfHandle,
        audio: np.ndarray,
        options: TranscriptionOptions,
        on_segment: Callable[[Segment], None],
    ) -> Transcription:
        self.check_task(options.task)
        language = model_language(options.language)
        raw = hf_common.generate(
            handle,
            handle.processor.apply_transcription_request(
                audio=audio, language=language, prompt=options.prompt or None
            ),
            _token_limit(len(audio) / self.sample_rate),
        )
        return self._result(raw, language, len(audio) / self.sample_rate, on_segment)

    def batch_key(self, options: TranscriptionOptions) -> Hashable | None:
        # the processor takes one language for a batch (None: detect, the OpenAI default,
        # which must batch too: a bare None would mean "runs alone"), prompts per clip
        if options.task != "transcribe":
            return None
        return ("language", model_language(options.language))

    def transcribe_batch(self, handle: hf_common.HfHandle, audios: list[np.ndarray],
                         options: list[TranscriptionOptions],
                         on_segments: list[Callable[[Segment], None]],
                         ) -> list[Transcription | Exception]:
        """One padded `generate` for every clip (one language, prompts per clip)."""
        for option in options:
            self.check_task(option.task)
        languages = [model_language(option.language) for option in options]
        if len(set(languages)) > 1:
            raise ValueError("a batch has one language")
        durations = [len(audio) / self.sample_rate for audio in audios]
        raws = hf_common.generate_batch(
            handle,
            handle.processor.apply_transcription_request(
                audio=list(audios), language=languages[0],
                prompt=[option.prompt or None for option in options]),
            [_token_limit(duration) for duration in durations])
        return [self._result(raw, language, duration, on_segment) for raw, language, duration,
                on_segment in zip(raws, languages, durations, on_segments, strict=True)]

    def _result(self, raw: str, language: str | None, duration: float,
                on_segment: Callable[[Segment], None]) -> Transcription:
        detected, text = parse_output(raw, language)
        segments: list[Segment] = []
        if text:
            # The model gives no timestamps: one segment spans the clip.
            segments.append(Segment(id=0, start=0.0, end=round(duration, 3), text=text))
            on_segment(segments[0])
        return Transcription(text=text, language=detected, duration=duration, segments=segments)


def _token_limit(duration: float) -> int:
    return max(MIN_NEW_TOKENS, int(duration * NEW_TOKENS_PER_SECOND))
