"""XTTS v2 text-to-speech on coqui-tts, from a model directory (config.json, model.pth,
vocab.json, optional speakers_xtts.pth).

Runs in its own environment (.venvs/xtts): torch and coqui-tts are imported only by
`load`. The language list lives in common.catalog, where the gateway reads it.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from common.catalog import XTTS_LANGUAGES, XTTS_MIN_REFERENCE_SECONDS, xtts_language
from common.schemas import Synthesis, SynthesisOptions
from common.settings import Settings
from common.speech_text import split_sentences, unspeakable
from workers.engines.base import ModelRef

#: the gateway validates with the same list and rules (common.catalog); kept under these names
SUPPORTED_LANGUAGES = XTTS_LANGUAGES
normalize_language = xtts_language
_REQUIRED_FILES = ("config.json", "model.pth", "vocab.json")
_LATENT_CACHE_SIZE = 16
#: a test's pause hook (tests/test_tts_stream.py), off unless this variable names a directory:
#: see `_pause_if_armed`
PAUSE_DIR_VARIABLE = "XTTS_TEST_PAUSE_DIR"


@dataclass(slots=True)
class XttsHandle:
    model: Any  # TTS.tts.models.xtts.Xtts
    languages: frozenset[str]
    speakers: dict[str, dict[str, Any]]
    output_rate: int
    inference: dict[str, Any]
    #: clip hash -> (gpt_cond_latent, speaker_embedding), least recently used first
    latents: OrderedDict[str, tuple[Any, Any]] = field(default_factory=OrderedDict)


class XttsEngine:
    #: XTTS takes reference clips and returns speech at 24 kHz (it resamples internally to
    #: 22.05 kHz for the GPT and 16 kHz for the speaker encoder)
    sample_rate = 24000
    uses_torch = True
    #: seeds sampling before each piece (seed + its index), so the same text and voice give
    #: the same audio, also when a redelivered task resumes half-way
    seed: int | None = 0

    def __init__(self, settings: Settings) -> None:
        self.settings = settings  # no option of this engine comes from the settings yet
        pause_dir = os.environ.get(PAUSE_DIR_VARIABLE)
        self.pause_dir = Path(pause_dir) if pause_dir else None

    def cuda_available(self) -> bool:
        import torch

        return torch.cuda.is_available()

    def check_source(self, model: ModelRef) -> None:
        directory = Path(model.source)
        missing = [name for name in _REQUIRED_FILES if not (directory / name).is_file()]
        if missing:
            raise FileNotFoundError(
                f"{directory} is not an XTTS model directory (missing {', '.join(missing)})"
            )

    def load(self, model: ModelRef, device: str) -> XttsHandle:
        self.check_source(model)
        directory = Path(model.source)
        from TTS.tts.configs.xtts_config import XttsConfig
        from TTS.tts.models.xtts import Xtts

        config = XttsConfig()
        config.load_json(str(directory / "config.json"))
        # Xtts(config) is what the deprecated Xtts.init_from_config does, minus its warning.
        xtts = Xtts(config)
        xtts.load_checkpoint(config, checkpoint_dir=str(directory), eval=True)
        xtts.to(device)
        manager = xtts.speaker_manager
        return XttsHandle(
            model=xtts,
            languages=frozenset(config.languages),
            speakers=dict(manager.speakers) if manager is not None else {},
            output_rate=config.model_args.output_sample_rate,
            inference={
                "temperature": config.temperature,
                "length_penalty": config.length_penalty,
                "repetition_penalty": config.repetition_penalty,
                "top_k": config.top_k,
                "top_p": config.top_p,
            },
        )

    def warm_up(self, handle: XttsHandle) -> None:
        pass

    def unload(self, handle: XttsHandle) -> None:
        handle.latents.clear()
        handle.speakers.clear()

    def speak(self, handle: XttsHandle, options: SynthesisOptions,
              reference: np.ndarray | None, start: int = 0) -> Iterator[Synthesis]:
        """The text's sentences from the `start`-th on, one Synthesis each, as each is done."""
        import torch

        language = normalize_language(options.language)
        if language not in handle.languages:
            raise ValueError(f"language {language!r} is not in this XTTS model's config")
        # The tokenizer's per-language limits are XTTS's own (it keys Chinese as "zh").
        limit = handle.model.tokenizer.char_limits.get(language.split("-")[0], 250)
        sentences = split_sentences(options.text, limit)
        if not sentences:
            raise ValueError("the text is empty")
        if problem := unspeakable(options.text, language):  # before any piece is spoken
            raise ValueError(problem)
        # the GPT's text limit (XTTS asserts it per sentence, after the first were spoken)
        most = int(getattr(handle.model.args, "gpt_max_text_tokens", 402))
        for sentence in sentences[start:]:  # the engine's own text cleaning, also up front:
            try:  # num2words has gaps (Czech ordinals, Italian decimals under 1e-4)
                tokens = handle.model.tokenizer.encode(sentence, language.split("-")[0])
            except Exception as exc:
                raise ValueError(f"XTTS cannot read the sentence {sentence[:80]!r} in "
                                 f"{language} ({type(exc).__name__}: {exc})") from None
            if len(tokens) >= most:  # symbols spelled out ("%" is "percent"), or İ lowered
                raise ValueError(f"the sentence {sentence[:80]!r} is {len(tokens)} XTTS text "
                                 f"tokens once spelled out, past its {most - 1}: split it "
                                 "or write its symbols in words")
        if options.speed <= 0:
            raise ValueError("speed must be positive")
        latent, embedding = self._conditioning(handle, options.voice, reference)
        for index, sentence in enumerate(sentences[start:], start=start):
            if index > start and self.pause_dir is not None:  # the previous piece is stored
                _pause_if_armed(self.pause_dir)
            if self.seed is not None:  # per piece: a resumed task speaks like a whole one
                torch.manual_seed(self.seed + index)
            try:
                wav = handle.model.inference(sentence, language, latent, embedding,
                                             speed=options.speed, **handle.inference)["wav"]
            except (OverflowError, AssertionError) as exc:  # num2words, the GPT's token limit
                raise ValueError(unspeakable(sentence, language)
                                 or f"XTTS cannot speak this sentence ({exc})") from None
            yield Synthesis(np.asarray(wav, dtype=np.float32), handle.output_rate,
                            len(sentence))

    def _conditioning(
        self, handle: XttsHandle, voice: str | None, reference: np.ndarray | None
    ) -> tuple[Any, Any]:
        if reference is None:
            if voice is None:
                raise ValueError("XTTS needs a reference clip or a built-in voice name")
            if voice not in handle.speakers:
                known = ", ".join(sorted(handle.speakers)) or "none in this model"
                raise ValueError(f"unknown XTTS voice {voice!r} (built-in speakers: {known})")
            speaker = handle.speakers[voice]
            return speaker["gpt_cond_latent"], speaker["speaker_embedding"]

        clip = np.ascontiguousarray(reference, dtype=np.float32).reshape(-1)
        if clip.size < XTTS_MIN_REFERENCE_SECONDS * self.sample_rate:
            raise ValueError(
                f"the reference clip is too short ({clip.size / self.sample_rate:.2f} s; "
                f"XTTS needs at least {XTTS_MIN_REFERENCE_SECONDS} s, 5-30 s works best)"
            )
        key = hashlib.blake2b(clip.tobytes(), digest_size=16).hexdigest()
        if key in handle.latents:
            handle.latents.move_to_end(key)
            return handle.latents[key]
        latents = self._clone(handle, clip)
        handle.latents[key] = latents
        if len(handle.latents) > _LATENT_CACHE_SIZE:
            handle.latents.popitem(last=False)
        return latents

    def _clone(self, handle: XttsHandle, clip: np.ndarray) -> tuple[Any, Any]:
        """What Xtts.get_conditioning_latents does from a file, from samples already decoded."""
        import torch

        xtts, config = handle.model, handle.model.config
        audio = torch.tensor(clip[: config.max_ref_len * self.sample_rate], device=xtts.device)
        audio = audio.clamp(-1.0, 1.0)[None]
        if config.sound_norm_refs:
            audio = audio / audio.abs().max().clamp(min=1e-8) * 0.75
        embedding = xtts.get_speaker_embedding(audio, self.sample_rate)
        latent = xtts.get_gpt_cond_latents(
            audio, self.sample_rate, length=config.gpt_cond_len,
            chunk_length=config.gpt_cond_chunk_len,
        )  # fmt: skip
        return latent, embedding


def _pause_if_armed(directory: Path, limit_seconds: float = 600.0) -> None:
    """The test hook: if the file `armed` is in `directory`, take it (it becomes `paused`, so
    one task pauses per arming) and wait, before speaking the next piece, until the test
    removes `paused` (or kills the process; at most `limit_seconds`)."""
    try:
        (directory / "armed").rename(directory / "paused")
    except FileNotFoundError:
        return
    deadline = time.monotonic() + limit_seconds
    while (directory / "paused").exists() and time.monotonic() < deadline:
        time.sleep(0.01)
