"""Hostile parameters on every submit route: every option is checked at submit against its
documented range, a bad value is a 400 naming the parameter and queues nothing, and no
input at all yields a 5xx (a seeded fuzz of random form, query and JSON values)."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from common import keys
from harness import procs
from harness.http_client import http
from harness.procs import TEST_AUDIO

JFK_PATH = str(TEST_AUDIO / "jfk.flac")
FUZZ_SEED = 1303
FUZZ_VALUES_PER_PARAM = 5
FUZZ_BUDGET_SECONDS = 90.0


@dataclass
class Route:
    name: str
    method: str
    path: str
    encoding: str  # "form" (multipart, with the clip), "json", "query"
    base: dict[str, Any]  # the valid parameters the fuzzed one joins
    params: tuple[str, ...]  # every parameter the route reads
    backend: str  # whose queue a valid request grows


#: what every submit reads besides its kind's options (admission, webhooks)
TERMS = ("priority", "deadline", "max_wait_seconds", "callback_url")
ASR = ("model", "language", "task", "word_timestamps", "prompt", "initial_prompt", "beam_size",
       "temperature", "vad_filter", "audio_path", "audio_file", "audio_url", *TERMS)
OPENAI_ASR = ("model", "language", "prompt", "response_format", "temperature", "beam_size",
              "vad_filter", "stream", "timestamp_granularities[]", "timestamp_granularities",
              *TERMS)
TTS = ("text", "language", "voice", "speed", "model", "speaker_wav", *TERMS)
SPEECH = ("model", "input", "voice", "response_format", "speed", "stream_format", "language",
          *TERMS)
ROUTES = [
    Route("sage form", "POST", "/api/faster-whisper-submit", "form", {}, ASR,
          "faster-whisper"),
    Route("sage json", "POST", "/api/submit", "json",
          {"backend": "faster-whisper", "audio_path": JFK_PATH}, ("backend", *ASR),
          "faster-whisper"),
    Route("sage query", "GET", "/api/submit", "query",
          {"backend": "faster-whisper", "audio_file": "jfk.flac"}, ("backend", *ASR),
          "faster-whisper"),
    Route("sage tts json", "POST", "/api/xtts-submit", "json", {"text": "Hello there."}, TTS,
          "xtts"),
    Route("sage tts form", "POST", "/api/submit", "urlencoded",
          {"backend": "xtts", "text": "Hello there."}, TTS, "xtts"),
    Route("openai transcriptions", "POST", "/v1/audio/transcriptions", "form", {}, OPENAI_ASR,
          "faster-whisper"),
    Route("openai translations", "POST", "/v1/audio/translations", "form", {}, OPENAI_ASR,
          "faster-whisper"),
    Route("openai speech", "POST", "/v1/audio/speech", "json",
          {"model": "tts-1", "input": "Hello there.", "voice": "alloy"}, SPEECH, "xtts"),
]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory: pytest.TempPathFactory, speech_clip: Path) -> Iterator[dict]:
    """Its own Redis and gateway, no worker: a valid task stays queued, and a valid OpenAI
    call answers 504 after 0.3 s (the task goes on), so what was queued is easy to count."""
    workdir = tmp_path_factory.mktemp("hostile")
    server = procs.RedisServer(workdir / "redis", appendonly=False).start()
    gateway = procs.gateway(
        server.url, workdir, allowed_roots=[str(TEST_AUDIO)], request_timeout_seconds="0.3",
        models={"faster-whisper": {"tiny.en": "bundled"}, "xtts": {"tiny": "unused"}},
        # callback_url on, so a fuzzed one reaches the URL checks (nothing is ever sent)
        callback_url_hosts=["127.0.0.1:9"],
        webhook_secrets={"k1": "whsec_" + base64.b64encode(bytes(range(32))).decode()}).start()
    yield {"url": gateway.url, "redis": server.client(), "redis_url": server.url,
           "clip": speech_clip.read_bytes()}
    gateway.stop()
    server.stop()


def queued(client: redis.Redis) -> tuple[int, ...]:
    """Stream length per backend and the number of task records: what a refusal leaves alone."""
    lengths = tuple(client.xlen(keys.queue(b)) for b in ("faster-whisper", "xtts"))
    return (*lengths, sum(1 for _ in client.scan_iter(match=keys.task_pattern(), count=500)))


def send(env: dict, route: Route, params: dict[str, Any], *,
         raw_body: bytes | None = None, content_type: str | None = None) -> httpx.Response:
    url = env["url"] + route.path
    if raw_body is not None:
        return http.post(url, content=raw_body, headers={"content-type": content_type or ""},
                          timeout=30)
    if route.encoding == "json":
        body = json.dumps(params)  # NaN and Infinity pass as JSON's common extension
        return http.request(route.method, url, content=body,
                             headers={"content-type": "application/json"}, timeout=30)
    fields = [(k, v) for k, value in params.items()
              for v in (value if isinstance(value, list) else [value])]
    if route.encoding == "query":
        return http.request(route.method, url, params=fields, timeout=30)
    if route.encoding == "urlencoded":
        return http.post(url, data=dict(fields), timeout=30)
    files = [("file", ("clip.wav", env["clip"], "audio/wav"))]
    return http.post(url, data=_multi(fields), files=files, timeout=30)


def _multi(fields: list[tuple[str, Any]]) -> dict[str, Any]:
    data: dict[str, Any] = {}
    for key, value in fields:
        data.setdefault(key, []).append(value)
    return {k: v[0] if len(v) == 1 else v for k, v in data.items()}


def check(env: dict, route: Route, params: dict[str, Any], **raw: Any) -> httpx.Response:
    """Send; a 5xx fails the test (a 504 only as the honest answer of a queued OpenAI call),
    and a 4xx must have queued nothing."""
    before = queued(env["redis"])
    reply = send(env, route, params, **raw)
    after = queued(env["redis"])
    label = (route.name, raw or params, reply.status_code, reply.text[:300])
    if reply.status_code == 504:
        assert route.path.startswith("/v1/audio/") and after[-1] == before[-1] + 1, label
    else:
        assert reply.status_code < 500, label
    if reply.status_code >= 400:
        body = reply.json()
        assert body["error"] if route.path.startswith("/api/") else body["error"]["message"], label
    if 400 <= reply.status_code < 500:
        assert after == before, label
    return reply


def refused(env: dict, route: Route, param: str, value: Any) -> None:
    params = {**route.base, param: value}
    reply = check(env, route, params)
    label = (route.name, param, value, reply.status_code, reply.text[:300])
    assert reply.status_code == 400, label
    body = reply.json()
    if route.path.startswith("/v1/"):
        assert body["error"]["param"] in (param, param.removesuffix("[]") + "[]"), label
    else:
        assert param.removesuffix("[]") in body["error"], label


def accepted(env: dict, route: Route, param: str, value: Any) -> None:
    reply = check(env, route, {**route.base, param: value})
    assert reply.status_code in (200, 504), (route.name, param, value, reply.text[:300])


ASR_ROUTES = [r for r in ROUTES if r.backend == "faster-whisper"]
TTS_ROUTES = [r for r in ROUTES if r.backend == "xtts"]


def test_engine_options_are_checked_at_submit(hostile: dict) -> None:
    for route in ASR_ROUTES:
        for value in ("0", "17", "-1", "abc", "1e9", "5.5", "1_0", " ") + (
                (True, 5.0, -3, 10**30) if route.encoding == "json" else ()):
            refused(hostile, route, "beam_size", value)  # (an empty value is the default)
        for value in ("nan", "inf", "-inf", "1e9", "-1", "7", "abc", "1.0000001"):
            refused(hostile, route, "temperature", value)
        if route.encoding == "json":
            for value in (float("nan"), float("inf"), 1e9, -1, 7, True):
                refused(hostile, route, "temperature", value)
        for value in ("xx", "123", "../../etc", "en\x00", "english-please", "e" * 5000):
            if "translations" in route.path:
                continue  # a translation's language is English whatever is sent
            refused(hostile, route, "language", value)
        for value in ("yes please", "2", "maybe"):
            refused(hostile, route, "vad_filter", value)
        refused(hostile, route, "prompt", "word " * 1000)
    sage, openai = ASR_ROUTES[0], ROUTES[5]
    for value in ("1", "16", "+4", "5\x1c", "\x1f3"):  # int() keeps what strip() drops
        accepted(hostile, sage, "beam_size", value)
    for value in ("2\x1c", "\x1e2"):
        for route in ASR_ROUTES:
            check(hostile, route, {**route.base, "diarize": "true", "num_speakers": value})
    paths = ASR_ROUTES[1]
    for value in ("a" * 300, "/" + "a/" * 3000 + "x", "/etc/passwd", "/etc/no-such-file"):
        reply = check(hostile, paths, {**paths.base, "audio_path": value})
        assert reply.status_code == 400, (value[:40], reply.text)
        assert ("outside" if value.startswith("/") else "no such file") in reply.text, value
    for value in ("0", "1", "0.25"):
        accepted(hostile, sage, "temperature", value)
    for value in ("en", "EN", "en-US", "auto"):
        accepted(hostile, sage, "language", value)
    accepted(hostile, openai, "temperature", "0.2")
    refused(hostile, sage, "task", "summarise")
    refused(hostile, openai, "response_format", "yaml")
    refused(hostile, openai, "stream", "sometimes")
    for value in ("[abc", '[{"a": 1}]', "[" * 1000, "phoneme", '["word", 3]'):
        refused(hostile, openai, "timestamp_granularities[]", value)
    for route in TTS_ROUTES:
        for value in ("nan", "inf", "0", "5", "-1", "fast"):
            refused(hostile, route, "speed", value)
        refused(hostile, route, "language", "xx")
        refused(hostile, route, "voice", "nobody")
    refused(hostile, ROUTES[-1], "response_format", "ogg")


def test_word_timestamps_from_a_backend_without_them_are_a_400_not_empty_words() -> None:
    """A Sage/REST submit, as the OpenAI route does: qwen3 and vibevoice have no word
    timestamps, so asking is refused (it read as SUCCEEDED with `"words": []` before)."""
    from common.backends import BACKENDS
    from common.settings import Settings
    from gateway.errors import RequestError
    from gateway.submit.asr import AsrRequest, asr_options

    settings = Settings(models={name: {"m": "unused"} for name in BACKENDS})
    asked = AsrRequest(word_timestamps=True)
    without = [name for name, row in BACKENDS.items() if row.kind == "asr"
               and not row.word_timestamps]
    assert {"qwen3", "vibevoice"} <= set(without)
    for backend in without:
        with pytest.raises(RequestError) as refused:
            asr_options(asked, settings, backend)
        assert refused.value.status_code == 400 and refused.value.param == "word_timestamps"
        assert asr_options(AsrRequest(), settings, backend)["word_timestamps"] is False
    for backend in ("faster-whisper", "parakeet"):
        assert asr_options(asked, settings, backend)["word_timestamps"] is True


def test_a_client_secret_is_made_only_of_text_and_numbers_it_can_keep(hostile: dict) -> None:
    """A lone surrogate (a \\ud800 escape) or a number past a float's range in the session
    is a 400, and no key is made (one made then would live its TTL, its caller never told)."""
    url = f"{hostile['url']}/v1/realtime/client_secrets"
    transcription = '{"session": {"type": "transcription", "audio": {"input": %s}}}'
    for body in (transcription % '{"transcription": {"languages": ["\\ud800"]}}',
                 transcription % '{"transcription": {"prompt": "a \\udfff b"}}',
                 transcription % ('{"turn_detection": {"type": "server_vad", "threshold": %s}}'
                                  % ("9" * 400))):
        reply = http.post(url, content=body, headers={"content-type": "application/json"},
                          timeout=30)
        assert reply.status_code == 400, (body[:120], reply.text)
        assert reply.json()["error"]["message"], reply.text
    assert not list(hostile["redis"].scan_iter(match=keys.client_secret("*")))
    fine = http.post(url, json={"session": {"type": "transcription"}}, timeout=30)
    assert fine.status_code == 200, fine.text  # the emoji's pair is text: 200 below too
    emoji = transcription % '{"transcription": {"prompt": "\\ud83d\\ude00"}}'
    assert http.post(url, content=emoji, headers={"content-type": "application/json"},
                     timeout=30).status_code == 200


def test_a_list_or_object_where_a_value_belongs_is_refused(hostile: dict) -> None:
    json_routes = [r for r in ROUTES if r.encoding == "json"]
    for route in json_routes:
        for param in route.params:
            if param == "audio_url":
                continue  # refused anyway (not enabled here), whatever its shape
            for value in (["en"], {"a": 1}, [[["deep"]]]):
                refused(hostile, route, param, value)
    for route in (ROUTES[0], ROUTES[2]):  # a form or query parameter given twice
        refused(hostile, route, "language", ["en", "fr"])
        refused(hostile, route, "beam_size", ["1", "2"])
    # a list is fine where the API has one, of usable text
    accepted(hostile, ROUTES[5], "timestamp_granularities[]", ["word", "segment"])
    refused(hostile, ROUTES[1], "known_speaker_names", ["\ud800x"])
    reply = check(hostile, ROUTES[1], {**ROUTES[1].base, "diarize": True,
                                       "known_speaker_names": ["Ann"],
                                       "known_speaker_references": ["\ud800x.wav"]})
    assert reply.status_code == 400 and "known_speaker_references" in reply.text, reply.text


def test_a_file_uploaded_twice_is_refused(hostile: dict) -> None:
    """Which of two `file` uploads was meant is unknowable: a 400, nothing queued."""
    clip = ("clip.wav", hostile["clip"], "audio/wav")
    for route in (ROUTES[0], ROUTES[5]):
        before = queued(hostile["redis"])
        reply = http.post(hostile["url"] + route.path, files=[("file", clip), ("file", clip)],
                          data={"model": "whisper-1"} if route.path.startswith("/v1/") else {},
                          timeout=30)
        assert reply.status_code == 400 and "more than once" in reply.text, reply.text
        assert queued(hostile["redis"]) == before


def test_broken_bodies_are_400(hostile: dict) -> None:
    route = ROUTES[1]
    nested = b"[" * 1000 + b"]" * 1000
    deep_object = b'{"backend": ' + b'{"a": ' * 1000 + b"1" + b"}" * 1001
    for body in (b"{not json", nested, b"[" * 100000, deep_object, b"\xff\xfe\x00garbage",
                 b'{"backend": "faster-whisper", "audio_path": "' + JFK_PATH.encode() + b'"',
                 b'"just a string"', b"1" * 5000, b'{"beam_size": ' + b"9" * 5000 + b"}",
                 b'{"prompt": "\\ud800"}'):
        reply = check(hostile, route, {}, raw_body=body, content_type="application/json")
        assert reply.status_code == 400, (body[:40], reply.text)
    for body in ({"taskid": ["a", "b"]}, {"task_id": {"x": 1}}, {"taskid": "\ud800"}):
        reply = http.post(f"{hostile['url']}/api/status", content=json.dumps(body),
                           headers={"content-type": "application/json"})
        assert reply.status_code == 200 and reply.json()["status"] == "FAILED", reply.text
    # a refusal id (errors.sage_refused) whose JSON nests past the parser's recursion limit
    deep = base64.urlsafe_b64encode(b"[" * 1000).decode().rstrip("=")
    reply = http.get(f"{hostile['url']}/api/status", params={"taskid": f"refused.{deep}"})
    assert reply.status_code == 200 and reply.json()["status"] == "FAILED", reply.text
    reply = http.get(f"{hostile['url']}/api/status", params=[("taskid", "a"), ("taskid", "b")])
    assert reply.status_code == 200 and "more than once" in reply.json()["error"]
    for content_type in ("multipart/form-data", "multipart/form-data; boundary=x",
                         "application/x-www-form-urlencoded"):
        reply = check(hostile, ROUTES[0], {}, raw_body=b"--x\r\n\x00\xff" * 100,
                      content_type=content_type)
        assert 400 <= reply.status_code < 500, (content_type, reply.text)


def _text(rng: random.Random) -> str:
    pool = ["", " ", "nan", "NaN", "inf", "-Infinity", "-1", "0", "1", "16", "17", "1e9",
            "1e999", "9" * 400, "0x10", "1_0", "١٢", "[abc", '["word"]', '{"a": 1}', "null",
            "true", "../../etc/passwd", "/etc/hostname", "jfk.flac", "en", "xx", "zh-CN",
            "word", "segment", "json", "verbose_json", "whisper-1", "tts-1", "alloy",
            "faster-whisper/tiny.en", "x" * 70000, "\x00", "a\x00b", "\u202e\u0301",
            "日本語のテキスト", "🙂" * 50, "\r\n\t", "%00", "' OR 1=1 --", "<script>",
            "interactive", "batch", "2030-01-01T00:00:00Z", "1999-01-01", "-1e308", "audio",
            "sse", "http://127.0.0.1:9/hook", "http://u:p@127.0.0.1:9/", "http://127.0.0.1:0/",
            "http://[::1]:9/", "http://127.0.0.1:9\\@evil.example/", "file:///etc/passwd"]
    if rng.random() < 0.3:
        return "".join(chr(rng.randrange(1, 0x2FFF)) for _ in range(rng.randrange(1, 40)))
    return rng.choice(pool)


def _json(rng: random.Random, depth: int = 0) -> Any:
    roll = rng.random()
    if roll < 0.45 or depth > 2:
        return rng.choice([_text(rng), "\ud800", "\udfff x"])
    if roll < 0.7:
        return rng.choice([float("nan"), float("inf"), -float("inf"), 1e308, -1, 0, 1, 17,
                           10**30, 10**400, 0.5, -0.0, True, False, None])
    if roll < 0.85:
        return [_json(rng, depth + 1) for _ in range(rng.randrange(0, 4))]
    if roll < 0.95:
        return {_text(rng)[:10]: _json(rng, depth + 1) for _ in range(rng.randrange(0, 3))}
    nested: Any = "bottom"
    for _ in range(rng.choice([50, 200, 900])):
        nested = [nested]
    return nested


def test_fuzzed_parameters_never_yield_a_5xx(hostile: dict) -> None:
    rng = random.Random(FUZZ_SEED)
    started = time.monotonic()
    sent = 0
    for route in ROUTES:
        for param in route.params:
            for _ in range(FUZZ_VALUES_PER_PARAM):
                if time.monotonic() - started > FUZZ_BUDGET_SECONDS:
                    break
                if route.encoding == "json":
                    value = _json(rng)
                else:
                    value = _text(rng)
                    if rng.random() < 0.15:
                        value = [value, _text(rng)]
                    if route.encoding == "query":  # httpx refuses to send longer URLs
                        value = [v[:4000] for v in value] if isinstance(value, list) \
                            else value[:4000]
                check(hostile, route, {**route.base, param: value})
                sent += 1
    assert sent >= 200, f"only {sent} fuzzed requests within {FUZZ_BUDGET_SECONDS} s"
    assert http.get(f"{hostile['url']}/health").json() == {"status": "ok"}


def test_language_tables_match_the_engines() -> None:
    """The gateway's copies (it imports no engine at run time) of what each engine accepts."""
    from faster_whisper.tokenizer import _LANGUAGE_CODES

    from common.catalog import BACKENDS, KINDS, QWEN3_LANGUAGES, WHISPER_LANGUAGES
    from workers.engines.qwen3_text import _ALIASES, LANGUAGE_NAMES

    assert set(WHISPER_LANGUAGES) == set(_LANGUAGE_CODES)
    assert set(QWEN3_LANGUAGES) == set(LANGUAGE_NAMES) | set(_ALIASES)
    assert all(info.languages for info in BACKENDS.values() if KINDS[info.kind].languages)


def test_with_consent_required_a_clients_own_reference_clip_is_refused(
        tmp_path: Path, speech_clip: Path) -> None:
    """SPEECH_REQUIRE_VOICE_CONSENT: a `speaker_wav` (a path or an upload) would clone a voice
    nobody consented to: 403 consent_required, nothing queued; a configured voice speaks."""
    server = procs.RedisServer(tmp_path / "redis", appendonly=False).start()
    gateway = procs.gateway(server.url, tmp_path, allowed_roots=[str(TEST_AUDIO)],
                            models={"xtts": {"tiny": "unused"}}, request_timeout_seconds="0.3",
                            require_voice_consent="true").start()
    env = {"url": gateway.url, "redis": server.client(), "clip": speech_clip.read_bytes()}
    sage, speech = (next(r for r in TTS_ROUTES if r.name == name)
                    for name in ("sage tts json", "openai speech"))
    try:
        replies = [check(env, sage, {**sage.base, "speaker_wav": JFK_PATH}),
                   http.post(f"{gateway.url}/api/xtts-submit", data={"text": "Hello there."},
                             files={"speaker_wav": ("me.wav", env["clip"], "audio/wav")},
                             timeout=30)]
        for reply in replies:
            assert reply.status_code == 403, reply.text
            assert "consent" in reply.json()["error"], reply.text
        spoken = check(env, speech, speech.base)
        assert spoken.status_code == 504  # queued (no worker here): a configured voice
        assert queued(env["redis"])[-1] == 1  # its task, the only one
    finally:
        gateway.stop()
        server.stop()


def test_a_voice_routes_body_is_bounded_by_its_one_clip(hostile: dict) -> None:
    """A consent's or a voice's request holds one clip of at most 10 MiB: a larger body is
    refused (413) as it arrives, where it was read whole first (up to SPEECH_MAX_UPLOAD_MIB,
    200 MiB) and refused after; other routes keep the global limit."""
    big = b"\0" * (12 * 1024 * 1024)
    for path in ("/v1/audio/voice_consents", "/v1/audio/voices"):
        reply = http.post(f"{hostile['url']}{path}", data={"name": "x", "language": "en"},
                          files={"recording": ("r.wav", big)}, timeout=60)
        assert reply.status_code == 413, (path, reply.text)
        assert reply.json()["error"]["code"] == "request_too_large", reply.text
    reply = http.post(f"{hostile['url']}/v1/audio/transcriptions", data={"model": "whisper-1"},
                      files={"file": ("big.wav", big)}, timeout=60)
    assert reply.status_code == 400, reply.text  # read, then refused as not audio


def test_a_status_poll_is_http_200_json_whatever_the_record_holds(hostile: dict) -> None:
    """Sage takes any non-2xx poll, or a body that is not JSON, for a job that failed for good:
    whatever a task's record holds (a state a newer worker wrote in a rolling upgrade: still
    PENDING; a result that cannot be read, or is gone; an engine's NaN or -inf in the
    result), both polls answer HTTP 200 with strict JSON, and a FAILED one says its `code`."""
    from redis.asyncio import Redis

    from common.schemas import TaskState
    from common.settings import Settings
    from common.store import TaskStore

    client = hostile["redis"]

    def submit() -> str:
        reply = http.post(f"{hostile['url']}/api/faster-whisper-submit",
                          data={"audio_path": JFK_PATH}, timeout=30)
        assert reply.status_code == 200, reply.text
        return str(reply.json()["task_id"])

    def polls(task_id: str) -> list[dict[str, Any]]:
        replies = [http.get(f"{hostile['url']}/api/status", params={"taskid": task_id},
                            timeout=30),
                   http.post(f"{hostile['url']}/api/faster-whisper-status",
                             json={"task_id": task_id}, timeout=30)]
        for reply in replies:
            assert reply.status_code == 200, reply.text
        return [json.loads(reply.text, parse_constant=_no_constant) for reply in replies]

    unknown = submit()
    client.hset(keys.task(unknown), "state", "PAUSED")  # a state this gateway does not know
    for body in polls(unknown):  # (a newer version's, in a rolling upgrade: the task lives)
        assert body["status"] == "PENDING" and "keep polling" in body["detail"], body
    client.hset(keys.task(unknown), "params", "{not json")  # a record it cannot read at all
    client.hset(keys.task(unknown), "state", TaskState.SUCCEEDED.value)
    client.hset(keys.task(unknown), "result", "{not json")
    for body in polls(unknown):
        assert body["status"] == "FAILED" and body["error"].startswith("internal error"), body

    lost = submit()
    client.hset(keys.task(lost), "state", TaskState.SUCCEEDED.value)
    client.hdel(keys.task(lost), "result")
    for body in polls(lost):
        assert (body["status"], body["code"]) == ("FAILED", "result_missing"), body

    async def finish(task_id: str, state: TaskState, **outcome: Any) -> None:
        redis_client = Redis.from_url(hostile["redis_url"])
        store = TaskStore.for_settings(redis_client, Settings(redis_url=hostile["redis_url"]))
        attempt = await store.start(task_id, "w1", 1, "faster-whisper")
        task = await store.get(task_id)
        assert task is not None and attempt > 0
        assert await store.finish(task, state, attempt=attempt, entry_id=task.entry_id,
                                  **outcome)
        await redis_client.aclose()

    failed = submit()
    asyncio.run(finish(failed, TaskState.FAILED, error="the engine broke",
                       error_code="engine_error"))
    for body in polls(failed):
        assert (body["status"], body["code"]) == ("FAILED", "engine_error"), body

    odd = submit()
    asyncio.run(finish(odd, TaskState.SUCCEEDED, result={
        "text": "x", "language": "en", "duration": 1.0, "usage": {"audio_seconds": 1.0},
        "segments": [{"id": 0, "start": 0.0, "end": 1.0, "text": "x",
                      "avg_logprob": float("-inf"), "compression_ratio": float("nan")}]}))
    for body in polls(odd):
        assert body["status"] == "SUCCEEDED", body
        assert body["result"]["segments"][0]["avg_logprob"] is None, body
    view = http.get(f"{hostile['url']}/v1/tasks/{odd}", timeout=30)
    assert view.status_code == 200, view.text


def _no_constant(name: str) -> None:
    raise AssertionError(f"{name} is not JSON")
