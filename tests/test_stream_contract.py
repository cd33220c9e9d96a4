"""One contract for every stream (`stream=true` transcription, streamed speech, realtime
turns): the same error code for the same task outcome, each segment once, a keep-alive while
queued, idempotent replays answered at once. Real redis-server, gateway and (where a task must
run) a real faster-whisper worker on the bundled tiny.en; a task that must stay queued has no
worker to run it, and its outcome comes from the store's own terminal writes."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import redis
import websockets
from redis.asyncio import Redis

from common import keys
from common.audio import decode_audio
from common.schemas import INTERACTIVE, ErrorCode, TaskState
from common.settings import DEFAULT_MODELS, Settings
from common.store import TaskStore
from common.store.segments import SegmentPublisher
from harness import procs
from harness.http_client import http
from harness.procs import TEST_AUDIO, wait_until
from tests.helpers import JFK, wait_task

KEEPALIVE = 1.0
MODELS = {**DEFAULT_MODELS, "xtts": {"v2": "/models/not-needed-by-the-gateway"}}
TRANSCRIPTION = "conversation.item.input_audio_transcription"


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A Redis and a gateway with a 1 s keep-alive; no worker unless a test starts one."""
    workdir = tmp_path_factory.mktemp("streams")
    server = procs.RedisServer(workdir / "redis").start()
    gateway = procs.gateway(server.url, workdir, models=MODELS,
                            stream_keepalive_seconds=str(KEEPALIVE),
                            no_worker_seconds="3600").start()
    yield {"redis": server, "url": gateway.url, "workdir": workdir,
           "client": server.client(), "ws": gateway.url.replace("http", "ws") + "/v1/realtime"}
    gateway.stop()
    server.stop()


def queued_ids(client: redis.Redis, backend: str) -> list[str]:
    entries = client.xrange(keys.queue(backend, INTERACTIVE))
    return [fields[b"task_id"].decode() for _, fields in entries]


def new_task(client: redis.Redis, backend: str, before: list[str]) -> str:
    found = wait_until(lambda: [t for t in queued_ids(client, backend) if t not in before],
                       30, f"a new {backend} task")
    return found[0]


def sse_events(lines: Iterator[str]) -> Iterator[dict[str, Any]]:
    for line in lines:
        if line.startswith("data: "):
            yield json.loads(line[len("data: "):])


def read_sse(url: str, path: str, body: dict[str, Any], files: Any = None,
             started: Future[str] | None = None) -> list[dict[str, Any]]:
    """Every event of a streamed reply (its x-task-id handed to `started` at once)."""
    kwargs: dict[str, Any] = {"data": body, "files": files} if files else {"json": body}
    with http.stream("POST", url + path, timeout=120, **kwargs) as reply:
        assert reply.status_code == 200, reply.read()
        # nothing may hold the events back: no cache, and no proxy buffering (nginx's)
        assert (reply.headers["cache-control"], reply.headers["x-accel-buffering"]) \
            == ("no-cache", "no")
        if started is not None:
            started.set_result(reply.headers["x-task-id"])
        return list(sse_events(reply.iter_lines()))


def transcription_stream(url: str, started: Future[str]) -> list[dict[str, Any]]:
    with JFK.open("rb") as handle:
        return read_sse(url, "/v1/audio/transcriptions",
                        {"model": "whisper-1", "stream": "true"},
                        files={"file": ("jfk.flac", handle.read())}, started=started)


def speech_stream(url: str, started: Future[str]) -> list[dict[str, Any]]:
    return read_sse(url, "/v1/audio/speech",
                    {"model": "tts-1", "input": "Hello there.", "voice": "alloy",
                     "response_format": "wav", "stream_format": "sse"}, started=started)


async def realtime_turn(ws_url: str, client: redis.Redis, started: Future[str],
                        deltas: list[str] | None = None) -> dict[str, Any]:
    """One manually committed turn of jfk.flac; its `...completed` or `...failed` event (and
    its deltas in `deltas`)."""
    pcm = (decode_audio(JFK, 24000)[:24000 * 3] * 32767).astype("<i2").tobytes()
    before = queued_ids(client, "faster-whisper")
    async with websockets.connect(ws_url + "?intent=transcription") as socket:
        await socket.send(json.dumps({"type": "session.update", "session": {
            "type": "transcription", "audio": {"input": {
                "format": {"type": "audio/pcm", "rate": 24000},
                "transcription": {"model": "whisper-1", "language": "en"},
                "turn_detection": None}}}}))
        await socket.send(json.dumps({"type": "input_audio_buffer.append",
                                      "audio": base64.b64encode(pcm).decode()}))
        await socket.send(json.dumps({"type": "input_audio_buffer.commit"}))
        task_id = await asyncio.to_thread(new_task, client, "faster-whisper", before)
        started.set_result(task_id)
        async for message in socket:
            event = json.loads(message)
            if event["type"] == f"{TRANSCRIPTION}.delta" and deltas is not None:
                deltas.append(event["delta"])
            if event["type"] in (f"{TRANSCRIPTION}.completed", f"{TRANSCRIPTION}.failed"):
                return event
    raise AssertionError("the session closed before its turn ended")


def end_task(env: dict[str, Any], task_id: str, outcome: str) -> None:
    """Cancel the queued task (DELETE, as a client does) or fail it with `outcome` through
    the store's own fenced terminal write (the sweeper's)."""
    if outcome == ErrorCode.CANCELLED:
        reply = http.delete(f"{env['url']}/v1/tasks/{task_id}", timeout=30)
        assert reply.status_code == 200, reply.text
        return

    async def fail() -> None:
        redis_client = Redis.from_url(env["redis"].url)
        store = TaskStore.for_settings(redis_client, Settings(redis_url=env["redis"].url))
        task = await store.get(task_id)
        assert task is not None
        assert await store.fail_if_unchanged(task, f"made to fail: {outcome}", outcome)
        await redis_client.aclose()
    asyncio.run(fail())


@pytest.mark.parametrize("outcome", [ErrorCode.CANCELLED, ErrorCode.OUT_OF_MEMORY,
                                     ErrorCode.DEADLINE_EXCEEDED])
def test_every_stream_reads_a_task_outcome_with_the_same_code(env: dict[str, Any],
                                                              outcome: ErrorCode) -> None:
    codes: dict[str, str] = {}
    with ThreadPoolExecutor(2) as pool:
        for name, run in [("transcription", transcription_stream), ("speech", speech_stream)]:
            started: Future[str] = Future()
            events = pool.submit(run, env["url"], started)
            task_id = started.result(60)
            end_task(env, task_id, outcome)
            *_, last = events.result(60)
            assert last["type"] == "error", (name, last)
            codes[name] = last["error"]["code"]
        started = Future()
        turn = pool.submit(asyncio.run, realtime_turn(env["ws"], env["client"], started))
        end_task(env, started.result(60), outcome)
        event = turn.result(60)
        assert event["type"] == f"{TRANSCRIPTION}.failed", event
        codes["realtime"] = event["error"]["code"]
    assert codes == {"transcription": outcome.value, "speech": outcome.value,
                     "realtime": outcome.value}


SEGMENTS = [" And so my fellow Americans,", " ask not", " what your country can do."]
TEXT = "And so my fellow Americans, ask not what your country can do."


def run_as_a_worker_losing_segments(env: dict[str, Any], task_id: str,
                                    published: list[int], texts: list[str] = SEGMENTS,
                                    ) -> None:
    """Play the worker through the store's own calls: attempt 1 publishes the SEGMENTS
    numbered in `published`, the others never reach the gateway (a message dropped while it
    reconnected, a publish given up after its wait), and the task SUCCEEDS with all of them.
    (Anything amiss fails the task, so that the stream waiting on it ends.)"""
    async def run() -> None:
        client = Redis.from_url(env["redis"].url)
        store = TaskStore.for_settings(client, Settings(redis_url=env["redis"].url))
        task = await store.get(task_id)
        assert task is not None
        attempt = await store.start(task_id, "w1", 1, "faster-whisper")
        assert attempt == 1
        segments = [{"id": number, "start": float(number), "end": number + 1.0, "text": text}
                    for number, text in enumerate(texts)]
        for number in published:  # (the worker's delta: the first text without its space)
            delta = texts[number] if any(texts[:number]) else texts[number].lstrip()
            await SegmentPublisher(client).publish(task_id, attempt, number + 1.0, {
                "type": "segment", **segments[number], "delta": delta})
        await asyncio.sleep(0.5)
        running = await store.get(task_id)
        assert running is not None
        await store.finish(running, TaskState.SUCCEEDED, attempt=attempt,
                           entry_id=running.entry_id,
                           result={"text": "".join(texts).strip(), "segments": segments,
                                   "language": "en",
                                   "duration": 3.0, "usage": {"audio_seconds": 3.0}})
        await client.aclose()
    try:
        asyncio.run(run())
    except BaseException:
        end_task(env, task_id, ErrorCode.OUT_OF_MEMORY)
        raise


@pytest.mark.parametrize("published", [[0], [0, 2], [1, 2]], ids=["last", "middle", "first"])
def test_segments_the_stream_never_got_are_sent_before_the_end(
        env: dict[str, Any], published: list[int]) -> None:
    """The deltas add up to the final text whichever segments' events were lost: after a
    lost one the stream holds the others back, and the rest of the text goes out as one
    more delta before the stream's last event (SSE and realtime)."""
    with ThreadPoolExecutor(1) as pool:
        started: Future[str] = Future()
        events = pool.submit(transcription_stream, env["url"], started)
        run_as_a_worker_losing_segments(env, started.result(60), published)
        streamed = events.result(60)
    deltas = [e["delta"] for e in streamed if e["type"] == "transcript.text.delta"]
    assert streamed[-1]["type"] == "transcript.text.done", streamed
    assert "".join(deltas) == streamed[-1]["text"] == TEXT, deltas
    with ThreadPoolExecutor(1) as pool:
        started = Future()
        live: list[str] = []
        turn = pool.submit(asyncio.run, realtime_turn(env["ws"], env["client"], started, live))
        run_as_a_worker_losing_segments(env, started.result(60), published)
        event = turn.result(60)
    assert event["type"] == f"{TRANSCRIPTION}.completed", event
    assert "".join(live) == event["transcript"] == TEXT, live


def test_a_first_segment_without_text_holds_nothing_back(env: dict[str, Any]) -> None:
    """A segment with no text first (an engine's blank one), published while the reply
    still waits for its first event (a 30 s keep-alive here): the reply waits past it for
    one with text, and the segments after it still stream as they come (it counted as a
    lost segment, and every delta waited for the end)."""
    (env["workdir"] / "blank").mkdir(exist_ok=True)
    gateway = procs.gateway(env["redis"].url, env["workdir"] / "blank", models=MODELS,
                            stream_keepalive_seconds="30", no_worker_seconds="3600").start()
    texts = ["", *SEGMENTS]
    try:
        before = queued_ids(env["client"], "faster-whisper")
        with ThreadPoolExecutor(1) as pool:
            events = pool.submit(transcription_stream, gateway.url, Future())
            task_id = new_task(env["client"], "faster-whisper", before)
            run_as_a_worker_losing_segments(env, task_id, [0, 1, 2, 3], texts)
            streamed = events.result(60)
    finally:
        gateway.stop()
    deltas = [e["delta"] for e in streamed if e["type"] == "transcript.text.delta"]
    assert deltas == [SEGMENTS[0].lstrip(), *SEGMENTS[1:]], deltas  # one each, as they came
    assert "".join(deltas) == streamed[-1]["text"] == TEXT


def test_a_streams_timeout_names_the_task_that_goes_on(env: dict[str, Any]) -> None:
    """Past the request timeout a stream ends with `task_timeout`, and, as the whole reply's
    body does, names the task that goes on (a realtime turn has no header to carry it)."""
    (env["workdir"] / "timeout").mkdir(exist_ok=True)
    gateway = procs.gateway(env["redis"].url, env["workdir"] / "timeout", models=MODELS,
                            request_timeout_seconds="2", no_worker_seconds="3600").start()
    try:
        started: Future[str] = Future()
        last = transcription_stream(gateway.url, started)[-1]
        assert last["type"] == "error" and last["error"]["code"] == "task_timeout", last
        assert last["task_id"] == started.result(1)
        started = Future()
        ws = gateway.url.replace("http", "ws") + "/v1/realtime"
        event = asyncio.run(realtime_turn(ws, env["client"], started))
        assert event["type"] == f"{TRANSCRIPTION}.failed", event
        assert event["error"]["code"] == "task_timeout" and event["task_id"] == started.result(1)
    finally:
        gateway.stop()


def test_an_outcome_before_a_streams_first_event_is_its_status(env: dict[str, Any]) -> None:
    """A streamed reply waits for its first segment, its end or one keep-alive interval: a
    task that fails before then answers with its own status and headers (a 503 the SDK
    retries), on a transcription stream as on a speech stream, not 200 and an `error` event."""
    (env["workdir"] / "held").mkdir(exist_ok=True)
    gateway = procs.gateway(env["redis"].url, env["workdir"] / "held", models=MODELS,
                            stream_keepalive_seconds="30", no_worker_seconds="3600").start()

    def status(path: str, backend: str, **kwargs: Any) -> httpx.Response:
        before = queued_ids(env["client"], backend)
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(http.post, gateway.url + path, timeout=60, **kwargs)
            end_task(env, new_task(env["client"], backend, before), ErrorCode.OUT_OF_MEMORY)
            return reply.result(60)

    try:
        with JFK.open("rb") as handle:
            transcribed = status("/v1/audio/transcriptions", "faster-whisper",
                                 data={"model": "whisper-1", "stream": "true"},
                                 files={"file": ("jfk.flac", handle.read())})
        spoken = status("/v1/audio/speech", "xtts",
                        json={"model": "tts-1", "input": "Hello there.", "voice": "alloy",
                              "response_format": "wav", "stream_format": "sse"})
    finally:
        gateway.stop()
    for reply in (transcribed, spoken):
        assert reply.status_code == 503, reply.text
        assert reply.json()["error"]["code"] == "out_of_memory" and reply.headers["x-task-id"]
        assert "x-should-retry" not in reply.headers  # (out_of_memory may pass next time)


def test_every_turn_ends_once_when_a_limit_ends_the_session(env: dict[str, Any]) -> None:
    """A session a limit ends (here its length) waits for its turns up to the request
    timeout, then closes: a turn still pending (the second waited first for the first
    turn's text) gets its `...failed` with the session's reason before the close, so every
    committed item has exactly one terminal event."""
    (env["workdir"] / "ending").mkdir(exist_ok=True)
    gateway = procs.gateway(env["redis"].url, env["workdir"] / "ending", models=MODELS,
                            request_timeout_seconds="3", realtime_max_session_seconds="2",
                            realtime_previous_turn_wait_seconds="10",
                            no_worker_seconds="3600").start()

    async def session() -> list[dict[str, Any]]:
        pcm = (decode_audio(JFK, 24000)[:12000] * 32767).astype("<i2").tobytes()
        seen = []
        ws = gateway.url.replace("http", "ws") + "/v1/realtime?intent=transcription"
        async with websockets.connect(ws) as socket:
            await socket.send(json.dumps({"type": "session.update", "session": {
                "type": "transcription", "audio": {"input": {
                    "transcription": {"model": "whisper-1", "language": "en"},
                    "turn_detection": None}}}}))
            for _ in range(2):
                await socket.send(json.dumps({"type": "input_audio_buffer.append",
                                              "audio": base64.b64encode(pcm).decode()}))
                await socket.send(json.dumps({"type": "input_audio_buffer.commit"}))
            with contextlib.suppress(websockets.ConnectionClosed):
                async for message in socket:
                    seen.append(json.loads(message))
        return seen

    try:
        seen = asyncio.run(asyncio.wait_for(session(), 60))
    finally:
        gateway.stop()
    items = [e["item"]["id"] for e in seen if e["type"] == "conversation.item.added"]
    ends = [e["item_id"] for e in seen if e["type"] in (f"{TRANSCRIPTION}.completed",
                                                          f"{TRANSCRIPTION}.failed")]
    assert len(items) == 2 and sorted(ends) == sorted(items), seen
    # the first turn's own wait ends at ~3 s (task_timeout); the second waited for it, so
    # its own would end at ~6 s, past the session's wait for its turns (~2 + 3 s)
    codes = [e["error"]["code"] for e in seen if e["type"] == f"{TRANSCRIPTION}.failed"]
    assert codes == ["task_timeout", "session_expired"], codes


def test_the_closing_delta_completes_what_the_stream_sent() -> None:
    from gateway.serving.calls import closing_delta

    for text, sent in (("A b c", "A b"), ("A b c", "A b "), ("A b", "A b "), ("A b", "A b"),
                       ("A b  c", "A b ")):
        assert (sent + closing_delta(text, sent)).rstrip() == text, (text, sent)
    assert closing_delta("A b c", "X") == ""  # not its prefix: the end's text stands


def test_diarized_deltas_add_up_to_the_text_whatever_the_pieces() -> None:
    """A diarized stream's deltas come from its segments' texts found in the final text; a
    piece not found there verbatim (rebuilt from words) or blank adds nothing twice."""
    from gateway.serving.transcription import _deltas

    for text, pieces in (("A B C", ["A", "X", "C"]),
                         ("Hello there. How are you?", [" Hello there.", " ", " How are you?"]),
                         ("one two three", [" one", " two"]),
                         ("one two", [" one", " two"])):
        deltas = _deltas(text, pieces)
        assert len(deltas) == len(pieces) and "".join(deltas) == text, (text, deltas)
    assert _deltas("one two", [" one", " two"]) == ["one", " two"]


def test_a_segment_with_no_speaker_is_not_the_first_speaker() -> None:
    """diarized_json letters the speakers A, B, … in order; a segment the diarizer found no
    speaker for (no speech the VAD heard there) read "A", the first real speaker's label."""
    from gateway.serving.transcription import Asked, _diarized, speakers_lettered

    segments = [{"id": 0, "start": 0.0, "end": 1.0, "text": " um", "speaker": None},
                {"id": 1, "start": 1.0, "end": 2.0, "text": " Hi.", "speaker": "SPEAKER_03"}]
    shown = [_diarized(segment) for segment in speakers_lettered(
        segments, Asked("transcribe", "diarized_json", set(), False))]
    assert [segment["speaker"] for segment in shown] == ["unknown", "A"]


def test_a_queued_stream_gets_keep_alives(env: dict[str, Any]) -> None:
    """Nothing runs the task: both SSE streams still send a comment at least every
    keep-alive interval (plus the hub's scheduling slack), from the first second on."""
    for path, body, files in [
            ("/v1/audio/transcriptions", {"model": "whisper-1", "stream": "true"},
             {"file": ("jfk.flac", JFK.read_bytes())}),
            ("/v1/audio/speech", {"model": "tts-1", "input": "Hello there.", "voice": "alloy",
                                  "response_format": "wav", "stream_format": "sse"}, None)]:
        kwargs: dict[str, Any] = {"data": body, "files": files} if files else {"json": body}
        sent = time.monotonic()
        arrivals: list[float] = []
        with http.stream("POST", env["url"] + path, timeout=30, **kwargs) as reply:
            assert reply.status_code == 200
            task_id = reply.headers["x-task-id"]
            for line in reply.iter_lines():
                if line.startswith(":"):
                    arrivals.append(time.monotonic())
                    if len(arrivals) == 4:
                        break
                else:
                    assert not line, f"only keep-alives while queued, not {line!r}"
        gaps = [later - earlier for earlier, later in zip([sent, *arrivals], arrivals,
                                                          strict=False)]
        assert max(gaps) < KEEPALIVE + 1.5, (path, gaps)
        end_task(env, task_id, ErrorCode.CANCELLED)


@pytest.fixture(scope="module")
def worker(env: dict[str, Any]) -> Iterator[procs.Service]:
    service = procs.worker(env["redis"].url, env["workdir"], idle_unload_seconds="-1",
                           preload="true", visibility_timeout_seconds="3",
                           allowed_roots=[str(TEST_AUDIO)]).start()
    yield service
    service.stop()


def test_an_idempotent_replay_is_answered_at_once(env: dict[str, Any],
                                                  worker: procs.Service) -> None:
    """The replay of a finished call is answered from its stored result: with the worker
    paused, so that nothing could run it again, it comes back at once, the same."""
    def call(timeout: float) -> httpx.Response:
        return http.post(f"{env['url']}/v1/audio/transcriptions", timeout=timeout,
                         headers={"Idempotency-Key": "replay-once"},
                         files={"file": ("jfk.flac", JFK.read_bytes())},
                         data={"model": "whisper-1"})

    first = call(120)
    assert first.status_code == 200, first.text
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        replay = call(15)  # a call that needed the worker would wait out the request timeout
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    assert replay.status_code == 200 and replay.json() == first.json()
    assert replay.headers["x-task-id"] == first.headers["x-task-id"]


def test_a_worker_killed_mid_stream_sends_each_segment_once(env: dict[str, Any],
                                                            worker: procs.Service) -> None:
    """The task is redelivered and publishes its segments again from id 0; the stream
    passes each id once, so its deltas add up to the final text."""
    clip = TEST_AUDIO / "multilingual.mp3"
    killed = threading.Event()
    deltas: list[str] = []
    with clip.open("rb") as handle, http.stream(
            "POST", f"{env['url']}/v1/audio/transcriptions", timeout=300,
            files={"file": (clip.name, handle.read())},
            data={"model": "whisper-1", "stream": "true", "language": "en"}) as reply:
        assert reply.status_code == 200
        task_id = reply.headers["x-task-id"]
        for event in sse_events(reply.iter_lines()):
            if event["type"] == "transcript.text.delta":
                deltas.append(event["delta"])
                if not killed.is_set():
                    killed.set()
                    assert worker.proc is not None
                    os.kill(worker.proc.pid, signal.SIGKILL)
                    worker.proc.wait(30)
                    worker.start()
            else:
                done = event
                break
    assert killed.is_set() and done["type"] == "transcript.text.done", done
    view = wait_task(env["url"], task_id)
    assert view["status"] == "SUCCEEDED" and view["attempts"] >= 2, view
    assert "".join(deltas).strip() == done["text"].strip()
    assert len(deltas) == len(view["result"]["segments"])
