"""Text to speech end to end: real redis-server, gateways and an XTTS worker (.venvs/xtts) on
the tiny random checkpoint. Sage submit + poll + signed audio URL, `/v1/audio/speech` through
the official `openai` SDK, refusals that queue nothing, idle unload and the load-failure exit.

Each synthesis speaks one short sentence (the tiny model's GPT is capped at 24 audio tokens:
about 0.7 s of CPU each); the worker-killing load failure runs last.
"""

from __future__ import annotations

import json
import re
import time
import wave
from collections.abc import Iterator
from io import BytesIO
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from common import keys
from common.audio import OUTPUT_FORMATS, decode_audio, encode_wav, probe_audio
from gateway.auth import digest
from harness import procs
from harness.http_client import http
from harness.procs import TEST_AUDIO, wait_until
from tests.helpers import queue_counts, status, wait_done

# The tiny checkpoint fixture (skips without .venvs/xtts; builds models/tiny/xtts if missing).
from tests.test_engine_xtts import XTTS_PYTHON, tiny_model  # noqa: F401

SENTENCE = "Hello there."
CLIP = TEST_AUDIO / "hotwords.mp3"  # 4 s: a short reference keeps cloning cheap
RATE = 24000
MAX_CHARACTERS = 200
MAX_OUTPUT_SECONDS = 6  # a sentence at speed 1 is ~1.1 s, at the slowest (0.25) ~4.4 s
KEY_A, KEY_B = "tts-key-alpha-0123456789", "tts-key-bravo-9876543210"
SYNTH_TIMEOUT = 180


@pytest.fixture(scope="module")
def tts(request: pytest.FixtureRequest,
        tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    model_dir: Path = request.getfixturevalue("tiny_model")
    workdir = tmp_path_factory.mktemp("tts")
    allowed = workdir / "allowed"
    broken = workdir / "broken-model"  # an empty directory: loading it must fail
    allowed.mkdir()
    broken.mkdir()
    server = procs.RedisServer(workdir / "redis").start()
    models = {"faster-whisper": {"tiny.en": "bundled"},
              "xtts": {"tiny": str(model_dir), "broken": str(broken)}}
    voices = {"alloy": "speaker:Claribel Dervla", "nova": "speaker:Ana Florence",
              "clip": f"file:{CLIP}", "ghost": f"file:{allowed / 'missing.wav'}"}
    settings = {"models": models, "default_models": {"xtts": "tiny"}, "voices": voices,
                "allowed_roots": [str(TEST_AUDIO), str(allowed)],
                "tts_max_characters": str(MAX_CHARACTERS)}
    services = [
        procs.gateway(server.url, workdir, **settings),
        procs.gateway(server.url, workdir, api_keys=[digest(KEY_A), digest(KEY_B)],
                      request_timeout_seconds="0.2", **settings),
        procs.worker(server.url, workdir, backend="xtts", python=XTTS_PYTHON, models=models,
                     device="cpu", idle_unload_seconds="3",
                     allowed_roots=settings["allowed_roots"],
                     tts_max_output_seconds=str(MAX_OUTPUT_SECONDS),
                     # (read by its direct /synthesize only: queued tasks were checked by
                     # the gateway that took them)
                     require_voice_consent="true"),
    ]
    try:
        for service in services:
            service.start()
        plain, keyed, xtts_worker = services
        yield {"url": plain.url, "keyed": keyed.url, "worker": xtts_worker,
               "redis": server.client(), "allowed": allowed, "workdir": workdir}
    finally:
        for service in reversed(services):
            service.stop()
        server.stop()


def submit(base: str, headers: dict[str, str] | None = None,
           files: dict[str, Any] | None = None, **params: Any) -> httpx.Response:
    return http.post(f"{base}/api/xtts-submit", data={k: str(v) for k, v in params.items()},
                      files=files, headers=headers, timeout=60)


def wav_seconds(data: bytes) -> float:
    with wave.open(BytesIO(data), "rb") as wav:
        assert (wav.getnchannels(), wav.getsampwidth(), wav.getframerate()) == (1, 2, RATE)
        return wav.getnframes() / RATE


def check_audio_url(reply: dict[str, Any], base: str) -> float:
    """The SUCCEEDED reply's output_url serves a WAV as long as `usage` says; its seconds."""
    assert reply["status"] == "SUCCEEDED", reply
    usage = reply["usage"]
    assert usage["characters"] == len(SENTENCE) and usage["audio_seconds"] > 0, usage
    assert reply["result"]["format"] == "wav" and reply["result"]["backend"] == "xtts"
    assert reply["output_url"].startswith(f"{base}/v1/tasks/{reply['task_id']}/audio?token=")
    audio = http.get(reply["output_url"], timeout=30)
    assert audio.status_code == 200 and audio.headers["content-type"] == "audio/wav"
    seconds = len(decode_audio(audio.content, RATE)) / RATE
    assert seconds == pytest.approx(usage["audio_seconds"], abs=0.05)
    assert wav_seconds(audio.content) == pytest.approx(seconds, abs=0.01)
    return seconds


def loaded_models(service: procs.Service) -> list[str]:
    return http.get(service.health_url, timeout=5).json()["loaded_models"]


def test_voice_task_succeeds_its_audio_url_is_signed_and_the_worker_unloads_when_idle(
        tts: dict[str, Any]) -> None:
    reply = submit(tts["url"], text=SENTENCE, language="en", voice="alloy")
    assert reply.status_code == 200, reply.text
    task_id = reply.json()["taskid"]
    final = wait_done(tts["url"], task_id, timeout=SYNTH_TIMEOUT)
    # (it may already have unloaded again: idle_unload_seconds is 3; its last use proves it ran)
    health = http.get(tts["worker"].health_url, timeout=5).json()
    assert health["last_used"] is not None and health["tasks_done"] >= 1, health
    check_audio_url(final, tts["url"])
    assert final["result"]["model"] == "tiny" and final["result"]["sample_rate"] == RATE

    audio_url = f"{tts['url']}/v1/tasks/{task_id}/audio"
    for params in ({}, {"token": "0" * 32}, {"token": final["output_url"][-31:]},
                   {"token": "\u00e9"}):
        assert http.get(audio_url, params=params, timeout=10).status_code == 404, params
    token = final["output_url"].split("token=")[1]
    other = f"{tts['url']}/v1/tasks/not-a-task/audio?token={token}"
    assert http.get(other, timeout=10).status_code == 404
    # every poll hands out the same URL
    assert status(tts["url"], task_id)["output_url"] == final["output_url"]

    # idle_unload_seconds=3: the model goes a few seconds after the task
    wait_until(lambda: loaded_models(tts["worker"]) == [], 20, "idle unload", 0.2)


def test_reference_clip_as_an_allowed_path(tts: dict[str, Any]) -> None:
    reply = submit(tts["url"], text=SENTENCE, speaker_wav=str(CLIP))
    assert reply.status_code == 200, reply.text
    check_audio_url(wait_done(tts["url"], reply.json()["taskid"], SYNTH_TIMEOUT), tts["url"])


def test_sage_templates_speak_a_task_and_render_its_audio(tts: dict[str, Any]) -> None:
    """Through deploy/sage's TTS templates, as Sage calls the service: a body without
    `text` is valid JSON the gateway refuses (400), a voice, a reference clip and a model
    are passed, and the SUCCEEDED poll renders with its `output_url` and usage."""
    from tests.test_sage_templates import render

    bare = http.post(f"{tts['url']}/api/xtts-submit", timeout=30,
                     json=render("tts_submit_request.json.j2", {}))
    assert bare.status_code == 400 and "text" in bare.json()["error"], bare.text
    for context in ({"text": SENTENCE, "voice": "alloy", "model": "tiny"},
                    {"text": SENTENCE, "speaker_wav": str(CLIP), "speed": 1.1}):
        body = render("tts_submit_request.json.j2", context)
        reply = http.post(f"{tts['url']}/api/xtts-submit", json=body, timeout=30)
        assert reply.status_code == 200, (context, reply.text)
        wait_done(tts["url"], reply.json()["taskid"], SYNTH_TIMEOUT)
        shown = render("tts_status_response.json.j2", status(tts["url"], reply.json()["taskid"]))
        assert shown["status"] == "SUCCEEDED" and shown["error"] is None, shown
        assert shown["audio_seconds"] > 0 and shown["usage"]["characters"] == len(SENTENCE)
        assert http.get(shown["output_url"], timeout=30).content[:4] == b"RIFF"


def test_uploaded_reference_clip_and_key_owned_audio(tts: dict[str, Any]) -> None:
    base, owner = tts["keyed"], {"authorization": f"Bearer {KEY_A}"}
    reply = submit(base, headers=owner, files={"speaker_wav": ("ref.mp3", CLIP.read_bytes())},
                   text=SENTENCE, language="EN")
    assert reply.status_code == 200, reply.text
    task_id = reply.json()["taskid"]
    deadline = time.monotonic() + SYNTH_TIMEOUT
    while (final := http.get(f"{base}/api/status", params={"taskid": task_id}, headers=owner,
                              timeout=10).json())["status"] not in ("SUCCEEDED", "FAILED"):
        assert time.monotonic() < deadline, final
        time.sleep(0.1)
    check_audio_url(final, base)  # the signed URL needs no key
    unsigned = f"{base}/v1/tasks/{task_id}/audio"
    assert http.get(unsigned, headers=owner, timeout=10).status_code == 200
    other = {"authorization": f"Bearer {KEY_B}"}
    assert http.get(unsigned, headers=other, timeout=10).status_code == 404
    assert http.get(unsigned, timeout=10).status_code == 401  # no credential at all
    # the key-less gateway derives another signing key, and has no owner to match
    assert http.get(f"{tts['url']}/v1/tasks/{task_id}/audio?{final['output_url'].split('?')[1]}",
                     timeout=10).status_code == 404


def test_speech_past_the_wait_is_504_and_its_audio_url_still_serves(
        tts: dict[str, Any]) -> None:
    base, owner = tts["keyed"], {"authorization": f"Bearer {KEY_A}"}
    reply = http.post(f"{base}/v1/audio/speech", headers=owner, timeout=30,
                       json={"model": "tts-1", "input": SENTENCE, "voice": "nova"})
    assert reply.status_code == 504 and reply.json()["error"]["code"] == "task_timeout"
    task_id, audio_url = reply.headers["x-task-id"], reply.headers["x-output-url"]
    assert audio_url.startswith(f"{base}/v1/tasks/{task_id}/audio?token=")
    wait_until(lambda: http.get(f"{base}/v1/tasks/{task_id}", headers=owner, timeout=10)
               .json()["status"] == "SUCCEEDED", SYNTH_TIMEOUT, "the timed-out task", 0.1)
    audio = http.get(audio_url, timeout=10)
    assert audio.status_code == 200 and wav_seconds(audio.content) > 0


def test_openai_speech_in_every_format(tts: dict[str, Any]) -> None:
    client = openai.OpenAI(base_url=f"{tts['url']}/v1", api_key="unused", max_retries=0,
                           timeout=SYNTH_TIMEOUT)
    # a configured `file:` voice: seeded sampling gives the same audio on every call
    raw = client.audio.speech.with_raw_response.create(
        model="tts-1", voice="clip", input=SENTENCE, response_format="wav")
    assert raw.headers["content-type"] == "audio/wav" and raw.headers["x-task-id"]
    seconds = wav_seconds(raw.content)
    assert seconds > 0
    for fmt in ("mp3", "opus", "aac", "flac", "pcm"):
        reply = client.audio.speech.create(model="xtts/tiny", voice="clip", input=SENTENCE,
                                           response_format=fmt)
        data, content_type = reply.content, reply.response.headers["content-type"]
        if fmt == "pcm":
            assert content_type == f"audio/pcm; rate={RATE}"
            assert len(data) % 2 == 0 and len(data) == pytest.approx(seconds * RATE * 2, abs=4)
            continue
        assert content_type == OUTPUT_FORMATS[fmt].content_type, fmt
        assert probe_audio(data).channels == 1
        assert len(decode_audio(data, RATE)) / RATE == pytest.approx(seconds, abs=0.1), fmt
    # default format mp3; a built-in speaker; speed reaches the engine
    slow = client.audio.speech.create(model="tts-1-hd", voice="nova", input=SENTENCE)
    fast = client.audio.speech.create(model="tts-1-hd", voice="nova", input=SENTENCE, speed=2.0)
    assert slow.response.headers["content-type"] == "audio/mpeg"
    assert 0 < len(decode_audio(fast.content, RATE)) < len(decode_audio(slow.content, RATE))


def test_bad_requests_are_clear_4xx_and_queue_nothing(tts: dict[str, Any]) -> None:
    redis, base, allowed = tts["redis"], tts["url"], tts["allowed"]
    (allowed / "garbage.wav").write_bytes(b"RIFF not really a wav file" * 40)
    outside = tts["workdir"] / "outside.mp3"
    outside.write_bytes(CLIP.read_bytes())
    short = encode_wav(np.zeros(RATE // 5, dtype=np.float32), RATE)  # 0.2 s
    garbage = ("ref.wav", b"\x00\x01garbage" * 100)
    before = queue_counts(redis, "xtts")
    cases: list[tuple[dict[str, Any], dict[str, Any] | None, str]] = [
        ({"text": "   ", "voice": "alloy"}, None, "'text' is empty"),
        ({"voice": "alloy"}, None, "'text' is empty"),
        ({"text": "a" * (MAX_CHARACTERS + 1)}, None, f"the limit is {MAX_CHARACTERS}"),
        ({"text": SENTENCE, "language": "klingon"}, None, "use one of en, es"),
        ({"text": SENTENCE, "voice": "nobody"}, None, "configured voices: alloy, nova, clip"),
        ({"text": SENTENCE, "speaker_wav": "missing.wav"}, None, "no such file"),
        ({"text": SENTENCE, "voice": "ghost"}, None, "reference clip of voice 'ghost'"),
        ({"text": SENTENCE, "speaker_wav": str(outside)}, None, "outside the allowed roots"),
        ({"text": SENTENCE, "speaker_wav": "garbage.wav"}, None, "reference clip"),
        ({"text": SENTENCE}, {"speaker_wav": garbage}, "reference clip (speaker_wav)"),
        ({"text": SENTENCE}, {"speaker_wav": ("s.wav", short)}, "needs at least 0.5 s"),
        ({"text": SENTENCE}, {"speaker_wav": ("e.wav", b"")}, "the 'speaker_wav' upload is empty"),
        ({"text": SENTENCE, "speed": "9"}, None, "speed must be"),
        ({"text": SENTENCE, "voice": "alloy", "speaker_wav": str(CLIP)}, None, "not both"),
    ]
    for params, files, expected in cases:
        reply = submit(base, files=files, **params)
        assert reply.status_code == 400, (params, reply.text)
        body = reply.json()
        assert body["status"] == "FAILED" and expected in body["error"], (params, body)

    speech = f"{base}/v1/audio/speech"
    openai_cases = [
        ({"model": "tts-1", "input": "", "voice": "alloy"}, 400, "input"),
        ({"model": "tts-1", "input": SENTENCE, "voice": "nobody"}, 400, "voice"),
        ({"model": "tts-1", "input": SENTENCE, "response_format": "ogg"}, 400, "response_format"),
        ({"model": "tts-9", "input": SENTENCE}, 404, "model"),
        ({"model": "whisper-1", "input": SENTENCE}, 404, "model"),
    ]
    for body, code, param in openai_cases:
        reply = http.post(speech, json=body, timeout=30)
        assert reply.status_code == code, (body, reply.text)
        assert reply.json()["error"]["param"] == param, reply.text
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError, match="unknown voice"):
        client.audio.speech.create(model="tts-1", voice="nobody", input=SENTENCE)
    assert queue_counts(redis, "xtts") == before


def test_speech_past_the_output_limit_fails_there_and_stores_none_of_it(
        tts: dict[str, Any]) -> None:
    """SPEECH_TTS_MAX_OUTPUT_SECONDS: six sentences at the slowest speed run past the worker's
    6 s; the task FAILS `audio_too_long` at the sentence that would pass it (stored none of
    it), a whole task charged nothing, and the OpenAI call is its 413."""
    text = "One more. Two more. Three more. Four more. Five more. Six more."
    reply = submit(tts["url"], text=text, voice="alloy", speed="0.25")
    assert reply.status_code == 200, reply.text
    task_id = reply.json()["taskid"]
    final = wait_done(tts["url"], task_id, timeout=SYNTH_TIMEOUT)
    assert final["status"] == "FAILED" and final["code"] == "audio_too_long", final
    assert f"runs past {MAX_OUTPUT_SECONDS} s" in final["error"], final
    # after the first sentence at least (~4.4 s), which stays inside it; a whole task that
    # fails keeps no charge
    assert re.search(r"\(sentence [2-6], at speed 0.25\)", final["error"]), final
    assert json.loads(tts["redis"].hget(keys.task(task_id), "charge"))["amount"] == 0
    assert not tts["redis"].exists(keys.output_blob(task_id))
    speech = http.post(f"{tts['url']}/v1/audio/speech", timeout=SYNTH_TIMEOUT,
                       json={"model": "tts-1", "input": text, "voice": "alloy", "speed": 0.25})
    assert speech.status_code == 413, speech.text
    assert speech.json()["error"]["code"] == "audio_too_long"
    # a sentence at speed 1 is far inside it
    ok = submit(tts["url"], text=SENTENCE, voice="alloy")
    assert wait_done(tts["url"], ok.json()["taskid"], timeout=SYNTH_TIMEOUT)["status"] == (
        "SUCCEEDED")


def test_the_workers_direct_synthesize_keeps_the_gateways_voice_rules(
        tts: dict[str, Any]) -> None:
    """The worker's own /synthesize took any upload to clone, and any built-in speaker by
    its raw name, whatever the gateway allows: it now keeps the same rules."""
    url = f"{tts['worker'].url}/synthesize"
    spoken = http.post(url, data={"text": SENTENCE, "voice": "alloy"}, timeout=SYNTH_TIMEOUT)
    assert spoken.status_code == 200 and spoken.content[:4] == b"RIFF", spoken.text
    raw = http.post(url, data={"text": SENTENCE, "voice": "Claribel Dervla"}, timeout=60)
    assert raw.status_code == 400 and raw.json()["code"] == "unknown_voice", raw.text
    clip = {"speaker_wav": ("ref.mp3", CLIP.read_bytes())}
    cloned = http.post(url, data={"text": SENTENCE}, files=clip, timeout=60)
    assert cloned.status_code == 403 and cloned.json()["code"] == "consent_required"
    both = http.post(url, data={"text": SENTENCE, "voice": "alloy"}, files=clip, timeout=60)
    assert both.status_code == 400 and "not both" in both.json()["error"]


def test_broken_model_fails_its_task_and_the_worker_keeps_serving(tts: dict[str, Any]) -> None:
    """An empty model directory fails the engine's pre-check: nothing was allocated, so the
    task FAILS with the load error and the worker does not exit."""
    reply = submit(tts["url"], text=SENTENCE, voice="alloy", model="broken")
    assert reply.status_code == 200, reply.text
    final = wait_done(tts["url"], reply.json()["taskid"], timeout=SYNTH_TIMEOUT)
    assert final["status"] == "FAILED" and "is not an XTTS model directory" in final["error"]
    worker: procs.Service = tts["worker"]
    assert worker.proc is not None and worker.proc.poll() is None
    ok = submit(tts["url"], text=SENTENCE, voice="alloy")
    assert wait_done(tts["url"], ok.json()["taskid"], SYNTH_TIMEOUT)["status"] == "SUCCEEDED"
