"""Audio files whose container lies about their length: the real samples are many times what
the packet timestamps claim (issue 13). Built on the spot with PyAV, by remuxing real packets."""

from __future__ import annotations

import io
from fractions import Fraction
from pathlib import Path

import av
import numpy as np


def silence_opus(seconds: float, rate: int = 16000) -> bytes:
    """`seconds` of digital silence as Opus (60 ms frames) in Ogg."""
    buffer = io.BytesIO()
    frame_samples = rate * 60 // 1000
    with av.open(buffer, "w", format="ogg") as out:
        stream = out.add_stream("libopus", rate=rate, layout="mono")
        stream.bit_rate = 6000
        stream.codec_context.options = {"frame_duration": "60"}
        zeros = np.zeros((1, frame_samples), dtype=np.float32)
        for index in range(int(seconds * rate / frame_samples)):
            frame = av.AudioFrame.from_ndarray(zeros, format="flt", layout="mono")
            frame.sample_rate = rate
            frame.pts = index * frame_samples
            out.mux(stream.encode(frame))
        out.mux(stream.encode(None))
    return buffer.getvalue()


def lying_matroska(source: bytes | Path, loops: int, claimed_seconds: float) -> bytes:
    """The audio packets of `source`, `loops` times over, in Matroska with timestamps squeezed
    so the container claims `claimed_seconds`: every packet still decodes to its full length."""
    with av.open(io.BytesIO(source) if isinstance(source, bytes) else str(source)) as src:
        template = src.streams.audio[0]
        packets = [bytes(packet) for packet in src.demux(template) if packet.size]
        buffer = io.BytesIO()
        with av.open(buffer, "w", format="matroska") as out:
            stream = out.add_stream_from_template(template)
            total = len(packets) * loops
            for index in range(total):
                packet = av.Packet(packets[index % len(packets)])
                packet.stream = stream
                packet.time_base = stream.time_base
                packet.pts = packet.dts = int(index * claimed_seconds / total / stream.time_base)
                out.mux(packet)
    return buffer.getvalue()


def decoded_seconds(data: bytes) -> float:
    """What the file really holds: every decoded sample counted, none kept."""
    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.audio[0]
        samples = sum(frame.samples for frame in container.decode(stream))
        return samples / stream.codec_context.sample_rate


def growing_pcm(small: int, large: int, rate: int = 16000) -> bytes:
    """PCM in Matroska whose first packets hold 16 samples each and the rest 80,000, with
    timestamps 1 ms apart: packets of PCM may be any size, so the first few tell nothing."""
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="matroska") as out:
        stream = out.add_stream("pcm_s16le", rate=rate, layout="mono")
        for index, size in enumerate([16] * small + [80_000] * large):
            tone = (np.sin(np.arange(size) * 0.05) * 3000).astype(np.int16)[None, :]
            packet = av.Packet(tone.tobytes())
            packet.stream = stream
            packet.time_base = Fraction(1, 1000)
            packet.pts = packet.dts = index
            out.mux(packet)
    return buffer.getvalue()
