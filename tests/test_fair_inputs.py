"""Clip inputs that work as documented (issue 30, finding 6), on a real redis-server, gateway
and faster-whisper worker with the bundled diarizer: known-speaker references as uploads
(they were refused on every route), and data URLs past Starlette's 1 MB form-field limit (a
10 s 48 kHz stereo WAV)."""

from __future__ import annotations

import base64
import io
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from common.audio import decode_audio
from harness import conversation, procs
from harness.http_client import http
from tests.helpers import wait_task

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("fair-inputs")
    talk = root / "talk.wav"
    turns = conversation.build(talk)
    references = {name: conversation.reference_clip(root / f"{name}.wav", name)
                  for name in conversation.VOICES}
    server = procs.RedisServer(root / "redis").start()
    gateway = procs.gateway(server.url, root).start()
    worker = procs.worker(server.url, root, idle_unload_seconds="-1").start()
    yield {"gateway": gateway.url, "talk": talk, "turns": turns, "references": references,
           "root": root}
    worker.stop()
    gateway.stop()
    server.stop()


def wide_wav(source: Path, out: Path) -> bytes:
    """`source` as a 48 kHz stereo 16-bit WAV padded with its own audio to 10 s (~1.9 MB)."""
    mono = np.resize(decode_audio(source, 48000), 48000 * 10)
    samples = (np.clip(mono, -1, 1) * 32767).astype("<i2")
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as writer:
        writer.setnchannels(2)
        writer.setsampwidth(2)
        writer.setframerate(48000)
        writer.writeframes(np.stack([samples, samples], axis=1).tobytes())
    out.write_bytes(buffer.getvalue())
    return buffer.getvalue()


def test_known_speaker_references_as_uploads(env: dict[str, Any]) -> None:
    names = list(conversation.VOICES)
    handles = [("file", ("talk.wav", env["talk"].read_bytes()))]
    handles += [("known_speaker_references[]", (f"{name}.wav", env["references"][name]
                                                .read_bytes())) for name in names]
    reply = http.post(f"{env['gateway']}/api/faster-whisper-submit", files=handles,
                       data={"diarize": "true", "num_speakers": "2",
                             "known_speaker_names[]": names}, timeout=60)
    assert reply.status_code == 200, reply.text
    task = wait_task(env["gateway"], reply.json()["task_id"], timeout=300)
    assert task["status"] == "SUCCEEDED", task
    assert set(task["result"]["speakers"]) == set(names)
    # an unreadable upload is refused for what it is, not as "not a value"
    garbage = http.post(f"{env['gateway']}/v1/audio/transcriptions", timeout=60,
                         files=[("file", ("talk.wav", env["talk"].read_bytes())),
                                ("known_speaker_references[]", ("x.wav", b"RIFF" * 100))],
                         data={"model": "whisper-1", "diarize": "true",
                               "known_speaker_names[]": ["alice"]})
    assert garbage.status_code == 400, garbage.text
    assert "not a file upload" not in garbage.text and garbage.json()["error"]["param"] in (
        "known_speaker_references[]", "known_speaker_references")


def test_a_data_url_past_one_megabyte_is_taken(env: dict[str, Any]) -> None:
    names = list(conversation.VOICES)
    urls = ["data:audio/wav;base64," + base64.b64encode(
        wide_wav(env["references"][name], env["root"] / f"{name}-wide.wav")).decode()
        for name in names]
    assert all(len(url) > 2 * 1024 * 1024 for url in urls)
    with env["talk"].open("rb") as handle:
        reply = http.post(f"{env['gateway']}/v1/audio/transcriptions", timeout=300,
                           files={"file": ("talk.wav", handle)},
                           data={"model": "whisper-1", "response_format": "diarized_json",
                                 "diarize": "true", "num_speakers": "2",
                                 "known_speaker_names[]": names,
                                 "known_speaker_references[]": urls})
    assert reply.status_code == 200, reply.text[:500]
    assert {segment["speaker"] for segment in reply.json()["segments"]} <= set(names)
