"""OpenAI-compatible API through the official SDK and raw HTTP; API keys; upload limits."""

from __future__ import annotations

import json
import socket
import time
import typing
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from common import keys
from common.catalog import resolve_public_model
from common.schemas import ErrorCode, TaskState
from common.settings import Settings
from common.store import Task
from gateway.auth import digest
from gateway.serving.calls import still_running, task_failed
from harness import conversation, procs
from harness.http_client import http
from harness.procs import TEST_AUDIO, wait_until
from tests.helpers import JFK, JFK_TEXT, queue_counts, status, wait_done, wait_task, wer

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
    with JFK.open("rb") as handle:  # every text reply names its charset
        for fmt, kind in (("text", "text/plain"), ("srt", "application/x-subrip"),
                          ("vtt", "text/vtt")):
            reply = client.audio.transcriptions.with_raw_response.create(
                model="whisper-1", file=handle, response_format=fmt)
            handle.seek(0)
            assert reply.headers["content-type"] == f"{kind}; charset=utf-8", fmt
    with JFK.open("rb") as handle:
        verbose = client.audio.transcriptions.create(model="whisper-1", file=handle,
                                                     response_format="verbose_json")
    assert isinstance(verbose.duration, float) and verbose.duration == pytest.approx(11.0, 0.01)
    assert verbose.language == "english" and verbose.words is None
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
        translated = client.audio.translations.create(model="whisper-1", file=handle,
                                                      response_format="verbose_json")
    assert "country" in translated.text.lower() and translated.language == "english"
    listed = {model.id: model for model in client.models.list()}
    assert {"whisper-1", "faster-whisper/tiny.en", "gpt-4o-transcribe",
            "gpt-4o-mini-transcribe"} <= set(listed)
    for name in ("whisper-1", "faster-whisper/tiny.en", "gpt-4o-transcribe"):
        assert client.models.retrieve(name) == listed[name]
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found" and missing.value.param == "model"


def test_current_openai_model_and_voice_names(client: openai.OpenAI) -> None:
    """gpt-4o-transcribe and gpt-4o-mini-transcribe name the default ASR model (as
    whisper-1), gpt-4o-mini-tts the default TTS model (as tts-1); marin and cedar are voices."""
    with JFK.open("rb") as handle:
        body = client.audio.transcriptions.create(model="gpt-4o-transcribe", file=handle)
    assert wer(JFK_TEXT, body.text) <= 0.10
    assert body._request_id and len(body._request_id) >= 16  # the task's id, for support
    settings = Settings(redis_url="redis://127.0.0.1:1/0",
                        models={"faster-whisper": {"tiny.en": "bundled"},
                                "xtts": {"v2": "/nonexistent"}})
    asr = resolve_public_model(settings, "whisper-1", "asr")
    # every transcription model the SDK itself names, the realtime session's included (a
    # session.update naming one that was refused kept its format and turn detection too)
    from openai.types import AudioModel
    from openai.types.realtime.audio_transcription import AudioTranscription

    realtime = typing.get_args(AudioTranscription.model_fields["model"].annotation)
    sdk_names = set(typing.get_args(AudioModel)) | {
        name for option in realtime for name in typing.get_args(option)}
    assert {"gpt-realtime-whisper", "gpt-live-transcribe"} <= sdk_names
    for name in sdk_names:
        assert resolve_public_model(settings, name, "asr") == asr, name
    tts = resolve_public_model(settings, "tts-1", "tts")
    from openai.types.audio.speech_model import SpeechModel

    for name in typing.get_args(SpeechModel):  # every speech model the SDK names, too
        assert resolve_public_model(settings, name, "tts") == tts, name
    assert settings.voice("marin") and settings.voice("cedar")


def test_streaming_deltas_then_done(client: openai.OpenAI) -> None:
    with (TEST_AUDIO / "multilingual.mp3").open("rb") as handle:
        events = list(client.audio.transcriptions.create(model="whisper-1", file=handle,
                                                         stream=True))
    deltas = [e for e in events if e.type == "transcript.text.delta"]
    done = events[-1]
    assert len(deltas) >= 2 and done.type == "transcript.text.done"
    assert "".join(d.delta for d in deltas) == done.text  # the first has no leading space
    # the SDK's done event takes token usage only: none, with our metered seconds beside
    usage = done.usage.model_dump() if done.usage is not None else {}
    assert usage.pop("seconds") > 10 and usage == {
        "type": "tokens", "input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
        "input_token_details": None}


@pytest.fixture(scope="module")
def talk(workdir: Path) -> Path:
    """Two espeak-ng voices taking turns (harness/conversation.py)."""
    path = workdir / "openai-conversation.wav"
    conversation.build(path)
    return path


def test_diarized_json_speakers_are_letters_and_stream_as_segments(stack: dict,
                                                                   talk: Path) -> None:
    """Without known speaker names, speakers are A, B, … by first appearance (the task keeps
    SPEAKER_nn for the native routes); a diarized_json stream sends each segment's delta
    (with its segment_id) and its `transcript.text.segment` before `transcript.text.done`."""
    client = openai.OpenAI(base_url=f"{stack['gateway']}/v1", api_key="unused",
                           max_retries=0, timeout=240)
    with talk.open("rb") as handle:
        whole = client.audio.transcriptions.create(
            model="whisper-1", file=handle, response_format="diarized_json",
            extra_body={"num_speakers": 2})
    speakers = [segment.speaker for segment in whole.segments]
    assert speakers[0] == "A" and set(speakers) == {"A", "B"}, speakers
    with talk.open("rb") as handle:
        events = list(client.audio.transcriptions.create(
            model="whisper-1", file=handle, response_format="diarized_json", stream=True,
            extra_body={"num_speakers": 2}))
    types = [event.type for event in events]
    assert types[-1] == "transcript.text.done" and "error" not in types, types
    assert types[:-1] == ["transcript.text.delta", "transcript.text.segment"] * (
        len(types) // 2), types
    deltas, segments = events[:-1:2], events[1:-1:2]
    assert [d.segment_id for d in deltas] == [s.id for s in segments]
    assert segments[0].speaker == "A"
    assert {s.speaker for s in segments} <= {"A", "B"}
    assert all(s.start <= s.end and s.text for s in segments)
    assert "".join(d.delta for d in deltas).split() == events[-1].text.split()
    assert not deltas[0].delta.startswith(" ")


def test_sdk_raises_typed_errors(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing:
        client.audio.transcriptions.create(model="no-such-model", file=JFK.open("rb"))
    assert missing.value.message.count("/v1/models") == 1, missing.value.message
    with pytest.raises(openai.BadRequestError):
        client.audio.transcriptions.create(model="whisper-1", file=JFK.open("rb"),
                                           response_format="yaml")  # type: ignore[arg-type]
    with pytest.raises(openai.BadRequestError) as junk:
        client.audio.transcriptions.create(model="whisper-1", file=("x.wav", b"junk" * 100))
    # FFmpeg's words, not its error number or a file name the caller never had
    assert "Errno" not in junk.value.message and "<none>" not in junk.value.message


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
    # OpenAI's translations have no speakers (the SDK's diarized type says "transcribe")
    translated = http.post(url.replace("transcriptions", "translations"),
                           files={"file": JFK.open("rb")},
                           data={"response_format": "diarized_json"})
    assert _openai_error(translated, 400)["param"] == "response_format"
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


def test_sdk_does_not_retry_a_timed_out_call(keyed: str,
                                             redis_server: procs.RedisServer) -> None:
    """The 504 of a call past the request timeout says `x-should-retry: false`: the SDK (its
    default two retries) queues the upload once, and hands its caller the task id."""
    redis = redis_server.client()
    before = set(redis.scan_iter(match="sg:task:*"))
    sdk = openai.OpenAI(base_url=f"{keyed}/v1", api_key=KEY_A)  # max_retries: the default
    with pytest.raises(openai.InternalServerError) as timed_out:
        sdk.audio.transcriptions.create(model="whisper-1", file=JFK.open("rb"))
    reply = timed_out.value.response
    assert reply.status_code == 504 and reply.headers["x-should-retry"] == "false"
    task_id = reply.headers["x-task-id"]
    time.sleep(3)  # past the SDK's retry backoff (0.5 s, then 1 s): no second upload came
    assert set(redis.scan_iter(match="sg:task:*")) - before == {f"sg:task:{task_id}".encode()}
    wait_task(keyed, task_id, headers={"x-api-key": KEY_A})


def test_replies_of_failed_tasks_say_whether_to_retry(stack: dict) -> None:
    """Deterministic task failures and cancels are final (`x-should-retry: false`); the
    transient ones (a worker short of memory, no worker, …) keep the SDK's retries."""
    def reply(code: ErrorCode) -> dict[str, str]:
        state = TaskState.CANCELLED if code == ErrorCode.CANCELLED else TaskState.FAILED
        task = Task(id="t1", backend="faster-whisper", model="tiny.en", state=state,
                    error_code=code.value)
        return task_failed(task).headers or {}

    final = {ErrorCode.ENGINE_ERROR, ErrorCode.INVALID_REQUEST, ErrorCode.INVALID_AUDIO,
             ErrorCode.AUDIO_TOO_LONG, ErrorCode.DELIVERY_LIMIT, ErrorCode.QUOTA_EXCEEDED,
             ErrorCode.CANCELLED}
    for code in ErrorCode:
        assert (reply(code).get("x-should-retry") == "false") == (code in final), code
    assert (still_running("t1").headers or {})["x-should-retry"] == "false"
    # German for the English-only tiny.en: refused at the submit (it would fail on the
    # worker), with no task queued
    def tasks() -> int:
        return sum(1 for _ in stack["redis"].scan_iter(match=keys.task_pattern()))

    queued = tasks()
    refused = http.post(f"{stack['gateway']}/v1/audio/transcriptions", timeout=60,
                        files={"file": JFK.open("rb")}, data={"language": "de"})
    error = _openai_error(refused, 400)
    assert error["code"] == "unsupported_language" and error["param"] == "language", error
    assert "English-only" in error["message"] and "x-task-id" not in refused.headers
    assert tasks() == queued


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
    from common.audio import decode_audio, encode_wav

    redis = stack["redis"]
    before = set(redis.scan_iter(match="sg:task:*"))
    # 132 s of speech: its task outlasts the caller's 1.5 s on an idle machine too
    speech = decode_audio(JFK.read_bytes(), 16000, None)
    long_clip = encode_wav(np.concatenate([speech] * 12), 16000)
    with pytest.raises(httpx.ReadTimeout):
        http.post(f"{stack['gateway']}/v1/audio/transcriptions",
                   files={"file": ("long.wav", long_clip)}, timeout=1.5)
    new = wait_until(lambda: set(redis.scan_iter(match="sg:task:*")) - before, 10, "the task")
    (key,) = new
    task_id = key.decode().split(":", 2)[2]
    final = wait_done(stack["gateway"], task_id, timeout=120)
    assert final["status"] == "SUCCEEDED"
    time.sleep(0.5)
    assert http.get(f"{stack['gateway']}/v1/tasks/{task_id}").json()["attempts"] == 1
    assert json.loads(json.dumps(status(stack["gateway"], task_id)))["status"] == "SUCCEEDED"
