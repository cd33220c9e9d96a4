"""A two-voice test conversation made with espeak-ng, with its reference speaker turns.

The voices are `en-us+m3` and `en-us+f4`: Resemblyzer scores two clips of one of them ~0.92
alike and a clip of each ~0.61 (`en-us` against `en-us+f2` is ~0.72, and `en-gb+f3` sounds
like `en-gb` in this espeak build), so they are two speakers to the encoder as to the ear.
"""

from __future__ import annotations

import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.audio import decode_audio, encode_wav

SAMPLE_RATE = 16000
VOICES = {"alice": "en-us+m3", "bob": "en-us+f4"}
TURNS = (
    ("alice", "Good morning. I would like to book a table for dinner tonight."),
    ("bob", "Of course. How many people will be joining you this evening?"),
    ("alice", "There will be four of us, around seven o'clock if possible."),
    ("bob", "Seven works well. May I have a name for the reservation please?"),
    ("alice", "Yes, the name is Jordan. Could we sit near the window?"),
    ("bob", "Certainly, I have noted that down. We will see you at seven."),
)
REFERENCES = {
    "alice": "Here is a short sample of my voice, reading a sentence for the record.",
    "bob": "This is a reference recording, spoken slowly and clearly for the system.",
}
PAUSE_SECONDS = 0.5
#: what counts as voice when the reference turns are trimmed of espeak's own silence
_SILENCE = 1e-3


@dataclass(frozen=True, slots=True)
class RefTurn:
    start: float
    end: float
    speaker: str  # a key of VOICES
    text: str


def speak(voice: str, text: str, pitch: int | None = None,
          rate: int | None = None) -> np.ndarray:
    """`text` in espeak-ng's `voice` (language+variant), at its pitch (0-99) and rate (wpm)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = speak_to(Path(tmp) / "speech.wav", text, voice, pitch, rate)
        return decode_audio(path, SAMPLE_RATE)


def speak_to(path: Path, text: str, voice: str = "en-us", pitch: int | None = None,
             rate: int | None = None) -> Path:
    """`text` spoken by espeak-ng into the WAV file `path` (returned)."""
    extra = [*(["-p", str(pitch)] if pitch is not None else []),
             *(["-s", str(rate)] if rate is not None else [])]
    subprocess.run(["espeak-ng", "-v", voice, *extra, "-w", str(path), text], check=True,
                   capture_output=True)
    return path


def write_mix(path: Path, pieces: list[tuple[int, np.ndarray]]) -> float:
    """Write the (start sample, audio) pieces, summed where they overlap, to `path` (16 kHz
    WAV) with 0.3 s of silence after the last; its length in seconds."""
    mix = np.zeros(max(start + len(audio) for start, audio in pieces)
                   + int(0.3 * SAMPLE_RATE), dtype=np.float32)
    for start, audio in pieces:
        mix[start:start + len(audio)] += audio
    mix /= max(1.0, float(np.abs(mix).max()) / 0.95)  # overlapped speech must not clip
    path.write_bytes(encode_wav(mix, SAMPLE_RATE))
    return len(mix) / SAMPLE_RATE


def build(path: Path, turns: tuple[tuple[str, str], ...] = TURNS) -> list[RefTurn]:
    """Write the conversation to `path` (16 kHz WAV); its turns, trimmed to the voice."""
    pause = np.zeros(int(PAUSE_SECONDS * SAMPLE_RATE), dtype=np.float32)
    pieces, reference, offset = [], [], 0
    for speaker, text in turns:
        audio = speak(VOICES[speaker], text)
        loud = np.flatnonzero(np.abs(audio) > _SILENCE)
        first, last = (int(loud[0]), int(loud[-1]) + 1) if len(loud) else (0, len(audio))
        reference.append(RefTurn(round((offset + first) / SAMPLE_RATE, 3),
                                 round((offset + last) / SAMPLE_RATE, 3), speaker, text))
        pieces += [audio, pause]
        offset += len(audio) + len(pause)
    path.write_bytes(encode_wav(np.concatenate(pieces), SAMPLE_RATE))
    return reference


def reference_clip(path: Path, speaker: str) -> Path:
    """A 2-10 s clip of `speaker`'s voice saying something not in the conversation."""
    path.write_bytes(encode_wav(speak(VOICES[speaker], REFERENCES[speaker]), SAMPLE_RATE))
    return path
