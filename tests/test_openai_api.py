"""OpenAI-compatible API through the official SDK and raw HTTP; API keys; upload limits."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from gateway.auth import digest
from harness import procs
from harness.http_client import http
from harness.procs import TEST_AUDIO, wait_until
from tests.helpers import JFK, JFK_TEXT, queue_counts, status, wait_done, wer

KEY_A, KEY_B = "key-alpha-0123456789", "key-bravo-9876543210"


@pytest.fixture(scope="module")
def client(stack: dict) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack['gateway']}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def keyed(stack: dict, redis_server: procs.RedisServer, workdir: Path) -> Iterator[str]:
    """A second gateway on the same Redis and worker: keys on, tight limits, short wait."""
    service = procs.gateway(
        redis_server.url, workdir, api_keys=[f"sha256:{digest(KEY_A)}", digest(KEY_B)],
        max_upload_mib="2", max_audio_seconds="30", request_timeout_seconds="0.3",
        allowed_roots=[str(TEST_AUDIO)]).start()
    yield service.url
    service.stop()


def test_every_response_format(client: openai.OpenAI) -> None:
    with JFK.open("rb") as handle:
        text_json = client.audio.transcriptions.create(model="whisper-1", file=handle)
    assert wer(JFK_TEXT, text_json.text) <= 0.10
    assert text_json.usage.type == "duration" and text_json.usage.seconds == 11
    for fmt in ("text", "srt", "vtt"):
        with JFK.open("rb") as handle:
            body = client.audio.transcriptions.create(model="whisper-1", file=handle,
                                                      response_format=fmt)
        assert isinstance(body, str) and "country" in body
    with JFK.open("rb") as handle:
        srt = client.audio.transcriptions.create(model="faster-whisper/tiny.en", file=handle,
                                                 response_format="srt")
    assert srt.startswith("1\n00:00:00,000 --> 00:00:")
    with JFK.open("rb") as handle:
        verbose = client.audio.transcriptions.create(model="whisper-1", file=handle,
                                                     response_format="verbose_json")
    assert isinstance(verbose.duration, float) and verbose.duration == pytest.approx(11.0, 0.01)
    assert verbose.language == "en" and verbose.words is None
    segment = verbose.segments[0].model_dump()
    for field in ("id", "seek", "start", "end", "text", "tokens", "temperature", "avg_logprob",
                  "compression_ratio", "no_speech_prob"):
        assert field in segment and segment[field] is not None, field
    assert segment["tokens"] and isinstance(segment["avg_logprob"], float)


def test_word_and_segment_granularities(client: openai.OpenAI) -> None:
    with JFK.open("rb") as handle:
        words_only = client.audio.transcriptions.create(
            model="whisper-1", file=handle, response_format="verbose_json",
            timestamp_granularities=["word"])
    assert words_only.segments is None and len(words_only.words) >= 20
    assert all(w.start <= w.end for w in words_only.words)
    with JFK.open("rb") as handle:
        both = client.audio.transcriptions.create(
            model="whisper-1", file=handle, response_format="verbose_json",
            timestamp_granularities=["word", "segment"])
    assert both.segments and both.words


def test_granularity_without_brackets(stack: dict) -> None:
    reply = http.post(f"{stack['gateway']}/v1/audio/transcriptions",
                       files={"file": JFK.open("rb")},
                       data={"response_format": "verbose_json",
                             "timestamp_granularities": "word"}, timeout=60)
    assert reply.status_code == 200 and len(reply.json()["words"]) >= 20


def test_translation_and_models(client: openai.OpenAI) -> None:
    with JFK.open("rb") as handle:
        translated = client.audio.translations.create(model="whisper-1", file=handle)
    assert "country" in translated.text.lower()
    ids = {model.id for model in client.models.list()}
    assert {"whisper-1", "faster-whisper/tiny.en"} <= ids


def test_streaming_deltas_then_done(client: openai.OpenAI) -> None:
    with (TEST_AUDIO / "multilingual.mp3").open("rb") as handle:
        events = list(client.audio.transcriptions.create(model="whisper-1", file=handle,
                                                         stream=True))
    deltas = [e for e in events if e.type == "transcript.text.delta"]
    assert len(deltas) >= 2 and events[-1].type == "transcript.text.done"
    assert " ".join(d.delta.strip() for d in deltas).split() == events[-1].text.split()


def test_sdk_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.audio.transcriptions.create(model="no-such-model", file=JFK.open("rb"))
    assert "/v1/models" in missing.value.message
    with pytest.raises(openai.BadRequestError):
        client.audio.transcriptions.create(model="whisper-1", file=JFK.open("rb"),
                                           response_format="yaml")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError):
        client.audio.transcriptions.create(model="whisper-1", file=("x.wav", b"junk" * 100))


def _openai_error(reply: httpx.Response, status_code: int) -> dict:
    assert reply.status_code == status_code, reply.text
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


def test_raw_bad_requests_enqueue_nothing(stack: dict, tmp_path: Path) -> None:
    url = f"{stack['gateway']}/v1/audio/transcriptions"
    before = queue_counts(stack["redis"])
    _openai_error(http.post(url, data={"model": "whisper-1"}), 400)
    _openai_error(http.post(url, files={"file": ("a.wav", b"")}), 400)
    _openai_error(http.post(url, files={"file": ("a.wav", b"\x00garbage" * 500)}), 400)
    assert _openai_error(http.post(url, files={"file": JFK.open("rb")},
                                    data={"model": "large-v9"}), 404)["param"] == "model"
    _openai_error(http.post(url, files={"file": JFK.open("rb")},
                             data={"response_format": "xml"}), 400)
    _openai_error(http.post(url, files={"file": JFK.open("rb")},
                             data={"response_format": "diarized_json",
                                   "num_speakers": "0"}), 400)
    _openai_error(http.post(url, files={"file": JFK.open("rb")},
                             data={"timestamp_granularities[]": "phoneme"}), 400)
    assert queue_counts(stack["redis"]) == before
    assert http.get(f"{stack['gateway']}/health").status_code == 200


def test_api_keys(keyed: str, redis_server: procs.RedisServer) -> None:
    url = f"{keyed}/v1/audio/transcriptions"
    before = queue_counts(redis_server.client())
    assert _openai_error(http.post(url, files={"file": JFK.open("rb")}), 401)["type"] == \
        "authentication_error"
    _openai_error(http.post(url, files={"file": JFK.open("rb")},
                             headers={"Authorization": "Bearer wrong"}), 401)
    sage = http.post(f"{keyed}/api/faster-whisper-submit", files={"file": JFK.open("rb")})
    assert sage.status_code == 401 and sage.json()["status"] == "FAILED"
    assert queue_counts(redis_server.client()) == before
    assert http.get(f"{keyed}/health").status_code == 200  # public
    # a task belongs to the key that made it
    reply = http.post(f"{keyed}/api/faster-whisper-submit", files={"file": JFK.open("rb")},
                       headers={"x-api-key": KEY_A})
    task_id = reply.json()["taskid"]
    mine = http.get(f"{keyed}/api/status", params={"taskid": task_id},
                     headers={"Authorization": f"Bearer {KEY_A}"}).json()
    assert mine["status"] in ("PENDING", "RUNNING", "SUCCEEDED")
    theirs = http.get(f"{keyed}/api/status", params={"taskid": task_id},
                       headers={"Authorization": f"Bearer {KEY_B}"})
    assert theirs.status_code == 200 and theirs.json()["error"] == "unknown or expired task"
    keyless = http.get(f"{keyed}/api/status", params={"taskid": task_id})
    assert keyless.status_code == 200  # the status endpoint answers 200 whatever happens
    assert keyless.json() == {"status": "FAILED",
                              "error": "missing API key: send 'Authorization: Bearer KEY'"}
    assert http.get(f"{keyed}/v1/tasks/{task_id}",
                     headers={"x-api-key": KEY_B}).status_code == 404
    assert http.delete(f"{keyed}/v1/tasks/{task_id}",
                        headers={"x-api-key": KEY_B}).status_code == 404
    sdk = openai.OpenAI(base_url=f"{keyed}/v1", api_key=KEY_B, max_retries=0)
    assert any(m.id == "whisper-1" for m in sdk.models.list())
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{keyed}/v1", api_key="nope", max_retries=0).models.list()


def test_wait_timeout_is_504_with_task_id_and_loses_nothing(keyed: str) -> None:
    reply = http.post(f"{keyed}/v1/audio/transcriptions", files={"file": JFK.open("rb")},
                       headers={"x-api-key": KEY_A}, timeout=30)
    error = _openai_error(reply, 504)
    task_id = reply.headers["x-task-id"]
    assert reply.json()["task_id"] == task_id and task_id in error["message"]
    view = wait_until(lambda: (v := http.get(f"{keyed}/v1/tasks/{task_id}",
                                             headers={"x-api-key": KEY_A}).json())["status"]
                      == "SUCCEEDED" and v, 60, "task to finish")
    assert wer(JFK_TEXT, view["result"]["text"]) <= 0.10 and view["attempts"] == 1


def _raw_request(port: int, head: str, chunks: Iterator[bytes]) -> bytes:
    """Send a request by hand (any framing, any lie) and return what the server answered."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(head.encode())
        try:
            for chunk in chunks:
                sock.sendall(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed before reading it all: what we want
        reply = b""
        try:
            while data := sock.recv(65536):
                reply += data
        except (ConnectionResetError, TimeoutError):
            pass
    return reply


def test_oversized_bodies_are_413_without_reading_them(keyed: str,
                                                       redis_server: procs.RedisServer) -> None:
    port = int(keyed.rsplit(":", 1)[1])
    before = queue_counts(redis_server.client())
    auth = f"x-api-key: {KEY_A}\r\n"
    boundary = "b0undary"
    part = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"big.wav\"\r\nContent-Type: audio/wav\r\n\r\n").encode()
    megabyte = b"\x00" * (1024 * 1024)

    def multipart(n_mib: int) -> Iterator[bytes]:
        yield part
        for _ in range(n_mib):
            yield megabyte
        yield f"\r\n--{boundary}--\r\n".encode()

    # streamed with an honest Content-Length over the limit: refused before the body
    size = len(part) + 3 * len(megabyte) + 16
    head = (f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\n{auth}"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
            f"Content-Length: {size}\r\n\r\n")
    assert b" 413 " in _raw_request(port, head, multipart(3)).split(b"\r\n")[0]
    # chunked, no Content-Length: counted while it streams in
    head = (f"POST /api/faster-whisper-submit HTTP/1.1\r\nHost: x\r\n{auth}"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
            "Transfer-Encoding: chunked\r\n\r\n")
    chunked = (b"%x\r\n%s\r\n" % (len(c), c) for c in multipart(3))
    reply = _raw_request(port, head, chunked)
    assert b" 413 " in reply.split(b"\r\n")[0] and b'"status": "FAILED"' in reply.replace(
        b'":"', b'": "')
    # a Content-Length that claims a small body while more follows: only the declared
    # bytes are read, as HTTP says; the truncated form is refused, nothing is queued
    head = (f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\n{auth}"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
            f"Content-Length: 1000\r\n\r\n")
    status_line = _raw_request(port, head, multipart(2)).split(b"\r\n")[0]
    assert b" 400 " in status_line or b" 413 " in status_line, status_line
    # and a huge declared length is refused at once
    head = (f"POST /v1/audio/transcriptions HTTP/1.1\r\nHost: x\r\n{auth}"
            f"Content-Type: multipart/form-data; boundary={boundary}\r\n"
            f"Content-Length: {50 * 1024 ** 3}\r\n\r\n")
    assert b" 413 " in _raw_request(port, head, iter([part])).split(b"\r\n")[0]
    # a status poll is HTTP 200 whatever is refused (Sage reads any other status as a failure)
    for path in ("/api/status", "/api/faster-whisper-status"):
        head = (f"POST {path} HTTP/1.1\r\nHost: x\r\n{auth}"
                "Content-Type: application/json\r\n"
                f"Content-Length: {50 * 1024 ** 3}\r\n\r\n")
        reply = _raw_request(port, head, iter([b"{"]))
        assert b" 200 " in reply.split(b"\r\n")[0] and b"FAILED" in reply, reply[:300]
    assert queue_counts(redis_server.client()) == before
    assert http.get(f"{keyed}/health").status_code == 200


def test_too_long_audio_is_413(keyed: str, redis_server: procs.RedisServer) -> None:
    before = queue_counts(redis_server.client())
    reply = http.post(f"{keyed}/v1/audio/transcriptions", headers={"x-api-key": KEY_A},
                       files={"file": (TEST_AUDIO / "multilingual.mp3").open("rb")})
    assert "30 s" in _openai_error(reply, 413)["message"]
    reply = http.post(f"{keyed}/api/submit", headers={"x-api-key": KEY_A},
                       data={"backend": "faster-whisper",
                             "audio_path": str(TEST_AUDIO / "multilingual.mp3")})
    assert reply.status_code == 413 and reply.json()["status"] == "FAILED"
    assert queue_counts(redis_server.client()) == before


def test_client_disconnect_loses_and_duplicates_nothing(stack: dict) -> None:
    """A caller that hangs up while waiting: the task still runs, once."""
    redis = stack["redis"]
    before = set(redis.scan_iter(match="sg:task:*"))
    with pytest.raises(httpx.ReadTimeout):
        http.post(f"{stack['gateway']}/v1/audio/transcriptions",
                   files={"file": (TEST_AUDIO / "multilingual.mp3").open("rb")}, timeout=1.5)
    new = wait_until(lambda: set(redis.scan_iter(match="sg:task:*")) - before, 10, "the task")
    (key,) = new
    task_id = key.decode().split(":", 2)[2]
    final = wait_done(stack["gateway"], task_id, timeout=120)
    assert final["status"] == "SUCCEEDED"
    time.sleep(0.5)
    assert http.get(f"{stack['gateway']}/v1/tasks/{task_id}").json()["attempts"] == 1
    assert json.loads(json.dumps(status(stack["gateway"], task_id)))["status"] == "SUCCEEDED"
