"""Parakeet (NeMo FastConformer RNNT/TDT) transcription: `.nemo` file or pretrained name.

torch and NeMo are imported inside the methods: this module imports without them.
"""

from __future__ import annotations

import copy
import logging
import math
import tarfile
import time
from bisect import bisect_right
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from common.schemas import Segment, Transcription, TranscriptionOptions, Word
from common.settings import Settings
from workers.engines.base import ModelRef

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

LOCAL_ATTENTION = ("rel_pos_local_attn", [128, 128])


@dataclass(slots=True)
class ParakeetHandle:
    model: Any  # nemo.collections.asr.models.ASRModel
    device: str
    dtype: torch.dtype


class ParakeetEngine:
    """Options come from the arguments, else from the settings (SPEECH_PARAKEET_*): window
    length, warm-up clips, CUDA graphs, and the dtype of encoder/decoder/joint ("auto" is bf16
    on CUDA and fp32 on CPU: bf16 on a CPU without bf16 units is 3-5x slower)."""

    sample_rate = 16000
    uses_torch = True
    segment_separator = " "

    def __init__(self, settings: Settings, window_seconds: float | None = None,
                 warmup_seconds: Sequence[float] | None = None,
                 cuda_graphs: bool | None = None, dtype: str | None = None) -> None:
        self.window_seconds = window_seconds or settings.parakeet_window_seconds
        self.warmup_seconds = list(warmup_seconds if warmup_seconds is not None
                                   else settings.parakeet_warmup_seconds)
        self.cuda_graphs = settings.parakeet_cuda_graphs if cuda_graphs is None else cuda_graphs
        dtype = dtype or settings.parakeet_dtype
        self.dtype = None if dtype == "auto" else dtype
        if self.dtype not in (None, "bfloat16", "float32"):
            raise ValueError(f"unsupported parakeet dtype {self.dtype!r}")

    def cuda_available(self) -> bool:
        import torch

        return torch.cuda.is_available()

    def check_source(self, model: ModelRef) -> None:
        source = model.source
        if (source.endswith(".nemo") or Path(source).exists()) and not Path(source).is_file():
            raise FileNotFoundError(f"Parakeet model file not found (or not a file): {source}")
        # a .nemo file is a tar archive: anything else fails here, before NeMo's ~10 s import
        if Path(source).is_file() and not tarfile.is_tarfile(source):
            raise ValueError(f"not a .nemo checkpoint: {source} (not a tar archive)")

    def load(self, model: ModelRef, device: str) -> ParakeetHandle:
        started = time.perf_counter()
        source = model.source
        self.check_source(model)
        import torch
        from nemo.collections.asr.models import ASRModel
        from omegaconf import open_dict

        # Restore on CPU, then move: restoring straight to CUDA spikes GPU memory during load.
        if Path(source).is_file():
            try:
                asr = ASRModel.restore_from(source, map_location=torch.device("cpu"))
            except tarfile.TarError as exc:
                raise ValueError(f"not a .nemo checkpoint: {source} ({exc})") from None
        else:
            asr = ASRModel.from_pretrained(source, map_location=torch.device("cpu"))
        on_cuda = device.startswith("cuda")
        dtype = getattr(torch, self.dtype) if self.dtype else (
            torch.bfloat16 if on_cuda else torch.float32)
        asr.eval()

        decoding = copy.deepcopy(asr.cfg.decoding)
        with open_dict(decoding):
            decoding.strategy = "greedy_batch"
            decoding.compute_timestamps = True
            decoding.greedy.use_cuda_graph_decoder = self.cuda_graphs and on_cuda
        asr.change_decoding_strategy(decoding, verbose=False)
        # Dither adds random noise to the features: the same file would decode differently.
        asr.preprocessor.featurizer.dither = 0.0
        asr.preprocessor.featurizer.pad_to = 0
        asr.change_attention_model(*LOCAL_ATTENTION)
        # change_attention_model builds the new attention modules in training mode: without
        # this eval() their dropout stays on and decoding is no longer deterministic.
        asr.eval()
        # Cast only now: casting before change_attention_model leaves the rebuilt attention
        # (fresh fp32 modules) as fp32 islands in a bf16 encoder. The preprocessor stays fp32.
        for module in (asr.encoder, asr.decoder, asr.joint):
            module.to(dtype)
        asr.to(device)
        log.info("parakeet: loaded %s on %s (%s) in %.1f s", model.name, device,
                 str(dtype).removeprefix("torch."), time.perf_counter() - started)
        return ParakeetHandle(asr, device, dtype)

    def warm_up(self, handle: ParakeetHandle) -> None:
        for seconds in sorted(self.warmup_seconds):
            _forward(handle, np.zeros(int(seconds * self.sample_rate), dtype=np.float32))

    def unload(self, handle: ParakeetHandle) -> None:
        pass

    def transcribe(self, handle: ParakeetHandle, audio: np.ndarray,
                   options: TranscriptionOptions,
                   on_segment: Callable[[Segment], None]) -> Transcription:
        if options.task != "transcribe":
            raise ValueError("parakeet only transcribes (no translation)")
        audio = np.ascontiguousarray(audio, dtype=np.float32)
        windows = self._windows(audio)
        hypotheses = [_forward(handle, audio[start:end]) for start, end in windows]
        return self._assemble(audio, windows, hypotheses, options, on_segment)

    def batch_key(self, options: TranscriptionOptions) -> Hashable | None:
        return None if options.task != "transcribe" else "transcribe"

    def transcribe_batch(self, handle: ParakeetHandle, audios: list[np.ndarray],
                         options: list[TranscriptionOptions],
                         on_segments: list[Callable[[Segment], None]],
                         ) -> list[Transcription | Exception]:
        """Every clip's windows through one padded forward (lengths mask the padding), at
        most as many windows a call as there are clips."""
        clips = [np.ascontiguousarray(audio, dtype=np.float32) for audio in audios]
        windows = [self._windows(audio) for audio in clips]
        flat = [(index, start, end) for index, found in enumerate(windows)
                for start, end in found]
        hypotheses: list[Any] = []
        for at in range(0, len(flat), len(clips)):
            hypotheses += _forward_batch(handle, [clips[i][start:end]
                                                  for i, start, end in flat[at:at + len(clips)]])
        results: list[Transcription | Exception] = []
        for index, audio in enumerate(clips):
            mine = [h for (i, _, _), h in zip(flat, hypotheses, strict=True) if i == index]
            try:
                results.append(self._assemble(audio, windows[index], mine, options[index],
                                              on_segments[index]))
            except Exception as exc:
                results.append(exc)
        return results

    def _windows(self, audio: np.ndarray) -> list[tuple[int, int]]:
        """Even windows of at most `window_seconds`, without any shorter than a frame."""
        total = len(audio)
        count = max(1, math.ceil(total / (self.window_seconds * self.sample_rate)))
        bounds = [round(i * total / count) for i in range(count + 1)]
        return [(start, end) for start, end in pairwise(bounds)
                if end - start >= self.sample_rate // 100]

    def _assemble(self, audio: np.ndarray, windows: list[tuple[int, int]],
                  hypotheses: list[Any], options: TranscriptionOptions,
                  on_segment: Callable[[Segment], None]) -> Transcription:
        texts: list[str] = []
        segments: list[Segment] = []
        for (start, end), hypothesis in zip(windows, hypotheses, strict=True):
            offset, limit = start / self.sample_rate, end / self.sample_rate
            texts.append(hypothesis.text.strip())
            for segment in _segments(hypothesis, offset, limit, options.word_timestamps):
                segment.id = len(segments)
                segments.append(segment)
                on_segment(segment)
        return Transcription(text=" ".join(t for t in texts if t), language=options.language,
                             duration=len(audio) / self.sample_rate, segments=segments)


def _forward(handle: ParakeetHandle, audio: np.ndarray) -> Any:
    return _forward_batch(handle, [audio])[0]


def _forward_batch(handle: ParakeetHandle, audios: list[np.ndarray]) -> list[Any]:
    import torch
    from nemo.collections.asr.parts.utils.timestamp_utils import process_timestamp_outputs

    asr = handle.model
    if handle.device.startswith("cuda"):
        torch.cuda.empty_cache()  # each window starts from a clean cache: long files fragment it
    # NeMo's transcribe() leaves the modules in training mode (dropout on): never trust it.
    asr.eval()
    with torch.inference_mode():
        # zero padding to the longest; the lengths keep it out of every clip's result
        padded = np.zeros((len(audios), max(len(a) for a in audios)), dtype=np.float32)
        for row, audio in enumerate(audios):
            padded[row, :len(audio)] = audio
        signal = torch.from_numpy(padded).to(handle.device)
        length = torch.tensor([len(a) for a in audios], device=handle.device)
        features, feature_length = asr.preprocessor(input_signal=signal, length=length)
        # A bf16 encoder needs bf16 features; the preprocessor runs in fp32.
        encoded, encoded_length = asr.encoder(audio_signal=features.to(handle.dtype),
                                              length=feature_length)
        hypotheses = asr.decoding.rnnt_decoder_predictions_tensor(
            encoder_output=encoded, encoded_lengths=encoded_length, return_hypotheses=True)
    stride = asr.cfg.preprocessor.window_stride
    return list(process_timestamp_outputs(hypotheses, asr.encoder.subsampling_factor, stride))


def _segments(hypothesis: Any, offset: float, limit: float, with_words: bool) -> list[Segment]:
    """NeMo's segment and word times, re-based by `offset` and clamped to the window's end."""

    def at(seconds: float) -> float:
        return round(min(offset + max(seconds, 0.0), limit), 3)

    stamps = hypothesis.timestamp if isinstance(hypothesis.timestamp, dict) else {}
    words = [Word(w["word"], at(w["start"]), at(w["end"])) for w in stamps.get("word", [])]
    segments = [Segment(0, at(s["start"]), at(s["end"]), s["segment"])
                for s in stamps.get("segment", []) if s["segment"].strip()]
    if not segments and hypothesis.text.strip():
        start = words[0].start if words else offset
        end = words[-1].end if words else limit
        segments = [Segment(0, start, end, hypothesis.text.strip())]
    if with_words and segments:
        starts = [segment.start for segment in segments]
        groups: list[list[Word]] = [[] for _ in segments]
        for word in words:  # each word goes to the last segment starting at or before it
            groups[max(bisect_right(starts, word.start) - 1, 0)].append(word)
        for segment, group in zip(segments, groups, strict=True):
            segment.words = group
    return segments
