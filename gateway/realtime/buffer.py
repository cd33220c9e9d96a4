"""The input audio buffer of one session: base64 PCM16 in, 16 kHz float32 kept, turns out.

Audio is resampled to 16 kHz as it arrives (soxr's streaming resampler: no seams between
chunks), which is the rate of the VAD and of every ASR engine. With server VAD the buffer
keeps only `prefix_padding_ms` before the speech it waits for, so an idle session holds a
fraction of a second; a turn is cut at speech_stopped, or when it reaches the buffer limit.
Without VAD the client commits, and an append past the limit is refused.

All positions are 16 kHz samples since the session's first audio (the protocol's
`audio_start_ms` / `audio_end_ms` are these ÷ 16).
"""

from __future__ import annotations

import base64
import binascii
import math
from dataclasses import dataclass

import numpy as np
import soxr

from common import g711
from common.audio import encode_wav
from gateway.realtime.protocol import PCM, ProtocolError
from gateway.realtime.vad import FRAME, SAMPLE_RATE, SileroVad, TurnDetector, VadConfig, VadStream

#: the shortest buffer a commit takes (OpenAI's rule too)
MIN_COMMIT_MS = 100
#: an append shorter than this joins the previous chunk if that is short too
MIN_CHUNK = 4096


@dataclass(frozen=True, slots=True)
class Turn:
    audio: np.ndarray  # 16 kHz float32

    @property
    def seconds(self) -> float:
        return len(self.audio) / SAMPLE_RATE

    def wav(self) -> bytes:
        """16-bit mono WAV, what the worker decodes like any upload."""
        return encode_wav(self.audio, SAMPLE_RATE)


@dataclass(frozen=True, slots=True)
class SpeechStarted:
    sample: int  # where the turn's audio begins (the speech, less the prefix padding)


@dataclass(frozen=True, slots=True)
class SpeechStopped:
    sample: int
    turn: Turn


Change = SpeechStarted | SpeechStopped


def decode_pcm16(audio: object, max_samples: int, rate: int, event_id: str | None) -> np.ndarray:
    """An append's `audio` (base64 PCM16 LE mono) as float32, checked before it is decoded."""
    return decode_chunk(audio, max_samples, rate, event_id, PCM)


def decode_chunk(audio: object, max_samples: int, rate: int, event_id: str | None,
                 encoding: str) -> np.ndarray:
    """An append's `audio` (base64 of `encoding`: PCM16 LE mono, or G.711 μ-law / A-law) as
    float32 at its own rate, checked before it is decoded."""
    if audio is None:
        raise ProtocolError("missing_required_parameter", "the append has no 'audio'", "audio",
                            event_id)
    if not isinstance(audio, str):
        raise ProtocolError("invalid_type", "audio must be a base64 string", "audio", event_id)
    width = 2 if encoding == PCM else 1
    # base64 holds 3 bytes per 4 characters: refuse an oversized chunk before decoding it
    if len(audio) // 4 * 3 > width * max_samples * rate // SAMPLE_RATE + 3:
        raise ProtocolError("input_audio_buffer_full", "this chunk alone is longer than the "
                            "input audio buffer's limit", "audio", event_id)
    try:
        raw = base64.b64decode(audio, validate=True)
    except (binascii.Error, ValueError):
        raise ProtocolError("invalid_base64", "audio is not valid base64", "audio",
                            event_id) from None
    if encoding != PCM:
        return g711.decode(raw, encoding)
    if len(raw) % 2:
        raise ProtocolError("invalid_audio", f"audio holds {len(raw)} bytes: 16-bit PCM needs "
                                             "an even number", "audio", event_id)
    return np.frombuffer(raw, dtype="<i2").astype(np.float32) / 32768.0


class InputBuffer:
    def __init__(self, rate: int, vad: VadConfig | None, max_samples: int) -> None:
        self.max_samples = max_samples
        self.received = 0  # samples appended over the session (its audio clock)
        self._chunks: list[np.ndarray] = []
        self._start = 0  # position of the first buffered sample
        self._scanned = 0  # position up to which the VAD has looked
        self._turn_start: int | None = None  # position where the current speech's turn begins
        self._stream = VadStream()
        self._detector: TurnDetector | None = None
        self.rate = rate
        self._resampler: soxr.ResampleStream | None = None
        self.set_rate(rate)
        self.set_vad(vad)

    # --- configuration ----------------------------------------------------------------------

    def set_rate(self, rate: int) -> None:
        self.rate = rate
        self._resampler = (None if rate == SAMPLE_RATE else
                           soxr.ResampleStream(rate, SAMPLE_RATE, 1, dtype="float32"))

    def set_vad(self, vad: VadConfig | None) -> None:
        """Server VAD on (with this config) or off; a turn in progress is forgotten."""
        self._detector = None if vad is None else TurnDetector(vad)
        self._turn_start = None
        self._scanned = self.received
        if vad is not None:
            self._trim()

    @property
    def buffered(self) -> int:
        return self.received - self._start

    @property
    def settled(self) -> int:
        """Samples out of the buffer for good: in a committed turn, or dropped (silence the
        VAD trimmed, a clear)."""
        return self._start

    # --- the protocol's operations ------------------------------------------------------------

    def append(self, samples: np.ndarray, event_id: str | None) -> list[Change]:
        """Add audio at the input rate; with server VAD, the speech starts and stops it holds.
        Runs the VAD, so the session calls it off the event loop."""
        # refused before the resampler sees it: its state would carry the refused chunk's
        # last samples into the next turn, and the work would be spent for nothing
        arriving = math.ceil(len(samples) * SAMPLE_RATE / self.rate)
        if self._detector is None and self.buffered + arriving > self.max_samples:
            raise ProtocolError("input_audio_buffer_full", f"the input audio buffer holds at "
                                f"most {self.max_samples / SAMPLE_RATE:.0f} s: commit or clear "
                                "it first", "audio", event_id)
        if self._resampler is not None:
            samples = self._resampler.resample_chunk(samples)
        self._add(samples)
        return self._scan() if self._detector is not None else []

    def commit(self) -> Turn | None:
        """Everything buffered, as a turn (None if under MIN_COMMIT_MS); the buffer is emptied
        and any speech in progress forgotten."""
        if self._resampler is not None:  # the resampler's last few samples belong to this turn
            self._add(self._resampler.resample_chunk(np.zeros(0, np.float32), last=True))
            self.set_rate(self.rate)
        start, end = self._start, self.received
        audio = self._take(start, end)
        self.clear()
        if (end - start) * 1000 < MIN_COMMIT_MS * SAMPLE_RATE:
            return None
        return Turn(audio)

    def clear(self) -> None:
        self._chunks.clear()
        self._start = self._scanned = self.received
        self._turn_start = None
        if self._detector is not None:
            self._detector.reset()

    # --- internals -----------------------------------------------------------------------------

    def _add(self, samples: np.ndarray) -> None:
        if not len(samples):
            return
        # a flood of one-sample appends must not cost an array (~100 bytes) per sample
        if len(samples) < MIN_CHUNK and self._chunks and len(self._chunks[-1]) < MIN_CHUNK:
            self._chunks[-1] = np.concatenate((self._chunks[-1], samples))
        else:
            self._chunks.append(samples)
        self.received += len(samples)

    def _scan(self) -> list[Change]:
        assert self._detector is not None
        count = (self.received - self._scanned) // FRAME
        if not count:
            return []
        first = self._scanned
        frames = self._take(first, first + count * FRAME).reshape(count, FRAME)
        probabilities = SileroVad.shared().probabilities(self._stream, frames)
        changes: list[Change] = []
        prefix = self._prefix()
        for i, probability in enumerate(probabilities):
            position = first + i * FRAME
            if (self._turn_start is not None
                    and position + FRAME - self._turn_start > self.max_samples):
                self._detector.reset()  # the turn would pass the buffer's limit: cut it here
                changes.append(self._cut(position))
            for change in self._detector.feed(probability[None], position):
                if change.started:
                    self._turn_start = max(self._start, change.sample - prefix)
                    changes.append(SpeechStarted(self._turn_start))
                else:
                    changes.append(self._cut(change.sample))
        self._scanned = first + count * FRAME
        self._trim()
        return changes

    def _cut(self, end: int) -> SpeechStopped:
        assert self._turn_start is not None
        turn = Turn(self._take(self._turn_start, end))
        self._turn_start = None
        self._drop_before(end)
        return SpeechStopped(end, turn)

    def _prefix(self) -> int:
        """The prefix padding in samples, at most half the buffer (so a turn has room)."""
        assert self._detector is not None
        padding = self._detector.config.prefix_padding_ms * SAMPLE_RATE // 1000
        return min(padding, self.max_samples // 2)

    def _trim(self) -> None:
        """Waiting for speech: keep only the prefix padding before the next frame."""
        if self._detector is not None and self._turn_start is None:
            self._drop_before(self._scanned - self._prefix())

    def _take(self, start: int, end: int) -> np.ndarray:
        """Buffered samples from `start` to `end` (positions), joining only the chunks they
        span (the VAD reads the newest few)."""
        parts: list[np.ndarray] = []
        chunk_end = self.received
        for chunk in reversed(self._chunks):
            chunk_start = chunk_end - len(chunk)
            if chunk_start < end and chunk_end > start:
                parts.append(chunk[max(0, start - chunk_start):end - chunk_start])
            if chunk_start <= start:
                break
            chunk_end = chunk_start
        parts.reverse()
        return np.concatenate(parts) if parts else np.zeros(0, np.float32)

    def _drop_before(self, position: int) -> None:
        while self._chunks and self._start < position:
            chunk = self._chunks[0]
            if self._start + len(chunk) <= position:
                self._chunks.pop(0)
                self._start += len(chunk)
            else:
                self._chunks[0] = chunk[position - self._start:]
                self._start = position
        self._start = max(self._start, min(position, self.received))
