"""Audio decoding: anything FFmpeg (through PyAV) reads -> mono float32 at a chosen rate.

Unlike `faster_whisper.decode_audio` this never calls `gc.collect()`: in a process
holding many objects that single call costs more than the decode itself.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

import av
import numpy as np

SourceType = bytes | str | Path


class AudioError(ValueError):
    """The input is not audio we can decode (empty, garbage, no audio stream)."""


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
    elif Path(source).stat().st_size == 0:
        raise AudioError("the audio file is empty")
    try:
        container = av.open(source, mode="r", metadata_errors="ignore")
    except (av.FFmpegError, UnicodeDecodeError, ValueError) as exc:
        raise AudioError(f"not a readable audio file ({_reason(exc)})") from None
    if not container.streams.audio:
        container.close()
        raise AudioError("the file has no audio stream")
    return container


def _reason(exc: Exception) -> str:
    return str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__


def probe_audio(source: SourceType) -> AudioInfo:
    """Check that `source` decodes and measure its duration, demuxing without a full decode."""
    container = _open(source)
    try:
        stream = container.streams.audio[0]
        decoded_any = False
        last_end = 0.0
        for packet in container.demux(stream):
            if packet.pts is not None and packet.time_base is not None:
                end = float((packet.pts + (packet.duration or 0)) * packet.time_base)
                last_end = max(last_end, end)
            if not decoded_any and packet.size:
                decoded_any = bool(packet.decode())
        if not decoded_any:
            raise AudioError("the file holds no decodable audio")
        start = float(stream.start_time * stream.time_base) if stream.start_time else 0.0
        duration = max(0.0, last_end - start)
        if duration <= 0 and container.duration:
            duration = container.duration / av.time_base
        return AudioInfo(duration, stream.rate or 0, stream.channels or 0,
                         stream.codec_context.name)
    except av.FFmpegError as exc:
        raise AudioError(f"not a readable audio file ({_reason(exc)})") from None
    finally:
        container.close()


def decode_audio(source: SourceType, sample_rate: int = 16000) -> np.ndarray:
    """Decode to a 1-D float32 array, mixed to mono and resampled to `sample_rate`."""
    container = _open(source)
    resampler = av.AudioResampler(format="flt", layout="mono", rate=sample_rate)
    chunks: list[np.ndarray] = []
    try:
        for frame in container.decode(audio=0):
            for out in resampler.resample(frame):
                chunks.append(out.to_ndarray().reshape(-1))
        for out in resampler.resample(None):
            chunks.append(out.to_ndarray().reshape(-1))
    except av.FFmpegError as exc:
        raise AudioError(f"audio decoding failed ({_reason(exc)})") from None
    finally:
        container.close()
    if not chunks:
        raise AudioError("the file holds no decodable audio")
    audio = np.concatenate(chunks).astype(np.float32, copy=False)
    if audio.size == 0:
        raise AudioError("the file holds no audio samples")
    return audio


def encode_wav(audio: np.ndarray, sample_rate: int) -> bytes:
    """16-bit PCM WAV of a mono float array in [-1, 1]."""
    import wave

    pcm = (np.clip(audio, -1.0, 1.0) * 32767.0).astype("<i2").tobytes()
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as wav:
        wav.setnchannels(1)
        wav.setsampwidth(2)
        wav.setframerate(sample_rate)
        wav.writeframes(pcm)
    return buffer.getvalue()


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
