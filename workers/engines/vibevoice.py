"""VibeVoice-ASR on transformers' built-in classes: long-form ASR with speakers and timestamps."""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from common.schemas import Segment, Transcription, TranscriptionOptions
from workers.engines import hf_common
from workers.engines.base import ModelRef
from workers.engines.vibevoice_parse import ParseError, parse_segments

log = logging.getLogger(__name__)

# The real generation config allows 32,768 new tokens and a fixed 512 truncates anything
# over ~30 s: scale with the audio (JSON keys + text run ~10 tokens per second of speech).
MIN_NEW_TOKENS = 256
NEW_TOKENS_PER_SECOND = 20
MAX_NEW_TOKENS = 32768


class VibeVoiceEngine(hf_common.HfAsrEngine):
    name = "vibevoice"
    sample_rate = 24000

    def load(self, model: ModelRef, device: str) -> hf_common.HfHandle:
        from transformers import VibeVoiceAsrForConditionalGeneration

        # SDPA for the language model only: the convolutional audio encoders refuse the option.
        return hf_common.load(VibeVoiceAsrForConditionalGeneration, model.source, device,
                              attn_implementation={"text_config": "sdpa"})

    def warm_up(self, handle: hf_common.HfHandle) -> None:
        silence = np.zeros(self.sample_rate, dtype=np.float32)
        request = handle.processor.apply_transcription_request(audio=silence)
        hf_common.generate(handle, request, max_new_tokens=2, sample=False)

    def transcribe(
        self,
        handle: hf_common.HfHandle,
        audio: np.ndarray,
        options: TranscriptionOptions,
        on_segment: Callable[[Segment], None],
    ) -> Transcription:
        self.check_task(options.task)
        duration = len(audio) / self.sample_rate
        max_new_tokens = min(
            MAX_NEW_TOKENS, MIN_NEW_TOKENS + int(duration * NEW_TOKENS_PER_SECOND)
        )
        # sample=False: no random noise on the acoustic latents, so decoding is deterministic.
        prompt = options.prompt or None
        raw = hf_common.generate(
            handle, handle.processor.apply_transcription_request(audio=audio, prompt=prompt),
            max_new_tokens, sample=False,
        )
        try:
            segments = parse_segments(raw, duration)
        except ParseError as exc:
            log.warning("vibevoice answer kept as plain text: %s", exc)
            text = raw.strip().removeprefix("assistant").strip()
            segments = [Segment(id=0, start=0.0, end=round(duration, 3), text=text)] if text else []
        for segment in segments:
            on_segment(segment)
        text = " ".join(segment.text for segment in segments)
        return Transcription(
            text=text, language=options.language, duration=duration, segments=segments
        )
