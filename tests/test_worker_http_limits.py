"""The worker's direct HTTP server takes the gateway's limits and, when set, a secret; off
loopback it refuses to start without one (issue 13)."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from common.settings import Settings
from harness import procs
from harness.http_client import http
from tests.audio_fakes import lying_matroska
from tests.helpers import JFK, JFK_TEXT, wer
from workers.engine_host import EngineHost
from workers.engines.faster_whisper import FasterWhisperEngine
from workers.http import create_worker_app, is_loopback

SECRET = "worker-test-secret"
AUTH = {"Authorization": f"Bearer {SECRET}"}
UPLOAD_MIB = 2


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Redis, a gateway and a worker with a secret, a 2 MiB upload limit and a 60 s limit."""
    workdir = tmp_path_factory.mktemp("worker-http")
    redis = procs.RedisServer(workdir / "redis").start()
    gateway = procs.gateway(redis.url, workdir)
    worker = procs.worker(redis.url, workdir, worker_secret=SECRET,
                          max_upload_mib=str(UPLOAD_MIB), max_audio_seconds="60",
                          idle_unload_seconds="-1")
    try:
        gateway.start()
        worker.start()  # its /health answers without the secret: it is bound to loopback
        yield {"gateway": gateway.url, "worker": worker.url, "workdir": workdir,
               "redis": redis.url}
    finally:
        worker.stop()
        gateway.stop()
        redis.stop()


def transcribe(url: str, files: dict, headers: dict | None = None, **data: str) -> httpx.Response:
    return http.post(f"{url}/transcribe", files=files, data=data, headers=headers, timeout=60)


def multipart_head(boundary: str, filename: str) -> bytes:
    """The start of a one-file multipart body, up to the file's bytes."""
    return (f'--{boundary}\r\nContent-Disposition: form-data; name="file"; '
            f'filename="{filename}"\r\nContent-Type: application/octet-stream\r\n\r\n').encode()


def test_the_secret_is_required_and_right(secured: dict) -> None:
    url = secured["worker"]
    jfk = {"file": ("jfk.flac", JFK.read_bytes())}
    for headers in (None, {"Authorization": "Bearer wrong"}, {"Authorization": SECRET},
                    {"Authorization": f"Bearer {SECRET}x"}):
        reply = transcribe(url, jfk, headers)
        assert reply.status_code == 401, (headers, reply.text)
        assert "SPEECH_WORKER_SECRET" in reply.json()["error"]
    reply = transcribe(url, jfk, AUTH)
    assert reply.status_code == 200, reply.text
    assert wer(JFK_TEXT, reply.json()["text"]) <= 0.10
    assert http.get(f"{url}/health", timeout=10).json()["state"] in ("ready", "busy")


def test_a_refused_upload_reads_as_its_401_not_a_reset(secured: dict) -> None:
    """The refusal comes before the body is read: unless the worker reads it all first, its
    close finds bytes unread and resets the connection, and the reset discards the 401 the
    client has not read yet. The client here reads only after a pause (as a busy one would),
    so a reset shows every time; sizes up to the 2 MiB limit (a 1 MiB drain bound reset
    jfk.flac's 1.15 MB)."""
    host, port = secured["worker"].removeprefix("http://").split(":")
    for size in (1 << 16, 1 << 19, 3 << 19, (UPLOAD_MIB << 20) - 99_999):
        boundary = "refused-boundary"
        body = multipart_head(boundary, "a.wav") + bytes(size) + f"\r\n--{boundary}--\r\n".encode()
        head = (f"POST /transcribe HTTP/1.1\r\nHost: {host}\r\n"
                f"Authorization: Bearer wrong\r\nContent-Length: {len(body)}\r\n"
                f"Content-Type: multipart/form-data; boundary={boundary}\r\n\r\n").encode()
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            sock.sendall(head + body)
            time.sleep(0.3)  # the worker has answered and closed by now
            reply = b""
            while chunk := sock.recv(65536):
                reply += chunk
        assert reply.startswith(b"HTTP/1.1 401"), (size, reply[:80])
        assert b'"code":"unauthorized"' in reply.replace(b" ", b""), (size, reply[-200:])


def test_upload_limit_holds_while_streaming(secured: dict) -> None:
    boundary = "limit-boundary"
    head = multipart_head(boundary, "big.wav")
    sent = 0

    def body() -> Iterator[bytes]:  # no Content-Length: only counting the stream can stop it
        nonlocal sent
        yield head
        for _ in range(64):  # 16 MiB, 8 times the limit
            sent += 256 * 1024
            yield b"\0" * (256 * 1024)
        yield f"\r\n--{boundary}--\r\n".encode()

    headers = {**AUTH, "Content-Type": f"multipart/form-data; boundary={boundary}"}
    try:
        reply = http.post(f"{secured['worker']}/transcribe", content=body(), headers=headers,
                           timeout=60)
        assert reply.status_code == 413, reply.text
        assert "the request body is larger than" in reply.json()["error"]
    except httpx.TransportError:
        pass  # the server answered 413 and closed while the body was still being sent
    assert sent < 16 * 1024 * 1024


def test_options_and_bad_files_are_400(secured: dict) -> None:
    url = secured["worker"]
    jfk = {"file": ("jfk.flac", JFK.read_bytes())}
    for field, value in (("beam_size", "400"), ("beam_size", "0"), ("beam_size", "five"),
                         ("task", "summarize"), ("temperature", "7"),
                         ("temperature", "nan")):
        reply = transcribe(url, jfk, AUTH, **{field: value})
        assert reply.status_code == 400, (field, value, reply.text)
        assert field in reply.json()["error"], reply.text
    for name, data in (("empty.wav", b""), ("garbage.wav", b"RIFF not really audio" * 50)):
        reply = transcribe(url, {"file": (name, data)}, AUTH)
        assert reply.status_code == 400, (name, reply.text)
        assert reply.json()["code"] == "invalid_audio"
    assert transcribe(url, jfk, AUTH, beam_size="16").status_code == 200


def test_direct_calls_take_the_gateways_spellings_and_checks(secured: dict) -> None:
    """Languages as the gateway spells them, a prompt as it checks it, and an unknown model
    as its 404; a file that is no audio is refused before it waits for the engine."""
    url, jfk = secured["worker"], {"file": ("jfk.flac", JFK.read_bytes())}
    for language in ("EN", "en-US", "auto"):
        reply = transcribe(url, jfk, AUTH, language=language)
        assert reply.status_code == 200, (language, reply.text)
    assert transcribe(url, jfk, AUTH, language="xx").status_code == 400
    for prompt in ("a\x00b", "word " * 401):
        reply = transcribe(url, jfk, AUTH, prompt=prompt)
        assert reply.status_code == 400 and "prompt" in reply.json()["error"], reply.text
    unknown = transcribe(url, jfk, AUTH, model="large-v9")
    assert unknown.status_code == 404 and unknown.json()["code"] == "model_not_found"


def test_one_direct_call_at_a_time_and_none_past_an_open_breaker(secured: dict) -> None:
    """A second direct call while one runs is a 503 to retry (they queued without bound, each
    holding its upload, ahead of queued tasks); a model whose breaker is open is a 503 with
    its load error, and is not loaded (a half-built load would end the worker)."""
    import concurrent.futures

    from redis.asyncio import Redis

    from common.store import BreakerPolicy
    from common.store.breakers import BreakerStore

    url = secured["worker"]
    long_clip = {"file": ("long.mp3", (procs.TEST_AUDIO / "multilingual.mp3").read_bytes())}
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        first = pool.submit(transcribe, url, long_clip, AUTH)
        procs.wait_until(lambda: http.get(f"{url}/health", timeout=5).json()["state"] == "busy",
                         30, "the first direct call to run", 0.01)
        second = transcribe(url, {"file": ("jfk.flac", JFK.read_bytes())}, AUTH)
        assert second.status_code == 503, second.text
        assert second.json()["code"] == "overloaded" and int(second.headers["retry-after"]) > 0
        assert first.result().status_code == 200

    async def breaker(trip: bool) -> None:
        client = Redis.from_url(secured["redis"])
        store = BreakerStore(client)
        if trip:
            for _ in range(3):
                await store.record_load_failure("faster-whisper", "tiny.en", "bundled",
                                                "model 'tiny.en' failed to load: broken",
                                                BreakerPolicy())
        else:
            await store.clear("faster-whisper", "tiny.en")
        await client.aclose()

    asyncio.run(breaker(True))
    try:
        refused = transcribe(url, {"file": ("jfk.flac", JFK.read_bytes())}, AUTH)
        assert refused.status_code == 503, refused.text
        assert refused.json()["code"] == "model_unavailable"
        assert "failed to load" in refused.json()["error"]
    finally:
        asyncio.run(breaker(False))
    assert transcribe(url, {"file": ("jfk.flac", JFK.read_bytes())}, AUTH).status_code == 200


def test_audio_longer_than_the_limit_is_413_whatever_it_claims(secured: dict) -> None:
    lying = lying_matroska(procs.TEST_AUDIO / "multilingual.mp3", 2, 8.0)  # 120 s as 8 s
    reply = transcribe(secured["worker"], {"file": ("lying.mkv", lying)}, AUTH)
    assert reply.status_code == 413, reply.text
    assert reply.json()["code"] == "audio_too_long"


def test_smoke_test_passes_the_secret(secured: dict) -> None:
    run = subprocess.run(
        [str(procs.CORE_PYTHON), str(procs.ROOT / "scripts" / "smoke_test.py"),
         "--url", secured["gateway"], "--worker-secret", SECRET, "--timeout", "120"],
        capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "OK faster-whisper worker" in run.stdout


def test_off_loopback_without_secret_refuses_to_start(tmp_path: Path) -> None:
    # 0.0.0.0 is checked before any bind: nothing listens, even for a moment
    worker = procs.worker("redis://127.0.0.1:1/0", tmp_path, worker_host="0.0.0.0")
    worker.start(wait=False)
    assert worker.proc is not None
    try:
        assert worker.proc.wait(60) != 0
    finally:
        worker.stop()
    assert "refusing to serve worker HTTP on '0.0.0.0'" in worker.log()
    assert "SPEECH_WORKER_SECRET is empty" in worker.log()


def test_loopback_rule() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("127.0.0.2") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("10.0.0.1")
    assert not is_loopback("no-such-host.invalid")


def test_off_loopback_health_needs_the_secret_and_live_does_not() -> None:
    """The app as served off loopback, called in process (no socket): only /health differs."""
    settings = Settings(redis_url="redis://127.0.0.1:1/0", worker_secret=SECRET)
    host = EngineHost(settings, FasterWhisperEngine(settings))

    async def get(path: str, open_health: bool, headers: dict | None = None) -> httpx.Response:
        transport = httpx.ASGITransport(app=create_worker_app(host, open_health=open_health))
        async with httpx.AsyncClient(transport=transport, base_url="http://worker") as client:
            return await client.get(path, headers=headers)

    assert asyncio.run(get("/health", open_health=True)).status_code == 200
    assert asyncio.run(get("/health", open_health=False)).status_code == 401
    assert asyncio.run(get("/health", open_health=False, headers=AUTH)).status_code == 200
    # the liveness probe's path (deploy/k8s): a kubelet has no secret, and it tells nothing
    live = asyncio.run(get("/live", open_health=False))
    assert live.status_code == 200 and live.json() == {"alive": True}


def test_a_direct_call_is_bounded_as_a_tasks_engine_call_is(tmp_path: Path) -> None:
    """SPEECH_MAX_ENGINE_CALL_SECONDS bounds a direct call too: past it the call is a 500
    and the worker leaves for a fresh one (a direct call that never returned held the
    engine, and the queued task waiting behind it, for ever, the worker looking alive)."""
    redis = procs.RedisServer(tmp_path / "redis").start()
    worker = procs.worker(redis.url, tmp_path, max_engine_call_seconds="0.05",
                          idle_unload_seconds="-1", min_uptime_seconds="0").start()
    try:
        reply = transcribe(worker.url, {"file": ("jfk.flac", JFK.read_bytes())})
        assert reply.status_code == 500, reply.text
        assert "ran past" in reply.json()["error"], reply.text
        assert worker.proc is not None
        worker.proc.wait(timeout=60)  # it left, to be restarted fresh
    finally:
        worker.stop()
        redis.stop()


def test_a_secret_too_short_to_keep_anyone_out_stops_the_process() -> None:
    from pydantic import ValidationError

    for name in ("worker_secret", "url_secret"):
        with pytest.raises(ValidationError, match="at least 16"):
            Settings(**{name: "x" * 15})
        assert getattr(Settings(**{name: "x" * 16}), name) == "x" * 16
