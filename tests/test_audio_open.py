"""How much of a file FFmpeg reads to open it (common.audio.PROBE_BYTES): a WAV is identified
from its first bytes, not scanned whole (FFmpeg's default reads 5 MB of it, ~30 ms of CPU a
MiB, at the gateway's probe and again at the worker's decode), and a file those bytes do not
identify still opens, with FFmpeg's default."""

from __future__ import annotations

import io
import struct
import wave
from pathlib import Path

import numpy as np
import pytest

from common import audio
from common.audio import PROBE_BYTES, decode_audio, probe_audio
from harness.procs import TEST_AUDIO


class CountingFile(io.FileIO):
    """A file that counts the bytes read from it."""

    taken = 0

    def read(self, size: int = -1) -> bytes:
        data = super().read(size)
        self.taken += len(data)
        return data


def bytes_read_to_open(path: Path) -> int:
    with CountingFile(path) as source:
        audio._open(source).close()
        return source.taken


def test_a_wav_is_opened_from_its_first_bytes(tmp_path: Path) -> None:
    path = tmp_path / "long.wav"
    with wave.open(str(path), "wb") as out:  # 20 s, 48 kHz stereo: 3.8 MB
        out.setnchannels(2)
        out.setsampwidth(2)
        out.setframerate(48000)
        noise = np.random.default_rng(1).normal(0, 300, 48000 * 2 * 20).astype(np.int16)
        out.writeframes(noise.tobytes())
    taken = bytes_read_to_open(path)
    assert taken <= 4 * PROBE_BYTES < path.stat().st_size // 10, taken
    info = probe_audio(path)
    assert (info.sample_rate, info.channels) == (48000, 2)
    assert info.duration == pytest.approx(20.0, abs=0.01)
    assert len(decode_audio(path.read_bytes(), 16000)) == pytest.approx(20 * 16000, abs=160)


def test_a_file_its_first_bytes_do_not_identify_still_opens(tmp_path: Path) -> None:
    """An MP3 behind a 300 KB ID3 tag (cover art, say) is read past PROBE_BYTES."""
    bare = (TEST_AUDIO / "hotwords.mp3").read_bytes()
    size = 300_000  # ID3v2's size is 28 bits, 7 a byte
    tag = b"ID3\x03\x00\x00" + bytes((size >> shift) & 0x7F for shift in (21, 14, 7, 0))
    path = tmp_path / "tagged.mp3"
    path.write_bytes(tag + bytes(size) + bare)
    assert bytes_read_to_open(path) > size
    assert probe_audio(path) == probe_audio(bare)
    assert np.array_equal(decode_audio(path.read_bytes()), decode_audio(bare))


def _wav_header(format_tag: int, bits: int) -> bytes:
    """A WAV of one second whose fmt chunk names `format_tag` and `bits` per sample."""
    data = bytes(32000)
    fmt = struct.pack("<HHIIHH", format_tag, 1, 16000, 32000, 2, bits)
    return (b"RIFF" + struct.pack("<I", 20 + len(fmt) + len(data)) + b"WAVE"
            + b"fmt " + struct.pack("<I", len(fmt)) + fmt
            + b"data" + struct.pack("<I", len(data)) + data)


@pytest.mark.parametrize(("format_tag", "bits"), [(99, 16), (1, 0), (0, 16)])
def test_a_stream_no_decoder_reads_is_an_audio_error(tmp_path: Path, format_tag: int,
                                                     bits: int) -> None:
    """FFmpeg opens it but gives the stream no codec: a clear AudioError, not a crash."""
    path = tmp_path / "odd.wav"
    path.write_bytes(_wav_header(format_tag, bits))
    with pytest.raises(audio.AudioError, match="codec is not supported"):
        probe_audio(path)
    with pytest.raises(audio.AudioError, match="codec is not supported"):
        decode_audio(path.read_bytes(), 16000)
