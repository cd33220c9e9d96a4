"""Audio files whose container lies about their length: the real samples are many times what
the packet timestamps claim (issue 13). Built on the spot with PyAV, by remuxing real packets,
or (variable-block FLAC) written by hand."""

from __future__ import annotations

import io
import struct
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


def variable_flac(small: int, large: int, rate: int = 16000) -> bytes:
    """A FLAC stream of silence whose first `small` frames hold 16 samples each and the next
    `large` 65,535 (FLAC's variable block size: a frame may hold any number), every frame
    numbered as starting at sample 0: timestamps and the first packets both understate it.
    Written by hand (constant subframes), as no encoder here writes variable blocks."""
    blocks = [16] * small + [65_535] * large
    # STREAMINFO: block sizes, frame sizes unknown, rate, mono, 16 bits, total unknown, no MD5
    packed = (rate << 44) | (15 << 36)
    info = struct.pack(">HH", min(blocks), max(blocks)) + bytes(6) + packed.to_bytes(8, "big")
    info += bytes(16)
    out = b"fLaC" + bytes([0x80]) + len(info).to_bytes(3, "big") + info
    for size in blocks:
        # sync + variable blocking, block size in 16 bits after the header, rate from
        # STREAMINFO, mono, 16 bits, sample number 0 (UTF-8 coded)
        header = bytes([0xFF, 0xF9, 0x70, 0x08, 0x00]) + struct.pack(">H", size - 1)
        frame = header + bytes([_crc(header, 8, 0x07)]) + bytes([0x00]) + struct.pack(">h", 0)
        out += frame + struct.pack(">H", _crc(frame, 16, 0x8005))
    return out


def _crc(data: bytes, width: int, polynomial: int) -> int:
    """FLAC's CRC-8 (frame headers) and CRC-16 (frames): MSB first, no reflection, init 0."""
    top, mask, crc = 1 << (width - 1), (1 << width) - 1, 0
    for byte in data:
        crc ^= byte << (width - 8)
        for _ in range(8):
            crc = ((crc << 1) ^ polynomial) & mask if crc & top else (crc << 1) & mask
    return crc
