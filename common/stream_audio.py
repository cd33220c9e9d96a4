"""Encoding speech as it arrives: 16-bit mono PCM pieces in, bytes of the asked format out,
piece by piece, so a streamed `/v1/audio/speech` sends each sentence once it is spoken.

`pcm` passes samples through; `wav` is a header whose sizes say "unknown" (0xFFFFFFFF, what
streaming WAV writers use; players read to the end of the stream) and then the samples;
`mp3`, `opus` (Ogg) and `aac` (ADTS) go through PyAV into a sink that only appends, so
nothing is rewritten at the end. `flac` is not here: its muxer rewrites STREAMINFO at the
end, so it is answered whole.
"""

from __future__ import annotations

import struct

import av
import numpy as np

from common.audio import OUTPUT_FORMATS, AudioError

STREAM_FORMATS = ("mp3", "opus", "aac", "wav", "pcm")
#: an Ogg page at most this long (µs): the muxer's default (1 s) would hold a sentence back
_OGG_PAGE_MICROSECONDS = "20000"
_UNKNOWN_SIZE = 0xFFFFFFFF


def streaming_wav_header(sample_rate: int) -> bytes:
    """RIFF/WAVE header of mono 16-bit PCM whose length is not known yet."""
    fmt = struct.pack("<HHIIHH", 1, 1, sample_rate, sample_rate * 2, 2, 16)
    return (b"RIFF" + struct.pack("<I", _UNKNOWN_SIZE) + b"WAVE" + b"fmt "
            + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", _UNKNOWN_SIZE))


class _Sink:
    """A write-only file for PyAV: what the muxer wrote since the last `take`."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: bytes) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        data = b"".join(self.parts)
        self.parts.clear()
        return data


class StreamEncoder:
    """One response's encoder: `feed` each PCM piece, then `finish` once. Not thread-safe;
    a caller may run each call in a thread, one after the other."""

    def __init__(self, fmt: str, sample_rate: int) -> None:
        if fmt not in STREAM_FORMATS:
            raise ValueError(f"{fmt} cannot be streamed")
        self.fmt, self.sample_rate = fmt, sample_rate
        self._started = False
        self._container: av.container.OutputContainer | None = None
        self._stream: av.audio.stream.AudioStream | None = None
        self._sink = _Sink()
        if fmt in ("wav", "pcm"):
            return
        spec = OUTPUT_FORMATS[fmt]
        options = {"page_duration": _OGG_PAGE_MICROSECONDS} if spec.container == "ogg" else {}
        try:
            self._container = av.open(self._sink, mode="w", format=spec.container,
                                      options=options)
            self._stream = self._container.add_stream(spec.codec, rate=sample_rate,
                                                      layout="mono")
            self._stream.bit_rate = spec.bit_rate
        except av.FFmpegError as exc:
            raise AudioError(f"cannot encode {fmt} at {sample_rate} Hz ({exc})") from None

    @property
    def content_type(self) -> str:
        if self.fmt == "pcm":
            return f"audio/pcm; rate={self.sample_rate}"
        return OUTPUT_FORMATS[self.fmt].content_type

    def feed(self, pcm: bytes) -> bytes:
        """The bytes to send for one more piece of 16-bit mono PCM at `sample_rate`."""
        if self._container is None:
            head = b""
            if self.fmt == "wav" and not self._started:
                head = streaming_wav_header(self.sample_rate)
            self._started = True
            return head + pcm
        assert self._stream is not None
        if pcm:
            samples = np.frombuffer(pcm, dtype="<i2").reshape(1, -1)
            frame = av.AudioFrame.from_ndarray(samples, format="s16", layout="mono")
            frame.sample_rate = self.sample_rate
            self._encode(frame)
        return self._sink.take()

    def finish(self) -> bytes:
        """The encoder's last bytes (its delayed frames, the container's trailer)."""
        if self._container is None:
            return b"" if self._started else self.feed(b"")  # an empty WAV: its header
        self._encode(None)
        self._container.close()
        self._container = None
        return self._sink.take()

    def _encode(self, frame: av.AudioFrame | None) -> None:
        assert self._container is not None and self._stream is not None
        try:
            for packet in self._stream.encode(frame):
                self._container.mux(packet)
        except av.FFmpegError as exc:
            raise AudioError(f"encoding {self.fmt} failed ({exc})") from None
