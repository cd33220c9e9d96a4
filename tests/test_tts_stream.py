"""Streamed `/v1/audio/speech` (issue 17): real redis-server, gateway and XTTS worker
(.venvs/xtts) on the tiny random checkpoint, which speaks each sentence in ~0.5 s of CPU.

What is proved without a clock: the worker's engine pauses once its first piece is stored
(the tiny XTTS worker's test hook, workers/engines/xtts.py `XTTS_TEST_PAUSE_DIR`), and the
first bytes still reach the client while the task is RUNNING with pieces left to speak; the
streamed audio is the stored WAV (pcm, wav) or decodes to its length
(mp3, opus, aac); a worker killed (SIGKILL) half-way and restarted resumes after the stored
pieces, so the client hears each sentence once, and the result is the very WAV an
uninterrupted task gives (sampling is seeded per sentence, so the tiny model on CPU repeats
itself exactly); a task that fails half-way ends its SSE stream with an `error` event.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import redis
from redis.asyncio import Redis

from common import keys
from common.audio import decode_audio, wav_pcm
from common.schemas import SpeechChunk, TaskState
from common.store import Task, TaskStore
from common.store.chunks import StaleAttempt
from harness import procs
from harness.http_client import http
from tests.helpers import TCP_ESTABLISHED, queue_counts, tcp_state

# The tiny checkpoint fixture (skips without .venvs/xtts; builds models/tiny/xtts if missing).
from tests.test_engine_xtts import XTTS_PYTHON, tiny_model  # noqa: F401
from workers.engines.xtts import PAUSE_DIR_VARIABLE

SENTENCES = ["The first sentence is here.", "A second one follows it.",
             "Then comes a third sentence.", "The fourth is next.", "A fifth is almost last.",
             "And the sixth ends it."]
TEXT = " ".join(SENTENCES)
SHORT = " ".join(SENTENCES[:2])  # two pieces: what the formats need to cross a piece's end
THREE = " ".join(SENTENCES[:3])  # one piece stored before a kill, two spoken after it
RATE = 24000
TIMEOUT = 180
T = TypeVar("T")
SPEECH = {"model": "tts-1", "input": TEXT, "voice": "alloy"}


@pytest.fixture(scope="module")
def stack(request: pytest.FixtureRequest,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    model_dir: Path = request.getfixturevalue("tiny_model")
    workdir = tmp_path_factory.mktemp("tts-stream")
    server = procs.RedisServer(workdir / "redis").start()
    models = {"xtts": {"tiny": str(model_dir)}}
    # "ash" is a speaker the tiny checkpoint lacks: its task fails before speaking
    voices = {"alloy": "speaker:Claribel Dervla", "ash": "speaker:Craig Gutsy"}
    gateway = procs.gateway(server.url, workdir, models=models, voices=voices)
    worker = procs.worker(server.url, workdir, backend="xtts", python=XTTS_PYTHON,
                          models=models, device="cpu", idle_unload_seconds="-1",
                          preload="true")
    pause = Pause(workdir / "pause")
    worker.env[PAUSE_DIR_VARIABLE] = str(pause.directory)
    try:
        gateway.start()
        worker.start()
        yield {"url": gateway.url, "worker": worker, "redis": server.client(), "server": server,
               "redis_url": server.url, "workdir": workdir, "models": models, "voices": voices,
               "pause": pause}
    finally:
        worker.stop()
        gateway.stop()
        server.stop()


def running_task(client: redis.Redis) -> str | None:
    for key in client.scan_iter(match=keys.task_pattern(), count=500):
        if client.hget(key, "state") == b"RUNNING":
            return (client.hget(key, "id") or b"").decode()
    return None


def stored_pcm(client: redis.Redis, task_id: str) -> bytes:
    return b"".join(fields[b"pcm"] for _, fields in
                    client.xrange(keys.speech_chunks(task_id)))


class Pause:
    """The worker's pause hook (workers/engines/xtts.py `_pause_if_armed`): armed, the next
    task the engine speaks stops once its first piece is stored, until released."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)

    def arm(self) -> None:
        (self.directory / "armed").touch()

    def wait(self, client: redis.Redis) -> str:
        """Once the engine has paused: the id of the task it paused in."""
        procs.wait_until((self.directory / "paused").exists, TIMEOUT,
                         "the engine to pause after its first piece", 0.01)
        task_id = running_task(client)
        assert task_id, "the engine paused in no running task"
        return task_id

    def release(self) -> None:
        (self.directory / "armed").unlink(missing_ok=True)
        (self.directory / "paused").unlink(missing_ok=True)


def sse_events(body: bytes) -> list[dict[str, Any]]:
    """The events of an SSE body (its keep-alive comments skipped)."""
    return [json.loads(block[len("data: "):]) for block in body.decode().split("\n\n")
            if block.startswith("data: ")]


def stored_wav(reply: httpx.Response) -> bytes:
    audio = http.get(reply.headers["x-output-url"], timeout=30)
    assert audio.status_code == 200, audio.text
    return audio.content


def stream(base: str, **body: Any) -> tuple[httpx.Response, bytes]:
    with http.stream("POST", f"{base}/v1/audio/speech", json={**SPEECH, **body},
                      timeout=TIMEOUT) as reply:
        return reply, b"".join(reply.iter_bytes())


def paused_stream(stack: dict[str, Any], text: str,
                  while_paused: Callable[[httpx.Response, bytes, str], None],
                  ) -> tuple[httpx.Response, bytes, str]:
    """A pcm stream of `text` whose engine pauses once its first piece is stored:
    `while_paused(reply, first bytes, task id)` runs then; (reply, whole body, task id)."""
    client, pause = stack["redis"], stack["pause"]
    pause.arm()
    try:
        with http.stream("POST", f"{stack['url']}/v1/audio/speech", timeout=TIMEOUT,
                          json={**SPEECH, "input": text, "response_format": "pcm",
                                "stream_format": "audio"}) as reply:
            assert reply.status_code == 200
            pieces = reply.iter_bytes()
            first = next(pieces)
            task_id = pause.wait(client)
            while_paused(reply, first, task_id)
            pause.release()
            body = first + b"".join(pieces)
    finally:
        pause.release()
    return reply, body, task_id


def test_the_first_piece_arrives_while_the_rest_is_spoken_and_pcm_is_the_wav(
        stack: dict[str, Any]) -> None:
    client = stack["redis"]

    def paused(reply: httpx.Response, first: bytes, task_id: str) -> None:
        assert reply.headers["content-type"] == f"audio/pcm; rate={RATE}"
        assert "content-length" not in reply.headers  # chunked
        # the engine waits before its second piece: nothing below changes until released
        assert reply.headers["x-task-id"] == task_id
        assert client.hget(keys.task(task_id), "state") == b"RUNNING"
        assert client.xlen(keys.speech_chunks(task_id)) == 1
        assert first and stored_pcm(client, task_id).startswith(first)

    reply, body, task_id = paused_stream(stack, SHORT, paused)
    pcm, rate = wav_pcm(stored_wav(reply))
    assert rate == RATE and body == pcm
    assert client.xlen(keys.speech_chunks(task_id)) == 2  # the rest was spoken after it
    # the WAV holds it now; the pieces linger a minute for streams still reading them
    assert 0 < client.pttl(keys.speech_chunks(task_id)) <= 60_000


def test_pieces_a_failover_lost_are_stored_again_and_the_task_goes_on(
        stack: dict[str, Any]) -> None:
    """A failover's new primary lacks the last pieces the old one acknowledged (taken here
    from the stream, as a promoted replica that never got them would be): the attempt stores
    them again and speaks on; it used to FAIL with "out of order" at its next piece."""
    client = stack["redis"]

    def lose_the_stored_piece(reply: httpx.Response, first: bytes, task_id: str) -> None:
        assert client.xlen(keys.speech_chunks(task_id)) == 1
        client.delete(keys.speech_chunks(task_id))

    reply, body, task_id = paused_stream(stack, THREE, lose_the_stored_piece)
    assert client.hget(keys.task(task_id), "state") == b"SUCCEEDED"
    pcm, _ = wav_pcm(stored_wav(reply))
    assert client.xlen(keys.speech_chunks(task_id)) == 3
    assert body == pcm == stored_pcm(client, task_id)  # each piece heard once, in order


def test_wav_mp3_opus_aac_and_sse_streams(stack: dict[str, Any]) -> None:
    reply, body = stream(stack["url"], input=SHORT, response_format="wav",
                         stream_format="audio")
    assert reply.status_code == 200 and reply.headers["content-type"] == "audio/wav"
    pcm, _ = wav_pcm(stored_wav(reply))
    header, samples = body[:44], body[44:]
    assert header[:4] == b"RIFF" and header[8:16] == b"WAVEfmt "
    assert struct.unpack("<I", header[4:8])[0] == struct.unpack("<I", header[40:44])[0] \
        == 0xFFFFFFFF  # sizes unknown while streaming
    assert samples == pcm
    seconds = len(pcm) / 2 / RATE
    assert len(decode_audio(body, RATE)) == len(pcm) // 2  # players read it to the end

    for fmt, content_type in (("mp3", "audio/mpeg"), ("opus", "audio/ogg; codecs=opus"),
                              ("aac", "audio/aac")):
        reply, body = stream(stack["url"], input=SHORT, response_format=fmt,
                             stream_format="audio")
        assert reply.status_code == 200 and reply.headers["content-type"] == content_type
        assert len(decode_audio(body, RATE)) / RATE == pytest.approx(seconds, abs=0.1), fmt

    reply, body = stream(stack["url"], input=SHORT, response_format="pcm", stream_format="sse")
    assert reply.headers["content-type"].startswith("text/event-stream")
    assert reply.headers["x-accel-buffering"] == "no"  # no proxy holds the events back
    events = sse_events(body)
    *deltas, done = events
    assert {event["type"] for event in deltas} == {"speech.audio.delta"} and len(deltas) > 1
    assert b"".join(base64.b64decode(event["audio"]) for event in deltas) == pcm
    # the same usage rule as a transcription stream's done event: no tokens, the metered
    # unit by name
    assert done == {"type": "speech.audio.done", "usage": {
        "type": "tokens", "input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
        "characters": len(SHORT)}}
    assert wav_pcm(stored_wav(reply))[0] == pcm  # seeded: every task speaks alike


def kill_after_first_piece(stack: dict[str, Any], seen: dict[str, Any], **env: str) -> None:
    """Once the running task has stored its first piece (the pause armed by the caller): note
    what is stored in `seen`, SIGKILL the paused worker and start it again (the same consumer
    name: it reads its own unacked entry first, unpaused), with `env` added to its
    environment."""
    client, worker, pause = stack["redis"], stack["worker"], stack["pause"]
    task_id = seen["task_id"] = pause.wait(client)
    seen["pieces"] = client.xlen(keys.speech_chunks(task_id))
    seen["pcm"] = stored_pcm(client, task_id)
    proc = worker.proc
    os.kill(worker.pid, signal.SIGKILL)
    proc.wait(30)
    pause.release()
    worker.env.update(env)
    worker.start()


def test_a_worker_killed_mid_stream_resumes_and_the_client_hears_each_sentence_once(
        stack: dict[str, Any]) -> None:
    worker = stack["worker"]
    _, whole = stream(stack["url"], input=THREE, response_format="pcm", stream_format="audio")
    before: dict[str, Any] = {}
    stack["pause"].arm()
    restarted = threading.Thread(target=kill_after_first_piece, args=(stack, before))
    restarted.start()
    try:
        reply, body = stream(stack["url"], input=THREE, response_format="pcm",
                             stream_format="audio")
    finally:
        restarted.join(TIMEOUT)
        stack["pause"].release()
    assert reply.status_code == 200
    task_id = reply.headers["x-task-id"]
    assert task_id == before["task_id"] and before["pieces"] == 1
    assert body.startswith(before["pcm"])  # what the first attempt spoke was kept
    pcm, _ = wav_pcm(stored_wav(reply))
    assert body == pcm  # no piece twice, none missing
    assert pcm == whole  # the resumed task spoke each sentence once, as a whole task does
    view = http.get(f"{stack['url']}/v1/tasks/{task_id}", timeout=10).json()
    assert view["status"] == "SUCCEEDED" and view["attempts"] == 2
    assert f"resuming after {before['pieces']} stored pieces" in worker.log()


def failing_after_first_piece(stack: dict[str, Any], call: Callable[[], T],
                              failed: dict[str, Any]) -> T:
    """`call`'s answer while its task fails half-way: the worker dies after the first piece
    and its replacement may deliver a task only once (SPEECH_MAX_DELIVERIES=1), so the task
    is FAILED delivery_limit; what was stored goes into `failed`. The worker is then started
    again as it was."""
    worker = stack["worker"]
    env = dict(worker.env)
    stack["pause"].arm()
    restarted = threading.Thread(target=kill_after_first_piece, args=(stack, failed),
                                 kwargs={"SPEECH_MAX_DELIVERIES": "1"})
    restarted.start()
    try:
        return call()
    finally:
        restarted.join(TIMEOUT)
        stack["pause"].release()
        worker.stop()
        worker.env = env
        worker.start()


def test_a_task_failing_mid_stream_ends_sse_with_an_error_event(
        stack: dict[str, Any]) -> None:
    """The task fails half-way (`failing_after_first_piece`): the SSE stream has the pieces
    spoken so far, then an `error` event; the task's pieces are dropped."""
    client = stack["redis"]
    failed: dict[str, Any] = {}
    reply, body = failing_after_first_piece(stack, lambda: stream(
        stack["url"], response_format="pcm", stream_format="sse"), failed)
    events = sse_events(body)
    *deltas, error = events
    assert failed["pieces"] == 1
    assert deltas and {event["type"] for event in deltas} == {"speech.audio.delta"}
    assert b"".join(base64.b64decode(event["audio"]) for event in deltas) == failed["pcm"]
    assert error["type"] == "error" and error["error"]["code"] == "delivery_limit", error
    task_id = failed["task_id"]
    assert reply.headers["x-task-id"] == task_id
    view = http.get(f"{stack['url']}/v1/tasks/{task_id}", timeout=10).json()
    assert view["status"] == "FAILED" and view["error_code"] == "delivery_limit"
    assert 0 < client.pttl(keys.speech_chunks(task_id)) <= 60_000
    # charged for what was delivered (issue 30): the characters of the pieces it spoke
    charge = json.loads(client.hget(keys.task(task_id), "charge"))
    assert charge["amount"] == sum(len(s) for s in SENTENCES[:failed["pieces"]]) > 0, charge


def test_a_redis_restart_mid_stream_is_waited_out(stack: dict[str, Any]) -> None:
    """Redis goes away for 2 s while the engine is between two pieces and the stream sends
    keep-alives every half second: each read of the stored pieces meets the outage and waits
    it out, and the stream ends with its done event (it was cut with no final event)."""
    gateway = procs.gateway(stack["redis_url"], stack["workdir"], models=stack["models"],
                            voices=stack["voices"], stream_keepalive_seconds="0.5").start()
    client, pause = stack["redis"], stack["pause"]
    body = b""
    try:
        pause.arm()
        with http.stream("POST", f"{gateway.url}/v1/audio/speech", timeout=TIMEOUT,
                          json={**SPEECH, "input": SHORT, "response_format": "pcm",
                                "stream_format": "sse"}) as reply:
            assert reply.status_code == 200
            chunks = reply.iter_bytes()
            while b"speech.audio.delta" not in body:
                body += next(chunks)
            pause.wait(client)
            stack["server"].restart(down_seconds=2.0)
            pause.release()
            body += b"".join(chunks)
        wav = stored_wav(reply)
    finally:
        pause.release()
        gateway.stop()
    events = sse_events(body)
    assert [event["type"] for event in events][-1] == "speech.audio.done", events[-1]
    pcm = b"".join(base64.b64decode(event["audio"]) for event in events
                   if event["type"] == "speech.audio.delta")
    assert pcm == wav_pcm(wav)[0]


def test_a_whole_file_call_failing_mid_task_keeps_no_charge(stack: dict[str, Any]) -> None:
    """The same failure without a stream: the piece spoken before it reached no one (the
    reply was to be the whole file), so none of the task's charge is kept."""
    failed: dict[str, Any] = {}
    reply = failing_after_first_piece(stack, lambda: http.post(
        f"{stack['url']}/v1/audio/speech", timeout=TIMEOUT,
        json={**SPEECH, "response_format": "wav"}), failed)
    assert failed["pieces"] == 1
    assert reply.status_code == 500 and reply.json()["error"]["code"] == "delivery_limit"
    charge = json.loads(stack["redis"].hget(keys.task(failed["task_id"]), "charge"))
    assert charge["amount"] == 0, charge


def test_clients_that_hang_up_or_read_nothing_leave_no_waiter_behind(
        stack: dict[str, Any]) -> None:
    """A gateway that keeps one call waiting at most (SPEECH_MAX_WAITING_REQUESTS=1): a
    stream whose client hangs up after its first piece, and then one whose client never
    reads (its socket buffers fill: 64 KB of send buffer, 2 s send timeout), each still runs
    its task to the end,
    WAV stored, and frees its waiter: the next call is served, not told 503."""
    gateway = procs.gateway(stack["redis_url"], stack["workdir"], models=stack["models"],
                            voices=stack["voices"], max_waiting_requests="1",
                            send_timeout_seconds="2", send_buffer_bytes="65536").start()
    client, base, pause = stack["redis"], gateway.url, stack["pause"]
    try:
        pause.arm()  # the client hangs up while its task has a piece left to speak
        try:
            with http.stream("POST", f"{base}/v1/audio/speech", timeout=TIMEOUT,
                              json={**SPEECH, "input": SHORT, "response_format": "pcm",
                                    "stream_format": "audio"}) as reply:
                assert reply.status_code == 200
                next(reply.iter_bytes())
                hung_up = reply.headers["x-task-id"]
                assert pause.wait(client) == hung_up
        finally:
            pause.release()
        procs.wait_until(lambda: client.hget(keys.task(hung_up), "state") == b"SUCCEEDED",
                         TIMEOUT, "the task of the stream that was hung up")
        assert wav_pcm(stored_wav(reply))[0]
        reply, body = stream(base, response_format="pcm", stream_format="audio", input="Hi.")
        assert reply.status_code == 200 and body, reply.status_code

        port = int(base.rsplit(":", 1)[1])
        silent = socket.socket()
        silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect
        silent.connect(("127.0.0.1", port))
        # ~0.8 MB as SSE: more than both sockets' buffers (64 KB sent, 4 KB received, each
        # doubled by the kernel) and the transport's own take
        request = json.dumps({**SPEECH, "input": " ".join(SENTENCES),
                              "response_format": "pcm", "stream_format": "sse"}).encode()
        silent.sendall(b"POST /v1/audio/speech HTTP/1.1\r\nHost: x\r\n"
                       b"Content-Type: application/json\r\n"
                       + f"Content-Length: {len(request)}\r\n\r\n".encode() + request)
        try:
            never_read = procs.wait_until(lambda: running_task(client), TIMEOUT, "its task")
            procs.wait_until(lambda: client.hget(keys.task(never_read), "state")
                             == b"SUCCEEDED", TIMEOUT, "the task of the unread stream")

            def served() -> bool:
                return stream(base, response_format="pcm", stream_format="audio",
                              input="Hi.")[0].status_code == 200

            procs.wait_until(served, 20, "the unread stream's waiter to be freed", 1.0)
            # and its socket goes too: asyncio's close waits for a drain that never comes
            procs.wait_until(lambda: tcp_state(silent) != TCP_ESTABLISHED, 30,
                             "the dropped stream's connection to be aborted", 0.5)
        finally:
            silent.close()
    finally:
        gateway.stop()


def test_bad_stream_requests_are_400_and_a_task_failing_before_audio_is_its_error(
        stack: dict[str, Any]) -> None:
    client, base = stack["redis"], stack["url"]
    before = queue_counts(client, "xtts")
    for body, param in (({"stream_format": "video"}, "stream_format"),
                        ({"stream_format": "sse", "response_format": "flac"}, "response_format"),
                        ({"stream_format": "audio", "response_format": "flac"},
                         "response_format")):
        reply = http.post(f"{base}/v1/audio/speech", json={**SPEECH, **body}, timeout=30)
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == param, reply.text
    assert queue_counts(client, "xtts") == before
    # no stream_format: flac is answered whole, as before
    whole = http.post(f"{base}/v1/audio/speech", json={**SPEECH, "input": "Hi there.",
                                                        "response_format": "flac"},
                       timeout=TIMEOUT)
    assert whole.status_code == 200 and whole.headers["content-length"]

    reply = http.post(f"{base}/v1/audio/speech", timeout=TIMEOUT,
                       json={**SPEECH, "voice": "ash", "stream_format": "audio"})
    assert reply.status_code == 400 and reply.json()["error"]["code"] == "invalid_request"
    assert "Craig Gutsy" in reply.json()["error"]["message"]


def test_only_the_running_attempt_appends_each_piece_once(tmp_path: Path) -> None:
    """The chunk record on a real Redis: appends in order by the current attempt; a retried
    append is a no-op; a stale attempt, a piece another attempt stored, a gap and a
    finished task are refused; readers get pieces from any index on."""
    server = procs.RedisServer(tmp_path / "redis").start()

    async def scenario() -> None:
        client = Redis.from_url(server.url)
        store = TaskStore(client, 3600)
        task = Task(id="t1", backend="xtts", model="tiny", state=TaskState.PENDING)
        await store.submit(task, None)
        piece = [SpeechChunk(i, bytes([i]) * 4, RATE) for i in range(4)]
        first = await store.start("t1", "w1", 1, "xtts")
        await store.speech.append("t1", first, piece[0])
        await store.speech.append("t1", first, piece[0])  # a retry after a lost reply
        with pytest.raises(RuntimeError, match="out of order"):
            await store.speech.append("t1", first, piece[2])
        second = await store.start("t1", "w2", 2, "xtts")  # redelivered
        with pytest.raises(StaleAttempt):
            await store.speech.append("t1", first, piece[1])
        with pytest.raises(RuntimeError, match="stored by another attempt"):
            await store.speech.append("t1", second, piece[0])
        await store.speech.append("t1", second, piece[1])
        assert await store.speech.read("t1") == piece[:2]
        assert await store.speech.read("t1", 1) == piece[1:2]
        assert await store.speech.read("t1", 2) == []
        assert 0 < await client.ttl(keys.speech_chunks("t1")) <= 3600
        assert await store.finish(task, TaskState.SUCCEEDED, attempt=second, entry_id="",
                                  result={})
        with pytest.raises(StaleAttempt):  # finished: nothing more is spoken
            await store.speech.append("t1", second, piece[2])
        await client.aclose()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_a_repeated_idempotency_key_cannot_stream_a_task_submitted_whole(
        stack: dict[str, Any]) -> None:
    """A task submitted whole is charged whole and refunded whole if it fails: a repeat of its
    idempotency key asking for a stream (which would hear its pieces as they are spoken,
    while nothing meters them) is a 409; a repeat that asks what the first asked gets the
    same task."""
    key = {"Idempotency-Key": "spoken-whole-once"}
    whole = http.post(f"{stack['url']}/api/xtts-submit", headers=key, timeout=TIMEOUT,
                      data={"text": SHORT, "voice": "alloy"})
    assert whole.status_code == 200, whole.text
    again = http.post(f"{stack['url']}/api/xtts-submit", headers=key, timeout=TIMEOUT,
                      data={"text": SHORT, "voice": "alloy"})
    assert again.json()["taskid"] == whole.json()["taskid"]
    streamed = http.post(f"{stack['url']}/v1/audio/speech", headers=key, timeout=TIMEOUT,
                         json={**SPEECH, "input": SHORT, "stream_format": "sse"})
    assert streamed.status_code == 409, streamed.text
    assert streamed.json()["error"]["code"] == "idempotency_key_reused"


def test_a_spoken_task_whose_audio_cannot_be_read_is_final(tmp_path: Path) -> None:
    """A speech task that SUCCEEDED (and was charged) but whose audio is gone or unreadable
    is a 500 with `x-should-retry: false`: the SDK retries a 500 twice, each retry a new task
    spoken and charged again, failing the same way."""
    from gateway.errors import RequestError
    from gateway.serving.speech_stream import _wav_tail

    server = procs.RedisServer(tmp_path / "redis").start()

    async def scenario() -> list[RequestError]:
        store = TaskStore(Redis.from_url(server.url), 3600)
        task = Task(id="t1", backend="xtts", model="tiny", state=TaskState.SUCCEEDED)
        refused = []
        for blob in (None, b"RIFF not a wav at all"):
            if blob is not None:
                await store.redis.set(keys.output_blob(task.id), blob)
            with pytest.raises(RequestError) as error:
                await _wav_tail(store, task, 0)
            refused.append(error.value)
        await store.redis.aclose()
        return refused

    try:
        for error in asyncio.run(scenario()):
            assert error.status_code == 500 and error.code == "audio_missing", error
            assert (error.headers or {}).get("x-should-retry") == "false", error.headers
    finally:
        server.stop()
