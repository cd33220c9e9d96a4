"""Lanes that interleave and a bound on claims (issue 30, findings 2 and 3), on a real
redis-server, gateway and faster-whisper worker (tiny.en) with short espeak-ng clips: an aged
batch backlog gets one entry per `batch_promotion_every` interactive ones, never all first;
only a key allowed it takes the interactive lane; a key has at most its in-flight tasks; a
container that understates its length is charged, and counted in the backlog, near it."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from common import keys
from common.store.queue import Queue
from gateway.auth import digest
from harness import procs
from harness.conversation import speak_to
from harness.http_client import http
from tests.audio_fakes import decoded_seconds, lying_matroska, silence_opus
from tests.helpers import wait_task

pytestmark = pytest.mark.timeout(300)
KEYS = {name: f"key-lanes-{name}-secret" for name in ("batchy", "live", "capped", "small")}


def auth(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[name]}"}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("fair-lanes")
    clips = workdir / "clips"
    clips.mkdir()
    clip = clips / "short.wav"
    speak_to(clip, "Hello world.")
    server = procs.RedisServer(workdir / "redis").start()
    entries = [{"key": "sha256:" + digest(KEYS["batchy"]), "name": "batchy"},
               {"key": "sha256:" + digest(KEYS["live"]), "name": "live", "interactive": True},
               {"key": "sha256:" + digest(KEYS["capped"]), "name": "capped",
                "max_in_flight": 3},
               {"key": "sha256:" + digest(KEYS["small"]), "name": "small",
                "quotas": {"audio_seconds_per_day": 60}}]
    gateway = procs.gateway(server.url, workdir, api_keys=entries,
                            allowed_roots=[str(clips)]).start()
    yield {"redis": server, "client": server.client(), "gateway": gateway.url,
           "workdir": workdir, "clips": clips, "clip": clip}
    gateway.stop()
    server.stop()


def submit(env: dict[str, Any], key: str, **params: Any) -> httpx.Response:
    return http.post(f"{env['gateway']}/api/faster-whisper-submit", headers=auth(key),
                      data={"audio_path": str(env["clip"]), **params}, timeout=30)


def task_id(reply: httpx.Response) -> str:
    assert reply.status_code == 200, reply.text
    return reply.json()["task_id"]


def cancel(env: dict[str, Any], key: str, tid: str) -> None:
    http.delete(f"{env['gateway']}/v1/tasks/{tid}", headers=auth(key), timeout=30)


def test_an_aged_backlog_gets_one_entry_per_n_interactive(tmp_path) -> None:
    """The read order itself, on a real Redis: every batch entry is long overdue."""
    server = procs.RedisServer(tmp_path / "redis").start()

    async def scenario() -> list[str]:
        redis = Redis.from_url(server.url)
        for lane in keys.LANES:
            await redis.xgroup_create(keys.queue("b", lane), keys.WORKER_GROUP, id="0",
                                      mkstream=True)
        for index in range(10):  # added at epoch 1 s: older than any promotion age
            await redis.xadd(keys.queue("b", keys.BATCH), {"task_id": f"b{index}"},
                             id=f"1000-{index + 1}")
            await redis.xadd(keys.queue("b", keys.INTERACTIVE), {"task_id": f"i{index}"})
        queue = Queue(redis, "b", "c1", promotion_seconds=5, promotion_every=4)
        order = [(await queue.read(block_ms=None))[0].lane[0] for _ in range(15)]
        await redis.aclose()
        return order

    try:
        order = asyncio.run(scenario())
    finally:
        server.stop()
    # a new worker owes batch one entry, then one in five
    assert "".join(order) == "biiiibiiiibiibb"


def test_an_interactive_call_waits_for_the_running_task_not_an_aged_backlog(
        env: dict[str, Any]) -> None:
    batch = [task_id(submit(env, "batchy")) for _ in range(25)]
    time.sleep(1.5)  # the whole backlog is past its promotion age
    worker = procs.worker(env["redis"].url, env["workdir"], idle_unload_seconds="-1",
                          allowed_roots=[str(env["clips"])], preload="true",
                          batch_promotion_seconds="1", batch_promotion_every="4",
                          batch_window_ms="0").start()  # lanes, one task at a time
    try:
        for tid in batch[:3]:  # a rate is measured
            wait_task(env["gateway"], tid, headers=auth("batchy"), timeout=60)
        with env["clip"].open("rb") as handle:
            reply = http.post(f"{env['gateway']}/v1/audio/transcriptions",
                               headers=auth("live"), files={"file": ("a.wav", handle)},
                               data={"model": "whisper-1"}, timeout=120)
        assert reply.status_code == 200, reply.text
        assert "x-estimated-wait" in reply.headers
        call = http.get(f"{env['gateway']}/v1/tasks/{reply.headers['x-task-id']}",
                         headers=auth("live"), timeout=30).json()
        records = [http.get(f"{env['gateway']}/v1/tasks/{tid}", headers=auth("batchy"),
                             timeout=30).json() for tid in batch]
    finally:
        worker.stop()
        for tid in batch:
            cancel(env, "batchy", tid)
    assert env["client"].hget(keys.task(call["id"]), "lane") == b"interactive"
    overtaking = [r for r in records if r.get("started_at")
                  and call["created_at"] < r["started_at"] < call["started_at"]]
    # at most the one a worker took as the call arrived (was: every aged entry first)
    assert len(overtaking) <= 1, (len(overtaking), call)
    assert sum(1 for r in records if r["status"] in ("PENDING", "CANCELLED")) >= 10


def test_interactive_needs_a_key_allowed_it(env: dict[str, Any]) -> None:
    client = env["client"]
    asked = task_id(submit(env, "batchy", priority="interactive"))
    allowed = task_id(submit(env, "live", priority="interactive"))
    default = task_id(submit(env, "live"))  # a Sage submit defaults to batch
    try:
        assert client.hget(keys.task(asked), "lane") == b"batch"
        assert client.hget(keys.task(allowed), "lane") == b"interactive"
        assert client.hget(keys.task(default), "lane") == b"batch"
    finally:
        cancel(env, "batchy", asked)
        cancel(env, "live", allowed)
        cancel(env, "live", default)


def test_a_key_has_at_most_its_tasks_in_flight(env: dict[str, Any]) -> None:
    queued = [task_id(submit(env, "capped")) for _ in range(3)]
    refused = submit(env, "capped")
    assert refused.status_code == 429, refused.text
    assert refused.json()["status"] == "FAILED" and "queued or running" in refused.json()["error"]
    assert int(refused.headers["retry-after"]) >= 1
    assert task_id(submit(env, "live"))  # another key is not held up
    cancel(env, "capped", queued[0])
    queued.append(task_id(submit(env, "capped")))  # a finished task frees its place
    for tid in queued[1:]:
        cancel(env, "capped", tid)
    assert env["client"].get(keys.in_flight(digest(KEYS["capped"])[:16])) is None


def test_an_understated_container_is_charged_and_counted_near_its_length(
        env: dict[str, Any]) -> None:
    lying = lying_matroska(silence_opus(55), 1, 0.104)
    assert decoded_seconds(lying) > 54
    client = env["client"]
    before = float(client.hget(keys.backlog("faster-whisper"), "batch:seconds") or 0)

    def send() -> httpx.Response:
        return http.post(f"{env['gateway']}/api/faster-whisper-submit", headers=auth("small"),
                          files={"file": ("lie.mka", lying)}, timeout=30)

    first = task_id(send())
    try:
        record = client.hgetall(keys.task(first))
        assert float(record[b"audio_seconds"]) == pytest.approx(55, abs=1.5)
        after = float(client.hget(keys.backlog("faster-whisper"), "batch:seconds"))
        assert after - before == pytest.approx(55, abs=1.5)
        second = send()  # 2 x 55 s is past the 60 s a day: refused at submit, not settled
        assert second.status_code == 429 and "quota" in second.text, second.text
    finally:
        cancel(env, "small", first)
