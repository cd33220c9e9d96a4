"""Voiceprint: the speaker embedding of a clip (Resemblyzer's GE2E speaker encoder, 256
dimensions, L2-normed) and, given a `reference` clip, a same-speaker score: the cosine
similarity of the two embeddings, with `same_speaker` true from the `threshold` param up;
and the lowest score of the clip's parts (PART_SECONDS of its voice, every PART_HOP_SECONDS)
against the reference: a clip that is mostly another voice can score high as a whole (the
consent check asks every part to be the consenting speaker: gateway/serving/voices.py).

Model sources: `bundled`, the encoder Resemblyzer ships (resemblyzer/pretrained.pt), or a
local checkpoint file of the same network. Runs in its own environment (.venvs/voiceprint):
torch and resemblyzer are imported only by `load`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from workers.engines.base import ModelRef, local_path

BUNDLED = "bundled"
#: shortest stretch of voice embedded (Resemblyzer pads shorter ones; this little is noise)
MIN_VOICE_SECONDS = 0.2
#: a clip quieter than this (about -80 dBFS) holds no voice; Resemblyzer would still embed it
SILENCE_RMS = 1e-4
#: the parts a clip is scored in (its voice, after Resemblyzer's VAD): 2 s parts of one real
#: speaker scored as low as 0.70 against that speaker's consent, 3 s parts 0.75, 4 s parts
#: let through more of a mixed sample (docs/voices.md has the measurements)
PART_SECONDS, PART_HOP_SECONDS = 3.0, 1.5
#: parts are scored for a clip whose voice lasts at most this long (a consent check's sample
#: is at most 30 s): an hour would cost thousands of embeddings for a score nobody asked for
MOST_PARTS_SECONDS = 120.0


@dataclass(slots=True)
class VoiceprintHandle:
    encoder: Any  # resemblyzer.VoiceEncoder


class VoiceprintEngine:
    #: Resemblyzer's sampling rate (resemblyzer.hparams.sampling_rate): the runtime decodes to it
    sample_rate = 16000
    uses_torch = True

    def __init__(self, settings: object | None = None) -> None:
        del settings  # nothing to configure

    def cuda_available(self) -> bool:
        import torch

        return torch.cuda.is_available()

    def check_source(self, model: ModelRef) -> None:
        if model.source == BUNDLED:
            return
        path = local_path(model.source)
        if path is None or not path.is_file():
            raise FileNotFoundError(f"voiceprint takes {BUNDLED!r} or a checkpoint file, and "
                                    f"{model.source!r} is neither")

    def load(self, model: ModelRef, device: str) -> VoiceprintHandle:
        self.check_source(model)
        import resemblyzer
        import torch
        from resemblyzer import VoiceEncoder

        path = (Path(resemblyzer.__file__).parent / "pretrained.pt" if model.source == BUNDLED
                else Path(model.source))
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)["model_state"]
        except Exception as exc:  # torch.load's errors for a file of something else are cryptic
            raise ValueError(f"{path} is not a Resemblyzer voice encoder checkpoint "
                             f"({type(exc).__name__}: {exc})") from None
        encoder = VoiceEncoder(device=device, verbose=False, weights_fpath=path)
        # VoiceEncoder loads with strict=False (its checkpoints carry training-only extras), so
        # a checkpoint of another network would load nothing and embed at random: refuse it.
        if missing := sorted(set(encoder.state_dict()) - set(state)):
            raise ValueError(f"{path} is not a Resemblyzer voice encoder checkpoint "
                             f"(it lacks {', '.join(missing[:3])})")
        encoder.eval()
        return VoiceprintHandle(encoder)

    def warm_up(self, handle: VoiceprintHandle) -> None:
        # the first embedding pays for librosa's and torch's lazy set-up; not the first task
        noise = np.random.default_rng(0).normal(0.0, 0.05, self.sample_rate).astype(np.float32)
        self._embed(handle, noise, "warm-up")

    def unload(self, handle: VoiceprintHandle) -> None:
        handle.encoder = None

    def analyze(self, handle: VoiceprintHandle, clips: dict[str, np.ndarray],
                params: dict[str, Any]) -> dict[str, Any]:
        voice = self._voice(clips["file"], "file")
        embedding = self._embedding(handle, voice)
        result: dict[str, Any] = {
            "embedding": [round(float(value), 6) for value in embedding],
            "dimensions": len(embedding),
            "duration": round(len(clips["file"]) / self.sample_rate, 3),
        }
        if (reference := clips.get("reference")) is not None:
            # the embeddings are L2-normed: their dot product is the cosine similarity
            other = self._embed(handle, reference, "reference")
            score = float(np.dot(embedding, other))
            result.update(score=round(score, 6), threshold=params["threshold"],
                          same_speaker=score >= params["threshold"])
            if len(voice) <= MOST_PARTS_SECONDS * self.sample_rate:
                parts = [float(np.dot(self._embedding(handle, part), other))
                         for part in self._parts(voice)]
                result.update(lowest_part_score=round(min(parts, default=score), 6),
                              parts=len(parts))
        return result

    def _parts(self, voice: np.ndarray) -> list[np.ndarray]:
        """PART_SECONDS of `voice` every PART_HOP_SECONDS (the last one ending with it);
        none when it is no longer than one part (its whole score is its part's)."""
        size, hop = (int(s * self.sample_rate) for s in (PART_SECONDS, PART_HOP_SECONDS))
        if len(voice) <= size:
            return []
        starts = list(range(0, len(voice) - size + 1, hop))
        if starts[-1] + size < len(voice):
            starts.append(len(voice) - size)
        return [voice[start:start + size] for start in starts]

    def _embed(self, handle: VoiceprintHandle, audio: np.ndarray, name: str) -> np.ndarray:
        return self._embedding(handle, self._voice(audio, name))

    def _voice(self, audio: np.ndarray, name: str) -> np.ndarray:
        """The clip's voice: volume normalised, long silences cut (Resemblyzer's webrtcvad)."""
        from resemblyzer import preprocess_wav

        if not len(audio) or float(np.sqrt(np.mean(np.square(audio)))) < SILENCE_RMS:
            raise ValueError(f"no voice in the {name!r} clip: it is silent")
        voice = preprocess_wav(audio)
        if len(voice) < MIN_VOICE_SECONDS * self.sample_rate:
            voice = audio  # the VAD heard no speech (a tone, noise): embed the clip as it is
        if len(voice) < MIN_VOICE_SECONDS * self.sample_rate:
            raise ValueError(f"the {name!r} clip is too short: at least {MIN_VOICE_SECONDS} s "
                             "of voice is needed")
        return voice

    @staticmethod
    def _embedding(handle: VoiceprintHandle, voice: np.ndarray) -> np.ndarray:
        import torch

        with torch.inference_mode():
            return handle.encoder.embed_utterance(voice)
