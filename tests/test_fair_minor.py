"""The minor findings of issue 30, through a real redis-server and gateway (no worker: each is
refused or answered before one would run): a realtime prompt with NUL or bad Unicode, an
idempotency key reused for another kind of call, a deadline in the past, VTT markup in cue
text, the page's CSP, and what /ready shows without a key."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import websockets

from common import keys
from common.formats import vtt
from common.settings import Settings
from gateway.auth import digest
from gateway.realtime.protocol import ProtocolError, Transcription
from gateway.realtime.session import resolve
from harness import procs
from harness.http_client import http
from tests.helpers import JFK

pytestmark = pytest.mark.timeout(120)
KEY = "key-fair-minor-secret"
AUTH = {"authorization": f"Bearer {KEY}"}
XTTS_MODEL = procs.ROOT / "models" / "tiny" / "xtts"
BAD_TEXT = ["a\x00b", "\x00", "\ud800", "x\udfff y"]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("fair-minor")
    server = procs.RedisServer(workdir / "redis").start()
    models = {"faster-whisper": {"tiny.en": "bundled"}, "xtts": {"tiny": str(XTTS_MODEL)}}
    gateway = procs.gateway(server.url, workdir, models=models,
                            api_keys=[{"key": "sha256:" + digest(KEY), "interactive": True}],
                            allowed_roots=[str(procs.TEST_AUDIO)]).start()
    yield {"gateway": gateway.url, "ws": gateway.url.replace("http://", "ws://"),
           "client": server.client()}
    gateway.stop()
    server.stop()


def test_a_realtime_prompt_is_checked_like_a_rest_one() -> None:
    settings = Settings()
    rng = random.Random(30)
    prompts = [*BAD_TEXT, *("".join(chr(rng.randrange(0, 0x11000)) for _ in range(20))
                            for _ in range(200))]
    for prompt in prompts:
        try:
            target = resolve(settings, Transcription(model="whisper-1", prompt=prompt))
        except ProtocolError as refused:
            assert refused.param.endswith("prompt"), (prompt, refused.param)
        else:
            assert "\x00" not in target.options.get("prompt", "")
            target.options.get("prompt", "").encode("utf-8")  # valid text only


def test_a_nul_prompt_on_the_socket_is_an_error_event(env: dict[str, Any]) -> None:
    async def scenario() -> dict[str, Any]:
        async with websockets.connect(f"{env['ws']}/v1/realtime?intent=transcription",
                                      additional_headers=AUTH) as socket:
            assert json.loads(await socket.recv())["type"] == "session.created"
            await socket.send(json.dumps({"type": "session.update", "event_id": "p1",
                                          "session": {"type": "transcription", "audio": {
                                              "input": {"transcription": {
                                                  "model": "whisper-1", "prompt": "a\x00b"}}}}}))
            while True:
                event = json.loads(await asyncio.wait_for(socket.recv(), 10))
                if event["type"] in ("error", "session.updated"):
                    return event

    event = asyncio.run(scenario())
    assert event["type"] == "error", event
    assert event["error"]["param"].endswith("prompt") and event["error"]["event_id"] == "p1"


def test_an_idempotency_key_reused_for_another_kind_is_a_409(env: dict[str, Any]) -> None:
    base, headers = env["gateway"], {**AUTH, "idempotency-key": "fair-minor-1"}
    with JFK.open("rb") as handle:
        first = http.post(f"{base}/api/faster-whisper-submit", headers=headers,
                           files={"file": ("jfk.flac", handle)}, timeout=30)
    assert first.status_code == 200, first.text
    speech = http.post(f"{base}/v1/audio/speech", headers=headers, timeout=30,
                        json={"model": "tts-1", "input": "Hello.", "voice": "alloy"})
    assert speech.status_code == 409, speech.text
    assert speech.json()["error"]["code"] == "idempotency_key_reused"
    sage = http.post(f"{base}/api/xtts-submit", headers=headers, timeout=30,
                      data={"text": "Hello.", "voice": "alloy"})
    assert sage.status_code == 409 and sage.json()["status"] == "FAILED", sage.text
    with JFK.open("rb") as handle:  # the same kind still gets its original task back
        again = http.post(f"{base}/api/faster-whisper-submit", headers=headers,
                           files={"file": ("jfk.flac", handle)}, timeout=30)
    assert again.json()["task_id"] == first.json()["task_id"]
    http.delete(f"{base}/v1/tasks/{first.json()['task_id']}", headers=AUTH, timeout=30)


@pytest.mark.parametrize("field,value", [("deadline", "1000"), ("max_wait_seconds", "-5"),
                                         ("max_wait_seconds", "0")])
def test_a_deadline_in_the_past_is_a_400(env: dict[str, Any], field: str, value: str) -> None:
    with JFK.open("rb") as handle:
        sage = http.post(f"{env['gateway']}/api/faster-whisper-submit", headers=AUTH,
                          files={"file": ("jfk.flac", handle)}, data={field: value}, timeout=30)
    assert sage.status_code == 400 and "past" in sage.json()["error"], sage.text
    assert "retry-after" not in sage.headers
    with JFK.open("rb") as handle:
        openai = http.post(f"{env['gateway']}/v1/audio/transcriptions", headers=AUTH,
                            files={"file": ("jfk.flac", handle)},
                            data={"model": "whisper-1", field: value}, timeout=30)
    assert openai.status_code == 400 and openai.json()["error"]["code"] == "deadline_passed"


def test_a_repeat_after_its_deadline_passed_gets_its_task_and_a_new_key_a_400(
        env: dict[str, Any]) -> None:
    """A client whose reply was lost retries with the same key and the same body: past the
    deadline it set, the repeat still names its task (whatever became of it); the same body
    under a new key is a new submit, refused as past."""
    deadline = str(time.time() + 1.5)

    def submit(key: str) -> httpx.Response:
        with JFK.open("rb") as handle:
            return http.post(f"{env['gateway']}/api/faster-whisper-submit",
                             headers={**AUTH, "Idempotency-Key": key}, timeout=30,
                             files={"file": ("jfk.flac", handle)}, data={"deadline": deadline})

    first = submit("late-retry")
    assert first.status_code == 200, first.text
    time.sleep(max(0.0, float(deadline) - time.time()) + 0.2)
    again = submit("late-retry")
    assert again.status_code == 200 and again.json()["task_id"] == first.json()["task_id"]
    fresh = submit("late-new")
    assert fresh.status_code == 400 and "past" in fresh.json()["error"], fresh.text


def test_vtt_cue_text_is_escaped() -> None:
    body = vtt([{"start": 0.0, "end": 1.0, "text": "I <3 AT&T --> <b>bold</b>",
                 "speaker": "A<&>"}])
    cue = body.splitlines()[-1]
    assert cue == "<v A&lt;&amp;&gt;>I &lt;3 AT&amp;T --&gt; &lt;b&gt;bold&lt;/b&gt;", cue


def test_the_page_sends_a_csp_that_forbids_framing(env: dict[str, Any]) -> None:
    for path in ("/", "/static/app.js"):
        reply = http.get(f"{env['gateway']}{path}", timeout=30)
        assert reply.status_code == 200
        policy = reply.headers["content-security-policy"]
        assert "frame-ancestors 'none'" in policy and "script-src 'self'" in policy
        assert "unsafe-inline" not in policy
        assert reply.headers["x-frame-options"] == "DENY"


def test_ready_shows_holders_and_models_only_with_a_key(env: dict[str, Any]) -> None:
    client = env["client"]
    # a live worker and a device holder, as their own scripts write them
    beat = {"backend": "faster-whisper", "consumer": "w1", "url": "http://10.0.0.9:1",
            "pid": 42, "state": "idle", "loaded_models": ["tiny.en"]}
    client.set(keys.heartbeat("faster-whisper", "w1"), json.dumps(beat), px=60000)
    client.zadd(keys.live("faster-whisper"), {"w1": 10 ** 13})
    client.sadd(keys.devices(), "cuda:0")
    client.hset(keys.device("cuda:0"), mapping={"budget": 1000, "evictions": 0})
    client.hset(keys.device_holders("cuda:0"), "w1", json.dumps(
        {"backend": "faster-whisper", "model": "secret-model", "mib": 300, "busy": 1,
         "evict": 0, "last_used": 0, "expires": 10 ** 10}))
    anonymous = http.get(f"{env['gateway']}/ready", timeout=30).json()
    keyed = http.get(f"{env['gateway']}/ready", headers=AUTH, timeout=30).json()
    assert "secret-model" not in json.dumps(anonymous) and "tiny.en" not in json.dumps(
        anonymous["backends"]["faster-whisper"]["live"]), anonymous
    assert anonymous["devices"]["cuda:0"]["reserved_mib"] == 300
    assert "secret-model" in json.dumps(keyed["devices"])
    assert keyed["backends"]["faster-whisper"]["live"][0]["loaded_models"] == ["tiny.en"]
