"""Live sessions held to a fair share (issue 30, finding 7), on a real redis-server and
gateway (no worker: what is checked happens before or instead of a transcription): one key
holds at most its share of the session slots and of the waiting calls, audio faster than
2x real time ends the session, audio of a session with transcription off is charged to the
key's quota, and a closed session's queued turns are dropped, not run."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
import websockets

from common import keys
from gateway.auth import digest
from harness import procs
from harness.http_client import http
from tests.inprocess import InProcessWorker, worker_settings

pytestmark = pytest.mark.timeout(120)
KEYS = {name: f"key-fair-live-{name}"
        for name in ("a", "b", "metered", "transcribed", "failed", "cancelled")}
RATE = 24000


def auth(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[name]}"}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("fair-live")
    server = procs.RedisServer(workdir / "redis").start()
    entries = [{"key": "sha256:" + digest(KEYS["a"]), "name": "a", "interactive": True},
               {"key": "sha256:" + digest(KEYS["b"]), "name": "b"},
               {"key": "sha256:" + digest(KEYS["metered"]), "name": "metered",
                "quotas": {"audio_seconds_per_day": 4}},
               {"key": "sha256:" + digest(KEYS["transcribed"]), "name": "transcribed",
                "quotas": {"audio_seconds_per_day": 4}},
               *({"key": "sha256:" + digest(KEYS[name]), "name": name, "interactive": True,
                  "quotas": {"audio_seconds_per_day": 100}} for name in ("failed", "cancelled"))]
    limits = {"realtime_max_sessions": "4", "realtime_key_share": "0.5",
              "realtime_max_buffer_seconds": "2", "max_waiting_requests": "4"}
    gateway = procs.gateway(server.url, workdir, api_keys=entries, **limits).start()
    yield {"gateway": gateway.url, "ws": socket_url(gateway.url), "client": server.client(),
           "redis": server.url, "workdir": workdir, "entries": entries, "limits": limits}
    gateway.stop()
    server.stop()


def socket_url(gateway: str) -> str:
    return gateway.replace("http://", "ws://") + "/v1/realtime?intent=transcription"


async def opened(env: dict[str, Any], key: str) -> websockets.ClientConnection:
    socket = await websockets.connect(env["ws"], additional_headers=auth(key))
    first = json.loads(await asyncio.wait_for(socket.recv(), 10))
    assert first["type"] in ("session.created", "error"), first
    if first["type"] == "error":
        socket.refused = first  # type: ignore[attr-defined]
    return socket


async def configure(socket: websockets.ClientConnection, transcription: Any,
                    vad: bool = True) -> None:
    """Server VAD keeps only a silent stream's padding, so its appends are never refused."""
    await socket.send(json.dumps({"type": "session.update", "session": {
        "type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": RATE}, "transcription": transcription,
            "turn_detection": {"type": "server_vad"} if vad else None}}}}))
    while json.loads(await asyncio.wait_for(socket.recv(), 10))["type"] != "session.updated":
        pass


def silence(seconds: float) -> str:
    return base64.b64encode(b"\x00\x00" * int(RATE * seconds)).decode()


async def until_error(socket: websockets.ClientConnection, timeout: float = 10) -> dict:
    while True:
        event = json.loads(await asyncio.wait_for(socket.recv(), timeout))
        if event["type"] == "error":
            return event


def test_one_key_holds_at_most_its_share_of_sessions(env: dict[str, Any]) -> None:
    async def scenario() -> None:
        mine = [await opened(env, "a") for _ in range(2)]
        third = await opened(env, "a")
        assert third.refused["error"]["code"] == "too_many_sessions"  # type: ignore[attr-defined]
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await asyncio.wait_for(third.recv(), 10)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1013
        other = await opened(env, "b")  # another key still gets in
        assert not hasattr(other, "refused")
        for socket in (*mine, other):
            await socket.close()

    asyncio.run(scenario())


def test_a_keys_share_of_sessions_holds_across_gateway_processes(env: dict[str, Any]) -> None:
    """Its sessions are leased slots in Redis: a second gateway process sees the first's."""
    second = procs.gateway(env["redis"], env["workdir"], api_keys=env["entries"],
                           **env["limits"]).start()
    slots = keys.slots("sessions", digest(KEYS["a"])[:16])

    async def scenario() -> None:
        mine = [await opened(env, "a") for _ in range(2)]
        assert env["client"].zcard(slots) == 2
        elsewhere = {**env, "ws": socket_url(second.url)}
        third = await opened(elsewhere, "a")
        assert third.refused["error"]["code"] == "too_many_sessions"  # type: ignore[attr-defined]
        assert "every gateway process" in third.refused["error"]["message"]  # type: ignore[attr-defined]
        await mine[0].close()
        deadline = time.monotonic() + 10
        while env["client"].zcard(slots) > 1 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        now_in = await opened(elsewhere, "a")  # its slot was given back: room again
        assert not hasattr(now_in, "refused")
        for socket in (mine[1], now_in):
            await socket.close()

    try:
        asyncio.run(scenario())
    finally:
        second.stop()
    deadline = time.monotonic() + 10
    while env["client"].zcard(slots) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert env["client"].zcard(slots) == 0  # every slot given back at close


def test_audio_past_twice_real_time_ends_the_session(env: dict[str, Any]) -> None:
    async def scenario() -> dict:
        socket = await opened(env, "b")
        await configure(socket, {"model": "whisper-1"})
        for _ in range(16):  # 16 s of audio at once: past the 10 s burst + 2x the wall time
            await socket.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": silence(1.0)}))
        error = await until_error(socket)
        await socket.close()
        return error

    error = asyncio.run(scenario())
    assert error["error"]["code"] == "rate_limited", error


@pytest.mark.parametrize("key", ["metered", "transcribed"])
def test_audio_in_no_turn_is_charged_to_the_quota(env: dict[str, Any], key: str) -> None:
    """Silence with transcription off, and with it on (the VAD never commits a turn: no task
    carries the audio), is charged as it arrives: 4 s a day runs out. What the session was
    sent up to its end is charged at the close, past the quota too (at most a buffer's
    worth): a key at its quota sent that much each session for nothing."""
    async def scenario() -> dict:
        socket = await opened(env, key)
        await configure(socket, None if key == "metered" else {"model": "whisper-1"})
        started = time.monotonic()
        try:
            while time.monotonic() - started < 20:  # < 2 s of audio a second: within the speed
                await socket.send(json.dumps({"type": "input_audio_buffer.append",
                                              "audio": silence(0.4)}))
                with_error = None
                with contextlib.suppress(TimeoutError):
                    with_error = await until_error(socket, timeout=0.25)
                if with_error is not None:
                    return with_error
            raise AssertionError("never refused")
        finally:
            await socket.close()

    error = asyncio.run(scenario())
    assert error["error"]["code"] == "quota_exceeded", error
    buffer = float(env["limits"]["realtime_max_buffer_seconds"])
    procs.wait_until(lambda: http.get(f"{env['gateway']}/v1/usage", headers=auth(key),
                                      timeout=30).json()["day"]["audio_seconds"]["used"] > 4,
                     10, "the close's charge")
    usage = http.get(f"{env['gateway']}/v1/usage", headers=auth(key), timeout=30).json()
    assert 4 < usage["day"]["audio_seconds"]["used"] <= 4 + buffer


def test_a_closed_sessions_queued_turns_are_dropped(env: dict[str, Any]) -> None:
    client = env["client"]

    async def scenario() -> None:
        socket = await opened(env, "a")
        await configure(socket, {"model": "whisper-1"}, vad=False)
        await socket.send(json.dumps({"type": "input_audio_buffer.append",
                                      "audio": silence(1.0)}))
        await socket.send(json.dumps({"type": "input_audio_buffer.commit"}))
        while json.loads(await asyncio.wait_for(socket.recv(), 10))["type"] != \
                "input_audio_buffer.committed":
            pass
        await asyncio.sleep(0.5)  # queued: no worker runs here
        await socket.close()

    asyncio.run(scenario())

    def states() -> list[bytes]:
        return [client.hget(key, "state") for key in client.scan_iter(match=keys.task_pattern())]

    procs.wait_until(lambda: states() and all(s == b"CANCELLED" for s in states()), 10,
                     "the turn cancelled")


@pytest.mark.parametrize("ending", ["failed", "cancelled"])
def test_a_turn_whose_task_gives_its_charge_back_is_charged_as_session_audio(
        env: dict[str, Any], ending: str) -> None:
    """A committed turn is charged as its task; a task that FAILS (here: a worker whose
    memory cap refuses it) or is cancelled (the session closed before any worker took it)
    gives back what it did not deliver. The session's meter then charges that audio: every
    second a session is sent is charged once, whatever becomes of its turns."""
    worker = None
    if ending == "failed":
        worker = InProcessWorker(worker_settings(env["redis"], memory_cap_mib=1)).start()

    async def scenario() -> list[str]:
        socket = await opened(env, ending)
        await configure(socket, {"model": "whisper-1"}, vad=False)
        await socket.send(json.dumps({"type": "input_audio_buffer.append",
                                      "audio": silence(1.5)}))
        await socket.send(json.dumps({"type": "input_audio_buffer.commit"}))
        wanted = ("conversation.item.input_audio_transcription.failed" if ending == "failed"
                  else "input_audio_buffer.committed")
        seen = []
        while not seen or seen[-1] != wanted:
            seen.append(json.loads(await asyncio.wait_for(socket.recv(), 30))["type"])
        if ending == "cancelled":
            await asyncio.sleep(0.5)  # queued: no worker runs here
        await socket.close()
        return seen

    try:
        asyncio.run(scenario())
    finally:
        if worker is not None:
            worker.stop()

    def used() -> float:
        return http.get(f"{env['gateway']}/v1/usage", headers=auth(ending),
                        timeout=30).json()["day"]["audio_seconds"]["used"]

    procs.wait_until(lambda: used() > 0, 10, "the session's charge")
    time.sleep(0.5)  # (a second charge, were there one, would land by now)
    assert used() == pytest.approx(1.5, abs=0.01)


def test_one_key_holds_at_most_its_share_of_waiting_calls(env: dict[str, Any]) -> None:
    url = f"{env['gateway']}/v1/audio/transcriptions"

    def call(key: str, timeout: float) -> httpx.Response | None:
        with procs.TEST_AUDIO.joinpath("jfk.flac").open("rb") as handle:
            try:
                return http.post(url, headers=auth(key), files={"file": ("a.flac", handle)},
                                  data={"model": "whisper-1"}, timeout=timeout)
            except httpx.ReadTimeout:
                return None  # still waiting for its task (no worker here)

    with ThreadPoolExecutor(2) as pool:
        waiting = [pool.submit(call, "a", 6.0) for _ in range(2)]
        time.sleep(2.0)
        refused = call("a", 10.0)
        assert refused is not None and refused.status_code == 503, refused
        assert refused.json()["error"]["code"] == "overloaded"
        assert "its share" in refused.json()["error"]["message"]
        assert call("b", 2.0) is None  # another key's call is taken and waits
        assert [future.result() for future in waiting] == [None, None]
    # a burst of one key's calls at once: the share is counted before any of them waits
    time.sleep(1.0)
    with ThreadPoolExecutor(8) as pool:
        burst = list(pool.map(lambda _: call("b", 4.0), range(8)))
    admitted = [reply for reply in burst if reply is None]
    assert 1 <= len(admitted) <= 2, [r.status_code if r else None for r in burst]
    assert all(r.status_code == 503 for r in burst if r is not None)
