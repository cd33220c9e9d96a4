"""Audio decoding: anything FFmpeg (through PyAV) reads -> mono float32 at a chosen rate.

Unlike `faster_whisper.decode_audio` this never calls `gc.collect()`: in a process
holding many objects that single call costs more than the decode itself.
"""

from __future__ import annotations

import contextlib
import io
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import av
import numpy as np

SourceType = bytes | str | Path | BinaryIO

#: decoded audio may run this far past `max_seconds` (codec padding, resampler delay) before
#: it counts as too long
LIMIT_MARGIN_SECONDS = 1.0
#: packets the probe tries to decode before it calls a file undecodable: a probe stays cheap
#: whatever the file holds
PROBE_DECODE_PACKETS = 32
#: the most samples one packet of a codec decodes to (its frame size bounds it): with the
#: packet count, a ceiling the timestamps cannot raise (a file whose timestamps claim hours
#: and whose packets hold a second was charged, and counted in every backlog, as hours)
MOST_SAMPLES_PER_PACKET = {"opus": 5760, "mp3": 1152, "mp2": 1152, "mp3float": 1152,
                           "aac": 2048, "vorbis": 8192, "flac": 65535}
#: … for any other codec (Monkey's Audio's largest frame, 294,912, TTA's at 192 kHz and
#: WavPack's large blocks below it): it only has to beat claims of hours
ANY_CODEC_MOST_SAMPLES = 1 << 19
#: bytes FFmpeg reads to identify a file before it is opened: its default, 5 MB, costs
#: ~30 ms of CPU a MiB on a PCM WAV (the WAV demuxer scans all of it for S/PDIF-wrapped
#: AC-3/DTS), on every open (the gateway's probe, then the worker's decode); a file these
#: bytes do not identify is opened again with the default
PROBE_BYTES = 1 << 16
#: what av.open raises for a file it cannot read
_OPEN_ERRORS = (av.FFmpegError, UnicodeDecodeError, ValueError)


class AudioError(ValueError):
    """The input is not audio we can decode (empty, garbage, no audio stream)."""


class AudioTooLong(AudioError):
    """More samples decoded than the limit allows, whatever the container's timestamps claim."""


@dataclass(frozen=True, slots=True)
class AudioInfo:
    duration: float
    sample_rate: int
    channels: int
    codec: str


def _open(source: SourceType) -> av.container.InputContainer:
    if isinstance(source, bytes | bytearray):
        if not source:
            raise AudioError("the audio file is empty")
        source = io.BytesIO(source)
    elif isinstance(source, str | Path):
        if Path(source).stat().st_size == 0:
            raise AudioError("the audio file is empty")
    elif os.fstat(source.fileno()).st_size == 0:
        raise AudioError("the audio file is empty")
    start = None if isinstance(source, str | Path) else source.tell()
    with contextlib.suppress(*_OPEN_ERRORS):
        container = av.open(source, mode="r", metadata_errors="ignore",
                            options={"probesize": str(PROBE_BYTES)})
        if _identified(container):
            return container
        container.close()
    if start is not None:
        source.seek(start)  # type: ignore[union-attr]
    try:  # what the first PROBE_BYTES do not identify: with FFmpeg's default (5 MB)
        container = av.open(source, mode="r", metadata_errors="ignore")
    except _OPEN_ERRORS as exc:
        raise AudioError(f"not a readable audio file ({_reason(exc)})") from None
    if not container.streams.audio:
        container.close()
        raise AudioError("the file has no audio stream")
    if container.streams.audio[0].codec_context is None:  # a codec FFmpeg has no decoder for
        container.close()
        raise AudioError("the audio stream's codec is not supported")
    return container


def _identified(container: av.container.InputContainer) -> bool:
    """An audio stream whose rate and channels are known: what decoding needs."""
    streams = container.streams.audio
    return (bool(streams) and streams[0].codec_context is not None
            and bool(streams[0].codec_context.sample_rate) and bool(streams[0].channels))


def _reason(exc: Exception) -> str:
    # FFmpeg's own words ("Invalid data found when processing input"), not its error number
    # and the name of a file the caller never had ("[Errno 1094995529] …: '<none>'")
    text = getattr(exc, "strerror", None) or str(exc)
    return text.splitlines()[0][:200] if text else type(exc).__name__


def probe_audio(source: SourceType) -> AudioInfo:
    """Check that `source` decodes and measure its duration, demuxing without a full decode.

    The duration comes from packet timestamps, which a crafted file can fake, between a floor
    and a ceiling the timestamps cannot move: the number of packets times the fewest samples
    a decoded packet held (codecs put a fixed or bounded number of samples in a packet), so a
    container that understates its length is still measured near it, and times the most a
    packet of its codec can hold (MOST_SAMPLES_PER_PACKET), so one that overstates it is
    measured no longer than its packets can play. PCM, whose packets may hold any number of
    samples, is measured by its bytes instead. It is a first filter only:
    `decode_audio(…, max_seconds=…)` counts the samples themselves.
    """
    container = _open(source)
    try:
        stream = container.streams.audio[0]
        decode_tries = packets = payload = 0
        decoded: list[int] = []  # samples of each decoded packet that gave any
        # demuxed packets carry their stream's time base: the end is kept in its ticks, as
        # ints (a Fraction per packet was a quarter of the probe)
        last_end_ticks = 0
        for packet in container.demux(stream):
            if packet.pts is not None:
                last_end_ticks = max(last_end_ticks, packet.pts + (packet.duration or 0))
            if not packet.size:
                continue
            packets += 1
            payload += packet.size
            if decode_tries < PROBE_DECODE_PACKETS and (not decoded or decode_tries < 8):
                decode_tries += 1
                if samples := sum(frame.samples for frame in packet.decode()):
                    decoded.append(samples)
        if not decoded and decode_tries and stream.codec_context.decode(None):
            decoded.append(0)  # frames held back (codec delay): decodable, no floor
        if not decoded:
            raise AudioError("the file holds no decodable audio")
        # the first decoded packet may be short (a codec's priming samples are dropped)
        fewest = min(decoded[1:] or decoded)
        ticks = stream.time_base
        last_end = float(last_end_ticks * ticks) if ticks else 0.0
        start = float(stream.start_time * ticks) if stream.start_time and ticks else 0.0
        duration = max(0.0, last_end - start)
        if duration <= 0 and container.duration:
            duration = container.duration / av.time_base
        rate = stream.codec_context.sample_rate or stream.rate or 0
        # the last packet may be short, and a codec's first ones may hold nothing (delay)
        floor = (packets - 2) * fewest / rate if rate and packets > 2 else 0.0
        context = stream.codec_context
        most = MOST_SAMPLES_PER_PACKET.get(context.name, ANY_CODEC_MOST_SAMPLES)
        ceiling = packets * most / rate if rate else duration
        if context.name.startswith("pcm_") and context.format and context.channels and rate:
            # a decoded sample is at least as wide as a stored one (a floor), and a stored
            # one at least a byte (a ceiling)
            floor = max(floor, payload / (context.format.bytes * context.channels) / rate)
            ceiling = payload / context.channels / rate
        return AudioInfo(max(min(duration, ceiling), floor), stream.rate or 0,
                         stream.channels or 0, stream.codec_context.name)
    except av.FFmpegError as exc:
        raise AudioError(f"not a readable audio file ({_reason(exc)})") from None
    finally:
        container.close()


def decode_audio(source: SourceType, sample_rate: int = 16000,
                 max_seconds: float | None = None,
                 first_seconds: float | None = None) -> np.ndarray:
    """Decode to a 1-D float32 array, mixed to mono and resampled to `sample_rate`.

    With `max_seconds`, decoding stops with AudioTooLong as soon as the samples decoded so
    far (not the container's timestamps) pass it by more than LIMIT_MARGIN_SECONDS. With
    `first_seconds` instead, it stops once it has that much and returns it (a reference
    clip, of which an engine reads the start: the rest is never decoded).
    """
    if first_seconds is not None:
        limit: int | None = max(1, int(first_seconds * sample_rate))
    else:
        limit = (None if max_seconds is None
                 else max(0, int((max_seconds + LIMIT_MARGIN_SECONDS) * sample_rate)))
    container = _open(source)
    resampler = av.AudioResampler(format="flt", layout="mono", rate=sample_rate)
    samples = _Samples(limit)
    try:
        for frame in container.decode(audio=0):
            for out in resampler.resample(frame):
                samples.append(out.to_ndarray().reshape(-1))
        for out in resampler.resample(None):
            samples.append(out.to_ndarray().reshape(-1))
    except _OverLimit:
        if first_seconds is not None:
            return samples.take()  # full: the start was asked for
        samples.release()
        raise AudioTooLong(f"the audio is longer than the limit of {max_seconds:.0f} s "
                           f"(decoding stopped after {limit / sample_rate:.0f} s)") from None
    except av.FFmpegError as exc:
        raise AudioError(f"audio decoding failed ({_reason(exc)})") from None
    finally:
        container.close()
    if samples.size == 0:
        raise AudioError("the file holds no decodable audio")
    return samples.take()


class _OverLimit(Exception):
    pass


class _Samples:
    """A float32 buffer decoded frames are copied into.

    With a limit it is one array sized to the limit, trimmed in place at the end. That peaks
    at the audio's own size: `np.empty` of that size is an anonymous mapping whose pages are
    committed only when samples land in them, so resident memory follows what was decoded,
    and the trim (`ndarray.resize`, a realloc: mremap for a mapping this large) copies
    nothing. A list of chunks joined at the end would hold every sample twice while joining.
    Without a limit it starts small and grows the same way (realloc, doubling).
    """

    def __init__(self, limit: int | None) -> None:
        self.limit = limit
        self.data = np.empty(limit if limit is not None else 1 << 20, dtype=np.float32)
        self.size = 0

    def append(self, chunk: np.ndarray) -> None:
        end = self.size + chunk.size
        if end > self.data.size:
            if self.limit is not None:  # filled to the limit, the rest left out
                self.data[self.size:] = chunk[:self.data.size - self.size]
                self.size = self.data.size
                raise _OverLimit
            self.data.resize(max(end, 2 * self.data.size), refcheck=False)
        self.data[self.size:end] = chunk
        self.size = end

    def take(self) -> np.ndarray:
        self.data.resize(self.size, refcheck=False)
        return self.data

    def release(self) -> None:
        self.data = np.empty(0, dtype=np.float32)


def pcm16(audio: np.ndarray) -> bytes:
    """16-bit little-endian PCM of a mono float array in [-1, 1]."""
    return (np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()


def wav_from_pcm(pcm: bytes, sample_rate: int) -> bytes:
    """A mono 16-bit WAV holding exactly `pcm`."""
    import wave

    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(sample_rate)
        wav.writeframes(pcm)
    return buffer.getvalue()


def encode_wav(audio: np.ndarray, sample_rate: int) -> bytes:
    """16-bit PCM WAV of a mono float array in [-1, 1]."""
    return wav_from_pcm(pcm16(audio), sample_rate)


def wav_pcm(wav: bytes) -> tuple[bytes, int]:
    """(PCM samples, sample rate) of a mono 16-bit WAV such as `wav_from_pcm` writes."""
    import wave

    try:
        with wave.open(io.BytesIO(wav), "rb") as reader:
            if (reader.getnchannels(), reader.getsampwidth()) != (1, 2):
                raise AudioError("not a mono 16-bit WAV")
            return reader.readframes(reader.getnframes()), reader.getframerate()
    except (wave.Error, EOFError) as exc:
        raise AudioError(f"not a readable WAV ({exc})") from None


@dataclass(frozen=True, slots=True)
class OutputFormat:
    container: str
    codec: str
    content_type: str
    bit_rate: int = 0  # 0 = the encoder's default (lossless codecs)


#: what `/v1/audio/speech` can answer with: container, encoder and content type per format
OUTPUT_FORMATS: dict[str, OutputFormat] = {
    "mp3": OutputFormat("mp3", "libmp3lame", "audio/mpeg", 64_000),
    "opus": OutputFormat("ogg", "libopus", "audio/ogg; codecs=opus", 32_000),
    "aac": OutputFormat("adts", "aac", "audio/aac", 64_000),
    "flac": OutputFormat("flac", "flac", "audio/flac"),
    "wav": OutputFormat("wav", "pcm_s16le", "audio/wav"),
    "pcm": OutputFormat("s16le", "pcm_s16le", "audio/pcm"),  # + "; rate=N": it has no header
}


def transcode(wav: bytes, fmt: str) -> tuple[bytes, str]:
    """Re-encode a mono WAV as `fmt` (a key of OUTPUT_FORMATS): (bytes, content type).

    The sample rate is kept where the encoder supports it (XTTS's 24 kHz is valid for every
    format here), else the nearest higher one it does; `pcm` is headerless 16-bit
    little-endian mono at the WAV's rate, `opus` is Ogg Opus, `aac` is ADTS.
    """
    spec = OUTPUT_FORMATS[fmt]
    if fmt == "wav":
        return wav, spec.content_type
    source = _open(wav)
    buffer = io.BytesIO()
    try:
        rate = source.streams.audio[0].rate or 24000
        rates = av.codec.Codec(spec.codec, "w").audio_rates
        if rates and rate not in rates:
            rate = min((r for r in rates if r >= rate), default=max(rates))
        with av.open(buffer, mode="w", format=spec.container) as sink:
            stream = sink.add_stream(spec.codec, rate=rate, layout="mono")
            if spec.bit_rate:
                stream.bit_rate = spec.bit_rate
            # The encoder converts sample format, rate and frame size itself (PyAV resamples
            # in `encode`), so decoded frames go in as they are.
            for frame in source.decode(audio=0):
                frame.pts = None
                sink.mux(stream.encode(frame))
            sink.mux(stream.encode(None))
    except av.FFmpegError as exc:
        raise AudioError(f"encoding {fmt} failed ({_reason(exc)})") from None
    finally:
        source.close()
    content_type = f"{spec.content_type}; rate={rate}" if fmt == "pcm" else spec.content_type
    return buffer.getvalue(), content_type
