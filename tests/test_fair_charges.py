"""Charged for what was delivered (issue 30, finding 1), on a real redis-server, gateway and
faster-whisper worker (tiny.en, with the bundled diarizer): a task that fails after its
segments reached the client keeps exactly that part of its charge, a known-speaker clip is
decoded and checked before the engine runs (so nothing streams and nothing is charged), and
text XTTS cannot speak is refused at submit, never a 500."""

from __future__ import annotations

import base64
import json
import os
import random
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from common import keys, speech_text
from common.audio import decode_audio, encode_wav
from common.speech_text import unspeakable
from gateway.auth import digest
from harness import conversation, procs
from harness.http_client import http
from harness.procs import TEST_AUDIO, wait_until
from tests.audio_fakes import decoded_seconds, lying_matroska
from tests.helpers import wait_task
from tests.tiny import env_python

pytestmark = pytest.mark.timeout(300)
KEY = "key-fair-charges-secret"
AUTH = {"authorization": f"Bearer {KEY}"}
XTTS_MODEL = procs.ROOT / "models" / "tiny" / "xtts"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("fair-charges")
    server = procs.RedisServer(workdir / "redis").start()
    models = {"faster-whisper": {"tiny.en": "bundled"}, "xtts": {"tiny": str(XTTS_MODEL)}}
    entries = [{"key": "sha256:" + digest(KEY), "name": "payer",
                "quotas": {"audio_seconds_per_day": 10000}}]
    roots = [str(TEST_AUDIO), str(workdir)]
    gateway = procs.gateway(server.url, workdir, api_keys=entries, models=models,
                            allowed_roots=roots).start()
    yield {"redis": server, "client": server.client(), "gateway": gateway.url,
           "workdir": workdir, "roots": roots}
    gateway.stop()
    server.stop()


def used_today(env: dict[str, Any]) -> float:
    reply = http.get(f"{env['gateway']}/v1/usage", headers=AUTH, timeout=30)
    assert reply.status_code == 200, reply.text
    return float(reply.json()["day"]["audio_seconds"]["used"])


def long_clip(workdir: Path, times: int) -> Path:
    """jfk.flac `times` over: several 30 s windows, so segments go out before the end."""
    audio = decode_audio(TEST_AUDIO / "jfk.flac", 16000)
    path = workdir / f"jfk-x{times}.wav"
    path.write_bytes(encode_wav(np.concatenate([audio] * times), 16000))
    return path


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "polled"])
def test_a_task_killed_after_its_segments_went_out_keeps_what_its_client_received(
        env: dict[str, Any], streamed: bool) -> None:
    """Killed after its first segments (past SPEECH_MAX_DELIVERIES): a `stream=true` call's
    client has them, and they stay charged; a polled (Sage) task's client got nothing, and
    the whole charge goes back."""
    clip = long_clip(env["workdir"], 6)  # 66 s
    consumer = f"fair-killed-{streamed}"
    worker = procs.worker(env["redis"].url, env["workdir"], idle_unload_seconds="-1",
                          max_deliveries="1", consumer=consumer,
                          allowed_roots=env["roots"]).start()
    before = used_today(env)
    ends: list[float] = []
    subscribed = threading.Event()

    def watch(task_id_box: dict[str, str]) -> None:
        pubsub = env["client"].pubsub()
        pubsub.psubscribe(keys.events("*"))
        subscribed.set()
        stopped_at: float | None = None
        # after the stop, what was published before it still arrives: read it all
        while stopped_at is None or time.monotonic() - stopped_at < 2.0:
            message = pubsub.get_message(timeout=0.2)
            if message is None or message["type"] != "pmessage":
                continue
            event = json.loads(message["data"])
            if event.get("type") == "segment":
                ends.append(float(event["end"]))
                if stopped_at is None:
                    os.kill(worker.pid, signal.SIGSTOP)  # the rest is never delivered
                    stopped_at = time.monotonic()
                    task_id_box["id"] = message["channel"].decode().rsplit(":", 1)[-1]
        pubsub.close()

    def stream(events: list[str]) -> None:  # the client reads until the stream ends
        with clip.open("rb") as handle, httpx.stream(
                "POST", f"{env['gateway']}/v1/audio/transcriptions", headers=AUTH,
                data={"model": "whisper-1", "stream": "true"},
                files={"file": ("long.wav", handle)}, timeout=120) as reply:
            events.extend(line for line in reply.iter_lines() if line.startswith("data:"))

    box: dict[str, str] = {}
    watcher = threading.Thread(target=watch, args=(box,))
    watcher.start()
    subscribed.wait(10)
    received: list[str] = []
    client = threading.Thread(target=stream, args=(received,))
    try:
        if streamed:
            client.start()
        else:
            with clip.open("rb") as handle:
                reply = http.post(f"{env['gateway']}/api/faster-whisper-submit", headers=AUTH,
                                   files={"file": ("long.wav", handle)}, timeout=60)
            assert reply.status_code == 200, reply.text
        watcher.join(120)
        assert ends, "no segment was published"
        task_id = box["id"]
        assert used_today(env) == pytest.approx(before + 66, abs=0.1)  # charged at submit
        assert env["client"].hget(keys.task(task_id), "state") == b"RUNNING"
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        os.kill(worker.pid, signal.SIGCONT)
        worker.stop()
    # the same consumer comes back, finds its entry past the delivery limit and gives up
    again = procs.worker(env["redis"].url, env["workdir"], idle_unload_seconds="-1",
                         max_deliveries="1", consumer=consumer,
                         allowed_roots=env["roots"]).start()
    try:
        task = wait_task(env["gateway"], task_id, headers=AUTH, timeout=60)
        if streamed:
            client.join(60)
    finally:
        again.stop()
    assert task["status"] == "FAILED", task
    delivered = max(ends)
    assert 0 < delivered < 66
    if streamed:  # the client read the segments, then the error
        assert any('"transcript.text.delta"' in line for line in received), received[:3]
        # usage equals delivered work: the published part stays charged, the rest went back
        assert used_today(env) - before == pytest.approx(delivered, abs=0.01)
    else:
        assert used_today(env) == pytest.approx(before, abs=0.01)


def test_a_lying_known_speaker_clip_fails_before_anything_streams_and_costs_nothing(
        env: dict[str, Any]) -> None:
    root = env["workdir"]
    talk = root / "talk.wav"
    conversation.build(talk)
    reference = conversation.reference_clip(root / "alice.wav", "alice")
    # the container claims 5 s, the packets hold ~33 s (past the 10 s a reference may last)
    loops = max(2, round(33 / decoded_seconds(reference.read_bytes())))
    lying = lying_matroska(reference, loops, 5.0)
    assert decoded_seconds(lying) > 25
    url = "data:audio/x-matroska;base64," + base64.b64encode(lying).decode()
    worker = procs.worker(env["redis"].url, env["workdir"], idle_unload_seconds="-1",
                          allowed_roots=env["roots"]).start()
    try:
        before = used_today(env)
        events: list[dict[str, Any]] = []
        with talk.open("rb") as handle, http.stream(
                "POST", f"{env['gateway']}/v1/audio/transcriptions", headers=AUTH,
                files={"file": ("talk.wav", handle)}, timeout=120,
                data={"model": "whisper-1", "stream": "true", "diarize": "true",
                      "known_speaker_names[]": ["alice"],
                      "known_speaker_references[]": [url]}) as reply:
            body = reply.read().decode()
        if reply.status_code == 200:
            events = [json.loads(line[6:]) for line in body.splitlines()
                      if line.startswith("data: ") and line[6:].strip().startswith("{")]
            assert events and events[-1]["type"] == "error", body
            assert all(event["type"] != "transcript.text.delta" for event in events), body
        else:
            assert 400 <= reply.status_code < 500, body
        wait_until(lambda: used_today(env) == pytest.approx(before, abs=0.01), 30,
                   "the refund")
    finally:
        worker.stop()


@pytest.mark.parametrize("text", [
    "Hello there. The code is " + "9" * 200 + ".",
    "Pay " + ",".join(["999"] * 8) + " dollars.",
    "Numbers " + " ".join(["12345678"] * 12) + " end",
    "1" * 3000,  # one run the length of a whole text
])
def test_text_xtts_cannot_speak_is_refused_at_submit(env: dict[str, Any], text: str) -> None:
    base = env["gateway"]
    openai = http.post(f"{base}/v1/audio/speech", headers=AUTH, timeout=30,
                        json={"model": "tts-1", "input": text, "voice": "alloy"})
    assert openai.status_code == 400, openai.text
    assert openai.json()["error"]["code"] == "unspeakable_text"
    sage = http.post(f"{base}/api/xtts-submit", headers=AUTH, timeout=30,
                      data={"text": text, "voice": "alloy"})
    assert sage.status_code == 400 and sage.json()["status"] == "FAILED", sage.text


def test_text_with_ordinary_numbers_is_taken(env: dict[str, Any]) -> None:
    reply = http.post(f"{env['gateway']}/api/xtts-submit", headers=AUTH, timeout=30,
                       data={"text": "Call 555 0142 on 12 March 2024 at 10:30, or pay "
                                     "$1,250,000.50 by 9 April.", "voice": "alloy"})
    assert reply.status_code == 200 and reply.json()["status"] == "PENDING", reply.text
    task_id = reply.json()["task_id"]
    http.delete(f"{env['gateway']}/v1/tasks/{task_id}", headers=AUTH, timeout=30)


def test_speech_text_fuzz_gives_no_5xx(env: dict[str, Any]) -> None:
    """Random texts with digit runs, separators and sentence ends: each is taken or refused
    with a 400 that says why, never a 5xx, on both dialects; what is refused is exactly what
    the shared rule refuses."""
    rng = random.Random(30)
    pieces = ["1", "12", "999", "0" * 16, "9" * 40, ",", ".", " ", ". ", "! ", "word", "٣",
              "1,000", "3.14", "\u00a0", "e9", "-", "$", "%"]
    base = env["gateway"]
    for _ in range(40):
        text = "".join(rng.choice(pieces) for _ in range(rng.randrange(1, 60))).strip() or "x"
        sage = http.post(f"{base}/api/xtts-submit", headers=AUTH, timeout=30,
                          data={"text": text, "voice": "alloy"})
        assert sage.status_code in (200, 400), (text, sage.text)
        expected = unspeakable(" ".join(text.split()), "en")
        assert (sage.status_code == 400) == (expected is not None), (text, sage.text)
        if sage.status_code == 200:
            http.delete(f"{base}/v1/tasks/{sage.json()['task_id']}", headers=AUTH, timeout=30)
        openai = http.post(f"{base}/v1/audio/speech", headers=AUTH, timeout=5,
                            json={"model": "tts-1", "input": text, "voice": "alloy"}) \
            if expected is not None else None
        if openai is not None:
            assert openai.status_code == 400, (text, openai.text)


def test_the_digit_rule_matches_num2words_in_the_xtts_environment() -> None:
    """The constants of common/speech_text.py against the num2words XTTS runs: every number
    of MAX_NUMBER_DIGITS digits spells out within CHARS_PER_DIGIT a digit, and NO_NUMBERS
    languages spell none."""
    python = env_python("xtts")
    if not python.exists():
        pytest.skip("no .venvs/xtts")
    langs = sorted(set(speech_text.CHAR_LIMITS) - {"zh"})  # XTTS spells Chinese itself
    script = (
        "import json, sys\nfrom num2words import num2words\nout = {}\n"
        f"for lang in {langs!r}:\n"
        "    try:\n"
        f"        out[lang] = max(len(num2words(int('9' * k), lang=lang)) / k "
        f"for k in range(1, {speech_text.MAX_NUMBER_DIGITS + 1}))\n"
        "    except Exception as exc:\n"
        "        out[lang] = type(exc).__name__\n"
        "print(json.dumps(out))\n")
    found = json.loads(subprocess.run([str(python), "-c", script], check=True,
                                      capture_output=True, text=True, timeout=120).stdout)
    for lang, value in found.items():
        if lang in speech_text.NO_NUMBERS:
            assert isinstance(value, str), (lang, value)
        else:
            assert isinstance(value, float) and value <= speech_text.CHARS_PER_DIGIT, (lang, value)
