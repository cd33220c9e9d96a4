"""Live transcription over a WebSocket (`/v1/realtime?intent=transcription`, issue 17): the
`openai` SDK's realtime client and a raw `websockets` client, against a real redis-server,
gateway and faster-whisper worker (the bundled tiny.en). jfk.flac is streamed as 24 kHz PCM16
in 100 ms chunks: in real time where the test is about live streaming, faster elsewhere (the
server VAD is driven by the audio, not the clock)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import time
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import websockets
from openai.types.realtime import (
    ConversationItemInputAudioTranscriptionCompletedEvent,
    InputAudioBufferCommittedEvent,
)

from common import keys
from common.audio import decode_audio
from common.settings import Settings
from gateway.auth import digest
from gateway.realtime.buffer import InputBuffer, decode_pcm16
from gateway.realtime.protocol import ProtocolError, max_message_bytes
from harness import procs
from harness.http_client import http
from harness.procs import TEST_AUDIO, wait_until
from tests.helpers import JFK, JFK_TEXT, TCP_ESTABLISHED, tcp_state, wait_task, wer

KEY = "live-key-0123456789"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHUNK_SECONDS = 0.1
VISIBILITY = 3.0
TRANSCRIPTION = "conversation.item.input_audio_transcription"
#: the pauses in jfk.flac last up to ~1.1 s: longer silence makes the whole clip one turn
ONE_TURN_VAD = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300,
                "silence_duration_ms": 1500}


def pcm(path: Path, rate: int = 24000, seconds: float | None = None,
        silence: float = 2.0) -> bytes:
    """`path` as PCM16 LE mono at `rate`, cut to `seconds`, then `silence` s of zeros."""
    audio = decode_audio(path, rate)
    if seconds is not None:
        audio = audio[:int(seconds * rate)]
    audio = np.concatenate([audio, np.zeros(int(silence * rate), np.float32)])
    return (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()


def chunks(data: bytes, rate: int = 24000) -> list[str]:
    size = int(rate * CHUNK_SECONDS) * 2
    return [base64.b64encode(data[i:i + size]).decode() for i in range(0, len(data), size)]


#: live turns take the interactive lane only for a key allowed it
LIVE_KEY = {"key": f"sha256:{digest(KEY)}", "interactive": True}


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A Redis, a keyed gateway and a preloaded worker with a short visibility timeout (a
    test may replace the worker: the one in `live["worker"]` is stopped at the end)."""
    workdir = tmp_path_factory.mktemp("realtime")
    server = procs.RedisServer(workdir / "redis").start()
    gateway = procs.gateway(server.url, workdir, api_keys=[LIVE_KEY]).start()
    env: dict[str, Any] = {"redis": server, "gateway": gateway.url, "workdir": workdir,
                           "ws": gateway.url.replace("http://", "ws://") + "/v1/realtime"}
    env["worker"] = start_worker(env)
    yield env
    env["worker"].stop()
    gateway.stop()
    server.stop()


def start_worker(env: dict[str, Any]) -> procs.Service:
    return procs.worker(env["redis"].url, env["workdir"], idle_unload_seconds="-1",
                        preload="true", visibility_timeout_seconds=str(VISIBILITY)).start()


# --- a raw client --------------------------------------------------------------------------

class Raw:
    """A `websockets` client that records every server event (with its arrival time)."""

    def __init__(self, socket: websockets.ClientConnection) -> None:
        self.socket = socket
        self.events: list[dict[str, Any]] = []
        self.reader = asyncio.ensure_future(self._read())

    async def _read(self) -> None:
        async for message in self.socket:
            event = json.loads(message)
            event["_at"] = time.time()
            self.events.append(event)

    async def send(self, **event: Any) -> None:
        await self.socket.send(json.dumps(event))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == kind]

    async def wait(self, predicate: Callable[[], Any], timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.reader.done():
                self.reader.result()  # the socket closed: raise its error, if any
                raise AssertionError(f"closed before the condition: {self.types()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out; events: {self.types()}")
            await asyncio.sleep(0.02)

    async def next_error(self, after: int) -> dict[str, Any]:
        await self.wait(lambda: len(self.of("error")) > after, 10)
        return self.of("error")[after]

    def types(self) -> list[str]:
        return [e["type"] for e in self.events]

    def all_answered(self) -> bool:
        """Every committed item has its completed or failed event."""
        done = {e["item_id"] for e in self.events
                if e["type"] in (f"{TRANSCRIPTION}.completed", f"{TRANSCRIPTION}.failed")}
        return bool(self.of("input_audio_buffer.committed")) and done >= {
            e["item_id"] for e in self.of("input_audio_buffer.committed")}


async def connect(env: dict[str, Any], headers: dict[str, str] | None = AUTH,
                  subprotocols: list[str] | None = None, url: str | None = None) -> Raw:
    socket = await websockets.connect(f"{url or env['ws']}?intent=transcription",
                                      additional_headers=headers,
                                      subprotocols=subprotocols)  # type: ignore[arg-type]
    client = Raw(socket)
    await client.wait(lambda: client.of("session.created"))
    return client


async def configure(client: Raw, turn_detection: dict[str, Any] | None,
                    rate: int = 24000) -> None:
    count = len(client.of("session.updated"))
    await client.send(type="session.update", session={
        "type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": rate},
            "transcription": {"model": "whisper-1", "language": "en"},
            "turn_detection": turn_detection}}})
    await client.wait(lambda: len(client.of("session.updated")) > count, 10)


async def stream(client: Raw, data: bytes, rate: int = 24000, real_time: bool = False) -> float:
    """Append `data` in 100 ms chunks; returns the wall time the last chunk went out."""
    start = time.monotonic()
    for i, chunk in enumerate(chunks(data, rate)):
        if real_time:
            await asyncio.sleep(max(0.0, start + i * CHUNK_SECONDS - time.monotonic()))
        await client.send(type="input_audio_buffer.append", audio=chunk)
    return time.time()


def joined_transcript(client: Raw) -> str:
    texts = {e["item_id"]: e["transcript"] for e in client.of(f"{TRANSCRIPTION}.completed")}
    return " ".join(texts[e["item_id"]] for e in client.of("input_audio_buffer.committed"))


def check_turn_events(client: Raw, vad: bool) -> None:
    """The protocol's order per item; exactly one completed per committed item; deltas that
    add up to its transcript."""
    committed = [e["item_id"] for e in client.of("input_audio_buffer.committed")]
    completed = [e["item_id"] for e in client.of(f"{TRANSCRIPTION}.completed")]
    assert sorted(completed) == sorted(committed) and len(set(committed)) == len(committed)
    assert not client.of(f"{TRANSCRIPTION}.failed") and not client.of("error")
    if vad:
        assert [e["item_id"] for e in client.of("input_audio_buffer.speech_started")] == committed
        assert [e["item_id"] for e in client.of("input_audio_buffer.speech_stopped")] == committed
    else:
        assert not client.of("input_audio_buffer.speech_started")
    previous = None
    for event in client.of("input_audio_buffer.committed"):  # a chain, in commit order
        assert event["previous_item_id"] == previous
        previous = event["item_id"]
    for item in committed:
        types = [e["type"] for e in client.events if e.get("item_id") == item]
        assert (types.index("input_audio_buffer.committed")
                < types.index(f"{TRANSCRIPTION}.completed")), types
        deltas = [e["delta"] for e in client.of(f"{TRANSCRIPTION}.delta") if e["item_id"] == item]
        done = next(e for e in client.of(f"{TRANSCRIPTION}.completed") if e["item_id"] == item)
        assert deltas and "".join(deltas).strip() == done["transcript"].strip()
        assert done["usage"]["type"] == "duration" and done["usage"]["seconds"] > 0
        assert done["content_index"] == 0
    for event in client.events:
        assert event["event_id"].startswith("event_")


# --- the openai SDK ----------------------------------------------------------------------------

def sdk(env: dict[str, Any], key: str = KEY) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(api_key=key, base_url=f"{env['gateway']}/v1", max_retries=0)


async def sdk_session(env: dict[str, Any], turn_detection: dict[str, Any] | None,
                      real_time: bool) -> list[Any]:
    """Stream jfk.flac through the SDK's realtime client; every event it parsed, in order."""
    client = sdk(env)
    events: list[Any] = []
    async with client.realtime.connect(extra_query={"intent": "transcription"}) as connection:
        await connection.session.update(session={
            "type": "transcription", "audio": {"input": {
                "format": {"type": "audio/pcm", "rate": 24000},
                "transcription": {"model": "whisper-1", "language": "en"},
                "turn_detection": turn_detection}}})  # type: ignore[typeddict-item]

        async def send() -> None:
            start = time.monotonic()
            for i, chunk in enumerate(chunks(pcm(JFK))):
                if real_time:
                    await asyncio.sleep(max(0.0, start + i * CHUNK_SECONDS - time.monotonic()))
                await connection.input_audio_buffer.append(audio=chunk)
            if turn_detection is None:
                await connection.input_audio_buffer.commit()

        sender = asyncio.ensure_future(send())
        async with asyncio.timeout(120):
            async for event in connection:
                events.append(event)
                committed = {e.item_id for e in events
                             if isinstance(e, InputAudioBufferCommittedEvent)}
                finished = {e.item_id for e in events if e.type.startswith(TRANSCRIPTION)
                            and e.type.endswith(("completed", "failed"))}
                if sender.done() and committed and finished >= committed:
                    break
        await sender
    return events


def check_sdk_events(events: list[Any], vad: bool) -> None:
    types = [e.type for e in events]
    assert types[:2] == ["session.created", "session.updated"], types
    assert events[1].session.type == "transcription"
    assert events[1].session.audio.input.transcription.model == "whisper-1"
    assert "error" not in types and f"{TRANSCRIPTION}.failed" not in types, events
    if vad:
        assert {"input_audio_buffer.speech_started",
                "input_audio_buffer.speech_stopped"} <= set(types), types
    else:
        assert "input_audio_buffer.speech_started" not in types
    assert f"{TRANSCRIPTION}.delta" in types
    completed = [e for e in events
                 if isinstance(e, ConversationItemInputAudioTranscriptionCompletedEvent)]
    assert len(completed) == 1, types
    assert wer(JFK_TEXT, completed[0].transcript) <= 0.10, completed[0].transcript
    assert completed[0].usage.type == "duration" and completed[0].usage.seconds > 10


def test_sdk_client_streams_in_real_time_with_server_vad(live: dict[str, Any]) -> None:
    check_sdk_events(asyncio.run(sdk_session(live, ONE_TURN_VAD, real_time=True)), vad=True)


def test_sdk_client_with_manual_commits(live: dict[str, Any]) -> None:
    check_sdk_events(asyncio.run(sdk_session(live, None, real_time=False)), vad=False)


# --- a raw websockets client -------------------------------------------------------------------

def test_raw_client_streams_in_real_time_with_server_vad(live: dict[str, Any]) -> None:
    async def run() -> None:
        # the browser's form: the key as a subprotocol next to "realtime"
        client = await connect(live, headers=None,
                               subprotocols=["realtime", f"openai-insecure-api-key.{KEY}"])
        assert client.socket.subprotocol == "realtime"
        created = client.of("session.created")[0]["session"]
        assert created["type"] == "transcription"
        assert created["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 24000}
        await configure(client, ONE_TURN_VAD)
        await stream(client, pcm(JFK), real_time=True)
        await client.wait(client.all_answered, 60)
        await client.socket.close()
        check_turn_events(client, vad=True)
        assert len(client.of("input_audio_buffer.committed")) == 1
        started = client.of("input_audio_buffer.speech_started")[0]
        stopped = client.of("input_audio_buffer.speech_stopped")[0]
        # speech begins at ~0.35 s (less 300 ms of padding) and ends at ~10.6 s (+1.5 s)
        assert 0 <= started["audio_start_ms"] < 1000, started
        assert 11000 < stopped["audio_end_ms"] < 13000, stopped
        assert wer(JFK_TEXT, client.of(f"{TRANSCRIPTION}.completed")[0]["transcript"]) <= 0.10

    asyncio.run(run())


def test_raw_client_with_manual_commits_at_16_khz(live: dict[str, Any]) -> None:
    async def run() -> None:
        client = await connect(live)
        await configure(client, None, rate=16000)
        await stream(client, pcm(JFK, rate=16000), rate=16000)
        await client.send(type="input_audio_buffer.commit", event_id="commit-1")
        await client.wait(client.all_answered, 60)
        await client.socket.close()
        check_turn_events(client, vad=False)
        assert wer(JFK_TEXT, joined_transcript(client)) <= 0.10

    asyncio.run(run())


def test_a_manual_commit_during_detected_speech_commits_that_speech(
        live: dict[str, Any]) -> None:
    """Server VAD has seen speech start (its item named in speech_started) and the client
    commits before it stops: the committed item is the one that started, not a new one."""
    async def run() -> None:
        client = await connect(live)
        await configure(client, ONE_TURN_VAD)
        await stream(client, pcm(JFK)[:4 * 24000 * 2])  # 4 s: speech under way, no pause
        await client.wait(lambda: client.of("input_audio_buffer.speech_started"), 30)
        await client.send(type="input_audio_buffer.commit", event_id="commit-1")
        await client.wait(lambda: client.of("input_audio_buffer.committed")
                          and client.all_answered(), 60)
        await client.socket.close()
        started = client.of("input_audio_buffer.speech_started")
        committed = client.of("input_audio_buffer.committed")
        assert len(started) == len(committed) == 1
        assert committed[0]["item_id"] == started[0]["item_id"]

    asyncio.run(run())


def test_server_vad_cuts_turns_at_pauses(live: dict[str, Any]) -> None:
    """The default 500 ms of silence splits jfk.flac at its pauses: several turns, each
    committed after the one before, each completed once; together the whole text."""
    async def run() -> None:
        client = await connect(live)
        await stream(client, pcm(JFK))  # the defaults: server VAD, 24 kHz, whisper-1
        await client.wait(lambda: client.of("input_audio_buffer.speech_stopped")
                          and len(client.of("input_audio_buffer.speech_started"))
                          == len(client.of("input_audio_buffer.speech_stopped"))
                          and client.all_answered(), 60)
        await client.socket.close()
        check_turn_events(client, vad=True)
        assert len(client.of("input_audio_buffer.committed")) >= 2
        assert wer(JFK_TEXT, joined_transcript(client)) <= 0.10

    def used() -> float:
        reply = http.get(f"{live['gateway']}/v1/usage", headers=AUTH, timeout=30)
        return float(reply.json()["day"]["audio_seconds"]["used"])

    before = used()
    asyncio.run(run())
    # every second sent (11 s of speech, 2 s of silence) is charged once: the turns as
    # their tasks, the pauses the VAD dropped and the tail left at the close by the session
    charged = wait_until(lambda: (found := used() - before) >= 12.9 and found, 10,
                         "the session's last charge", 0.1)
    assert charged <= 13.1, charged


# --- keys, bad input, limits ----------------------------------------------------------------

def test_wrong_key_is_closed_with_policy_violation(live: dict[str, Any]) -> None:
    async def refused(**kwargs: Any) -> websockets.ConnectionClosed:
        socket = await websockets.connect(f"{live['ws']}?intent=transcription", **kwargs)
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await socket.send(json.dumps({"type": "input_audio_buffer.append", "audio": ""}))
            await socket.recv()  # no session.created: closed before any event
        return closed.value

    async def run() -> None:
        for kwargs in ({}, {"additional_headers": {"Authorization": "Bearer wrong"}},
                       {"subprotocols": ["realtime", "openai-insecure-api-key.wrong"]}):
            closed = await refused(**kwargs)
            assert closed.rcvd is not None and closed.rcvd.code == 1008, (kwargs, closed)
            assert "API key" in closed.rcvd.reason
        with pytest.raises(websockets.ConnectionClosed) as sdk_closed:  # the SDK's too
            async with sdk(live, "wrong").realtime.connect(
                    extra_query={"intent": "transcription"}) as connection:
                await connection.recv()
        assert sdk_closed.value.rcvd is not None and sdk_closed.value.rcvd.code == 1008

    asyncio.run(run())
    # plain HTTP: behind the key like every route, then told to upgrade
    assert http.get(f"{live['gateway']}/v1/realtime").status_code == 401
    reply = http.get(f"{live['gateway']}/v1/realtime", headers=AUTH)
    assert reply.status_code == 426 and reply.json()["error"]["code"] == "upgrade_required"


def test_bad_events_get_error_events_and_the_session_survives(live: dict[str, Any]) -> None:
    async def run() -> None:
        client = await connect(live)
        cases: list[tuple[Any, str, str | None]] = [
            ("{not json", "invalid_json", None),
            ([1, 2], "invalid_json", None),
            ({"event_id": "e1"}, "missing_required_parameter", "type"),
            ({"type": "response.create", "event_id": "e2"}, "invalid_value", "type"),
            ({"type": "input_audio_buffer.append", "audio": "%%%notbase64", "event_id": "e3"},
             "invalid_base64", "audio"),
            ({"type": "input_audio_buffer.append", "audio": base64.b64encode(b"abc").decode(),
              "event_id": "e4"}, "invalid_audio", "audio"),
            ({"type": "input_audio_buffer.append", "audio": 12, "event_id": "e5"},
             "invalid_type", "audio"),
            ({"type": "input_audio_buffer.append", "event_id": "e5b"},
             "missing_required_parameter", "audio"),
            ({"type": "session.update", "event_id": "e6", "session": {
                "type": "transcription", "audio": {"input": {"format": {
                    "type": "audio/pcm", "rate": 44100}}}}},
             "invalid_value", "session.audio.input.format.rate"),
            ({"type": "session.update", "event_id": "e7", "session": {"type": "realtime"}},
             "invalid_value", "session.type"),
            ({"type": "session.update", "event_id": "e8", "session": {
                "type": "transcription", "audio": {"input": {"turn_detection": {
                    "type": "push_to_talk"}}}}},
             "invalid_value", "session.audio.input.turn_detection.type"),
            ({"type": "session.update", "event_id": "e9", "session": {
                "type": "transcription", "audio": {"input": {"turn_detection": {
                    "type": "server_vad", "threshold": 7}}}}},
             "invalid_value", "session.audio.input.turn_detection.threshold"),
            ({"type": "session.update", "event_id": "e10", "session": {
                "type": "transcription", "audio": {"input": {"transcription": {
                    "model": "no-such-model"}}}}},
             "invalid_value", "session.audio.input.transcription.model"),
            ({"type": "session.update", "event_id": "e11", "session": {
                "type": "transcription", "audio": {"input": {"transcription": {
                    "model": "whisper-1", "language": "xx"}}}}},
             "invalid_value", "session.audio.input.transcription.language"),
            ({"type": "input_audio_buffer.commit", "event_id": "e12"},
             "input_audio_buffer_commit_empty", None),
        ]
        for number, (body, code, param) in enumerate(cases):
            await client.socket.send(body if isinstance(body, str) else json.dumps(body))
            error = await client.next_error(number)
            assert set(error) == {"type", "event_id", "error", "_at"}, error
            detail = error["error"]
            assert set(detail) == {"type", "code", "message", "param", "event_id"}, detail
            assert detail["type"] == "invalid_request_error", detail
            assert (detail["code"], detail["param"]) == (code, param), (body, detail)
            assert detail["message"], detail
            expected_id = body.get("event_id") if isinstance(body, dict) else None
            assert detail["event_id"] == expected_id, (body, detail)
        await client.socket.send(b"\x00\x01")  # a binary frame is not an event
        binary = await client.next_error(len(cases))
        assert binary["error"]["code"] == "invalid_json"
        # the session goes on: unchanged by the refused updates, and it still transcribes
        await configure(client, None)
        updated = client.of("session.updated")[-1]["session"]
        assert updated["audio"]["input"]["format"]["rate"] == 24000
        assert updated["audio"]["input"]["transcription"]["model"] == "whisper-1"
        await stream(client, pcm(JFK))
        await client.send(type="input_audio_buffer.commit")
        await client.wait(client.all_answered, 60)
        assert wer(JFK_TEXT, joined_transcript(client)) <= 0.10
        # clear: the buffer is emptied, so a commit right after finds nothing
        await stream(client, pcm(JFK, seconds=1.0, silence=0))
        await client.send(type="input_audio_buffer.clear")
        await client.wait(lambda: client.of("input_audio_buffer.cleared"), 10)
        errors = len(client.of("error"))
        await client.send(type="input_audio_buffer.commit")
        assert (await client.next_error(errors))["error"]["code"] == \
            "input_audio_buffer_commit_empty"
        await client.socket.close()

    asyncio.run(run())


@pytest.fixture(scope="module")
def limited(live: dict[str, Any]) -> Iterator[str]:
    """A second gateway on the same Redis and worker, with small session limits."""
    gateway = procs.gateway(live["redis"].url, live["workdir"],
                            api_keys=[LIVE_KEY],
                            realtime_max_buffer_seconds="1.5", realtime_max_session_seconds="5",
                            realtime_idle_timeout_seconds="1.5",
                            realtime_max_sessions="2", send_timeout_seconds="2",
                            # the process's cap is under test, not one key's share of it
                            realtime_key_share="1").start()
    yield gateway.url.replace("http://", "ws://") + "/v1/realtime"
    gateway.stop()


def test_buffer_and_session_limits(live: dict[str, Any], limited: str) -> None:
    async def run() -> None:
        client = await connect(live, url=limited)
        await configure(client, None)
        await stream(client, pcm(JFK, seconds=1.2, silence=0))
        # past the buffer limit: refused, nothing added; the session goes on
        errors = len(client.of("error"))
        await client.send(type="input_audio_buffer.append", event_id="big",
                          audio=base64.b64encode(pcm(JFK, seconds=0.5, silence=0)).decode())
        error = (await client.next_error(errors))["error"]
        assert (error["code"], error["param"], error["event_id"]) == (
            "input_audio_buffer_full", "audio", "big")
        await client.send(type="input_audio_buffer.commit")
        await client.wait(client.all_answered, 60)
        assert client.of(f"{TRANSCRIPTION}.completed")[0]["usage"]["seconds"] < 1.5
        # with server VAD, speech longer than the buffer is cut into turns at its limit
        await configure(client, {"type": "server_vad"})
        await stream(client, pcm(JFK, seconds=2.3, silence=0.6))
        await client.wait(lambda: len(client.of("input_audio_buffer.committed")) >= 2, 20)
        started = client.of("input_audio_buffer.speech_started")[0]
        stopped = client.of("input_audio_buffer.speech_stopped")[0]
        assert 0 < stopped["audio_end_ms"] - started["audio_start_ms"] <= 1500
        # audio past the session's length (5 s): an error naming it, then the socket closes
        # once the turns already committed are answered
        await stream(client, pcm(JFK, seconds=3.0, silence=0))
        await client.wait(lambda: client.reader.done(), 60)
        ended = [e["error"] for e in client.of("error") if e["error"]["code"] == "session_expired"]
        assert ended and "5 s" in ended[0]["message"], client.of("error")
        assert client.socket.close_code == 1000
        assert client.all_answered()

        # idle: no event for 1.5 s ends the session
        idle = await connect(live, url=limited)
        await idle.wait(lambda: idle.reader.done(), 10)
        assert idle.of("error")[0]["error"]["code"] == "idle_timeout"

        # at most 2 sessions per gateway process: the third is told to retry
        first, second = await connect(live, url=limited), await connect(live, url=limited)
        socket = await websockets.connect(f"{limited}?intent=transcription",
                                          additional_headers=AUTH)
        third = Raw(socket)
        await third.wait(lambda: third.reader.done(), 10)
        assert third.of("error")[0]["error"]["code"] == "too_many_sessions"
        assert socket.close_code == 1013
        for open_client in (first, second):
            await open_client.socket.close()

    asyncio.run(run())


def test_hostile_messages_are_refused_and_an_oversized_one_is_never_read(
        live: dict[str, Any], limited: str) -> None:
    """The limited gateway's buffer is 1.5 s, so uvicorn takes messages of at most
    max_message_bytes(1.5) (a whole buffer at 24 kHz, base64, + 64 KiB), not its 16 MiB."""
    limit = max_message_bytes(1.5)
    assert limit < 200_000

    async def run() -> None:
        client = await connect(live, url=limited)
        cases: list[tuple[dict[str, Any], str, str]] = [
            ({"type": "input_audio_buffer.append", "audio": "AAAA AAAA"}, "invalid_base64",
             "audio"),
            ({"type": "input_audio_buffer.append", "audio": "AAAA\nAAAA"}, "invalid_base64",
             "audio"),
            ({"type": "input_audio_buffer.append", "audio": "AAA"}, "invalid_base64", "audio"),
            ({"type": "session.update", "session": {"type": "transcription", "audio": {
                "input": {"transcription": {"prompt": "p" * 5000}}}}}, "invalid_value",
             "session.audio.input.transcription.prompt"),
            ({"type": "session.update", "session": {"type": "transcription", "audio": {
                "input": {"transcription": {"model": "m" * 100_000}}}}}, "invalid_value",
             "session.audio.input.transcription.model"),
            ({"type": "session.update", "session": {"type": "transcription", "audio": {
                "input": {"transcription": {"language": "l" * 100_000}}}}}, "invalid_value",
             "session.audio.input.transcription.language"),
            ({"type": "input_audio_buffer.commit"}, "input_audio_buffer_commit_empty", ""),
        ]
        for number, (body, code, param) in enumerate(cases):
            await client.send(**body)
            error = (await client.next_error(number))["error"]
            assert (error["code"], error["param"] or "") == (code, param), (body, error)
            assert len(error["message"]) < 1000, error  # a huge value is not echoed back
        # empty audio is no audio: nothing appended, no error, and the commit still finds none
        await client.send(type="input_audio_buffer.append", audio="")
        await client.send(type="input_audio_buffer.commit")
        assert (await client.next_error(len(cases)))["error"]["code"] == \
            "input_audio_buffer_commit_empty"
        # one byte past the largest usable message: closed with 1009 (too big), never read
        padding = limit - len(json.dumps({"type": "input_audio_buffer.append", "audio": ""}))
        await client.send(type="input_audio_buffer.append", audio="A" * (padding + 1))
        await client.wait(lambda: client.reader.done(), 10)
        with pytest.raises(websockets.ConnectionClosedError) as closed:
            client.reader.result()
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009, closed.value

    asyncio.run(run())


def test_a_client_that_reads_nothing_is_dropped_and_frees_its_session(
        live: dict[str, Any], limited: str) -> None:
    """A client that sends and never reads fills the socket's buffers, so the server's sends
    wait: past SPEECH_SEND_TIMEOUT_SECONDS (2 s here) it is dropped, and the gateway's two
    session slots serve two new clients (without the drop it held one for ever)."""
    stalled = raw_session(limited)
    # each update is answered with a session.updated echoing its 1,999-character prompt
    update = json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {
        "input": {"transcription": {"prompt": "p" * 1999}}}}}).encode()
    frame = bytes([0x81, 0xFE]) + len(update).to_bytes(2, "big") + bytes(4) + update  # masked, 0
    stalled.settimeout(3)
    sent = 0
    try:
        while sent < 20_000:  # until the server stops reading: its sends are stuck
            stalled.sendall(frame)
            sent += 1
    except TimeoutError:
        pass
    assert sent < 20_000, "the server kept reading: nothing is stuck"

    async def two_sessions() -> bool:
        clients = []
        try:
            for _ in range(2):
                socket_ = await websockets.connect(f"{limited}?intent=transcription",
                                                   additional_headers=AUTH)
                client = Raw(socket_)
                clients.append(client)
                await client.wait(lambda c=client: c.types(), 10)  # type: ignore[misc]
                if client.types()[0] != "session.created":
                    return False
            return True
        finally:
            for client in clients:
                await client.socket.close()

    try:
        wait_until(lambda: asyncio.run(two_sessions()), 20, "both session slots free", 1.0)
        # and its socket goes too: asyncio's close waits for a drain that never comes
        wait_until(lambda: tcp_state(stalled) != TCP_ESTABLISHED, 30,
                   "the dropped session's connection to be aborted", 0.5)
    finally:
        stalled.close()


def raw_session(url: str) -> socket.socket:
    """A live session on a plain socket that reads nothing after the upgrade (a small
    receive buffer, set before connecting so the kernel cannot grow it)."""
    stalled = socket.socket()
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.connect(("127.0.0.1", int(url.split(":")[2].split("/")[0])))
    stalled.sendall(f"GET /v1/realtime?intent=transcription HTTP/1.1\r\nHost: x\r\n"
                    "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                    f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}\r\n"
                    f"Authorization: Bearer {KEY}\r\n\r\n".encode())
    stalled.settimeout(10)
    answer = b""
    while b"\r\n\r\n" not in answer:  # (uvicorn drops bytes sent along with the upgrade)
        answer += stalled.recv(1024)
    assert answer.startswith(b"HTTP/1.1 101"), answer
    return stalled


def test_a_text_message_that_is_not_utf8_closes_1007_without_a_traceback(
        tmp_path: Path) -> None:
    """A client's bad frame is not the server's error: closed 1007, one log line (uvicorn
    logged a traceback at ERROR for each, so any client could fill the log)."""
    server = procs.RedisServer(tmp_path / "redis").start()
    gateway = procs.gateway(server.url, tmp_path).start()
    try:
        port = int(gateway.url.rsplit(":", 1)[1])
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(f"GET /v1/realtime?intent=transcription HTTP/1.1\r\nHost: x\r\n"
                         "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                         "Sec-WebSocket-Version: 13\r\n"
                         f"Sec-WebSocket-Key: {base64.b64encode(os.urandom(16)).decode()}"
                         "\r\n\r\n".encode())
            answer = b""
            while b"\r\n\r\n" not in answer:
                answer += sock.recv(1024)
            assert answer.startswith(b"HTTP/1.1 101"), answer
            # One frame: bytes the server never reads make its close a reset, which can
            # drop the close frame before the client reads it.
            sock.sendall(bytes([0x81, 0x83]) + bytes(4) + b"\xff\xfe\xfd")
            received = b""  # session.created, then the close frame, then the end
            while chunk := sock.recv(65536):
                received += chunk
        assert bytes([0x88, 0x02]) + (1007).to_bytes(2, "big") in received, received[-200:]
        time.sleep(0.5)
        log = gateway.log()
    finally:
        gateway.stop()
        server.stop()
    assert "Traceback" not in log and "UnicodeDecodeError" not in log, log[-2000:]


def test_a_ping_flood_from_a_client_that_reads_nothing_is_held_back(
        live: dict[str, Any], limited: str) -> None:
    """uvicorn answers every ping with a pong by itself: a client that sends pings and reads
    nothing must soon find the server no longer reading (before, every pong was buffered in
    the gateway: +390 MB for 419 MB of pings), and its connection then goes."""
    stalled = raw_session(limited)
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 65536)
    burst = (bytes([0x89, 0x80 | 125]) + bytes(4) + bytes(125)) * 512  # masked pings, 66 KB
    stalled.settimeout(3)
    sent, deadline = 0, time.monotonic() + 20
    try:
        while sent < 64 * 2**20 and time.monotonic() < deadline:
            stalled.sendall(burst)
            sent += len(burst)
    except (TimeoutError, ConnectionError):
        pass
    try:
        assert sent < 16 * 2**20, f"the server read {sent / 2**20:.0f} MB of pings"
        wait_until(lambda: tcp_state(stalled) != TCP_ESTABLISHED, 30,
                   "the flooding connection to be aborted", 0.5)
    finally:
        stalled.close()


def test_a_refused_append_leaves_nothing_in_the_next_turn() -> None:
    """An append past a full buffer (no server VAD) is refused before the resampler sees it:
    the committed turn is exactly what was accepted (the resampler's state used to carry the
    refused chunk's last ~24 ms into it)."""
    buffer = InputBuffer(24000, None, 16000)  # 1 s
    rng = np.random.default_rng(0)
    buffer.append(rng.uniform(-0.5, 0.5, 21600).astype(np.float32), None)  # 0.9 s
    with pytest.raises(ProtocolError):
        buffer.append(rng.uniform(-0.5, 0.5, 12000).astype(np.float32), None)  # 0.5 s
    turn = buffer.commit()
    assert turn is not None and abs(len(turn.audio) - 14400) <= 1, len(turn.audio)


def test_a_flood_of_one_sample_appends_is_held_compactly() -> None:
    """960,000 one-sample appends fill a 60 s buffer: they must not cost an array each
    (~120 bytes per 4-byte sample, ~115 MB per session). Measured on 32,000 of them."""
    buffer = InputBuffer(16000, None, 60 * 16000)
    samples = np.arange(32_000, dtype="<i2")
    tracemalloc.start()
    try:
        for value in samples:
            appended = decode_pcm16(base64.b64encode(value.tobytes()).decode(),
                                    buffer.max_samples, 16000, None)
            buffer.append(appended, None)
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < 1_000_000, held  # 128 KB of samples; ~4 MB as one array per append
    turn = buffer.commit()
    assert turn is not None
    assert np.array_equal(turn.audio, samples.astype(np.float32) / 32768.0)  # all, in order


# --- the queue's guarantees ---------------------------------------------------------------------

def test_live_turns_overtake_a_batch_backlog(live: dict[str, Any]) -> None:
    """Two sessions and 20 batch tasks on one worker: each live turn completes before the
    backlog drains, and every batch task still succeeds exactly once. The worker is paused
    (SIGSTOP, by pid) until both turns are queued behind the backlog, so what runs first is
    decided by the lanes alone, not by how fast this machine streams the sessions."""
    gateway, worker = live["gateway"], live["worker"]
    redis = live["redis"].client()
    interactive = keys.queue("faster-whisper", "interactive")
    turns_before = redis.xlen(interactive) if redis.exists(interactive) else 0
    os.kill(worker.pid, signal.SIGSTOP)
    try:
        batch = []
        for _ in range(20):
            with JFK.open("rb") as handle:
                reply = http.post(f"{gateway}/api/faster-whisper-submit", headers=AUTH,
                                   files={"file": ("jfk.flac", handle)}, timeout=60)
            assert reply.status_code == 200, reply.text
            batch.append(reply.json()["task_id"])

        async def session() -> float:
            client = await connect(live)
            await configure(client, ONE_TURN_VAD)
            await stream(client, pcm(JFK))
            await client.wait(client.all_answered, 120)
            await client.socket.close()
            check_turn_events(client, vad=True)
            assert wer(JFK_TEXT, joined_transcript(client)) <= 0.10
            return client.of(f"{TRANSCRIPTION}.completed")[-1]["_at"]

        async def both() -> list[float]:
            sessions = asyncio.gather(session(), session())
            await asyncio.to_thread(wait_until, lambda: redis.xlen(interactive) >= turns_before
                                    + 2, 60, "both live turns queued")
            os.kill(worker.pid, signal.SIGCONT)
            return list(await sessions)

        completed_at = asyncio.run(both())
    finally:
        os.kill(worker.pid, signal.SIGCONT)
    records = [wait_task(gateway, task_id, AUTH, timeout=180) for task_id in batch]
    assert all(r["status"] == "SUCCEEDED" for r in records), records
    assert all(r["attempts"] == 1 and r["deliveries"] == 1 for r in records), records
    drained = max(r["finished_at"] for r in records)
    for at in completed_at:  # before the turns ran at most the one batch task the paused
        assert at < drained  # worker held, and the batch tasks that shared their engine call
        most_before = 1 + Settings().batch_max_size
        assert sum(r["finished_at"] > at for r in records) >= 20 - most_before, (at, records)


def test_worker_killed_mid_turn_redelivers_and_completes_once(live: dict[str, Any]) -> None:
    long_clip = TEST_AUDIO / "multilingual.mp3"  # ~5 s of work for tiny.en: time to kill it
    redis = live["redis"].client()

    async def run() -> Raw:
        client = await connect(live)
        await configure(client, None)
        await stream(client, pcm(long_clip, seconds=40, silence=0))
        await client.send(type="input_audio_buffer.commit")
        await client.wait(lambda: client.of(f"{TRANSCRIPTION}.delta"), 60)  # it is running
        os.kill(live["worker"].pid, signal.SIGKILL)
        live["worker"].stop()
        live["worker"] = start_worker(live)  # supervisord's part
        await client.wait(client.all_answered, 120)
        await asyncio.sleep(2 * VISIBILITY)  # no second outcome trails in
        await client.socket.close()
        return client

    client = asyncio.run(run())
    item = client.of("input_audio_buffer.committed")[0]["item_id"]
    assert [e["item_id"] for e in client.of(f"{TRANSCRIPTION}.completed")] == [item]
    assert not client.of(f"{TRANSCRIPTION}.failed")
    # the deltas of the second attempt repeat none already sent
    texts = [e["delta"] for e in client.of(f"{TRANSCRIPTION}.delta")]
    assert "".join(texts).strip() == client.of(f"{TRANSCRIPTION}.completed")[0]["transcript"]
    records = [redis.hgetall(key) for key in redis.scan_iter(match=keys.task_pattern())]
    redelivered = [r for r in records if int(r.get(b"deliveries", 0)) >= 2]
    assert len(redelivered) == 1 and redelivered[0][b"state"] == b"SUCCEEDED", redelivered
    assert redelivered[0][b"lane"] == b"interactive"
