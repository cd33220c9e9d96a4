"""Server VAD: silero-vad's ONNX model (shipped in its PyPI package) on onnxruntime, and the
turn detector that turns its speech probabilities into speech_started / speech_stopped.

One `SileroVad` per gateway process: an onnxruntime session is stateless and safe to call
from several threads, so every stream keeps only its own recurrent state and context (a few
hundred floats). The model is found on disk without importing the `silero_vad` package,
whose import pulls in torch (~2 s, ~200 MB per gateway process); onnxruntime is already in
the core environment for faster-whisper.
"""

from __future__ import annotations

import importlib.util
import threading
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

SAMPLE_RATE = 16_000
FRAME = 512  # samples per model call at 16 kHz (32 ms): the model's fixed window
CONTEXT = 64  # samples of the previous frame the model sees again
#: a frame below `threshold - HYSTERESIS` counts as silence, and always one below
#: SILENCE_FLOOR (silero's own rule: a threshold at or under the hysteresis still ends turns)
HYSTERESIS, SILENCE_FLOOR = 0.15, 0.01


def model_path() -> Path:
    spec = importlib.util.find_spec("silero_vad")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("silero-vad is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "data" / "silero_vad.onnx"


class SileroVad:
    """The shared model: `probabilities(stream, frames)` for a stream's own state."""

    _instance: SileroVad | None = None
    _lock = threading.Lock()

    def __init__(self) -> None:
        import onnxruntime

        options = onnxruntime.SessionOptions()
        # one thread per call: many sessions share the gateway's cores, each call is ~0.1 ms
        options.inter_op_num_threads = 1
        options.intra_op_num_threads = 1
        self.session = onnxruntime.InferenceSession(str(model_path()), sess_options=options,
                                                    providers=["CPUExecutionProvider"])
        self._rate = np.array(SAMPLE_RATE, dtype=np.int64)

    @classmethod
    def shared(cls) -> SileroVad:
        with cls._lock:
            if cls._instance is None:
                cls._instance = cls()
            return cls._instance

    def probabilities(self, stream: VadStream, frames: np.ndarray) -> np.ndarray:
        """Speech probability of each row of `frames` (n by FRAME float32, in order)."""
        out = np.empty(len(frames), dtype=np.float32)
        for i, frame in enumerate(frames):
            window = np.concatenate([stream.context, frame])[None, :]
            prob, stream.state = self.session.run(
                None, {"input": window, "state": stream.state, "sr": self._rate})
            stream.context = frame[-CONTEXT:]
            out[i] = float(prob[0, 0])
        return out


@dataclass(slots=True)
class VadStream:
    """One audio stream's recurrent state: carried from frame to frame over the session."""

    state: np.ndarray = field(default_factory=lambda: np.zeros((2, 1, 128), np.float32))
    context: np.ndarray = field(default_factory=lambda: np.zeros(CONTEXT, np.float32))


@dataclass(frozen=True, slots=True)
class VadConfig:
    threshold: float = 0.5
    prefix_padding_ms: int = 300
    silence_duration_ms: int = 500


@dataclass(frozen=True, slots=True)
class Change:
    """speech started (`started`) or stopped at `sample` (16 kHz samples since the
    session's first audio)."""

    started: bool
    sample: int


class TurnDetector:
    """Frames in, speech starts and stops out: a start at the first frame at or above the
    threshold, a stop once the speech has been followed by `silence_duration_ms` of frames
    below `threshold - HYSTERESIS` (at least SILENCE_FLOOR)."""

    def __init__(self, config: VadConfig) -> None:
        self.config = config
        self.in_speech = False
        self._silent_frames = 0

    @property
    def silence_frames(self) -> int:
        return max(1, round(self.config.silence_duration_ms * SAMPLE_RATE / 1000 / FRAME))

    def reset(self) -> None:
        self.in_speech = False
        self._silent_frames = 0

    def feed(self, probabilities: np.ndarray, first_sample: int) -> list[Change]:
        """The changes within frames whose first one begins at `first_sample`."""
        changes: list[Change] = []
        low = max(self.config.threshold - HYSTERESIS, SILENCE_FLOOR)
        for i, prob in enumerate(probabilities):
            start = first_sample + i * FRAME
            if not self.in_speech:
                if prob >= self.config.threshold:
                    self.in_speech, self._silent_frames = True, 0
                    changes.append(Change(True, start))
                continue
            if prob >= self.config.threshold:
                self._silent_frames = 0
            elif prob < low:
                self._silent_frames += 1
                if self._silent_frames >= self.silence_frames:
                    self.in_speech, self._silent_frames = False, 0
                    changes.append(Change(False, start + FRAME))
        return changes
