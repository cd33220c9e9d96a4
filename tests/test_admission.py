"""Admission (issue 18): priority lanes, on a real redis-server, gateway and faster-whisper
worker (the bundled tiny.en), with short espeak-ng clips so each task takes a fraction of a
second."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from common import keys
from common.schemas import TaskState
from common.settings import Settings
from common.store import Task, TaskStore, new_task_id
from gateway.jobs.sweeper import Sweeper
from harness import procs
from harness.conversation import speak_to
from harness.http_client import http
from tests.helpers import queue_counts, wait_done


@pytest.fixture(scope="module")
def admission(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A Redis and a gateway; each test starts (and stops) its own worker."""
    workdir = tmp_path_factory.mktemp("admission")
    clips = workdir / "clips"
    clips.mkdir()
    clip = clips / "short.wav"
    speak_to(clip, "Hello world.")
    server = procs.RedisServer(workdir / "redis").start()
    gateway = procs.gateway(server.url, workdir, allowed_roots=[str(clips)]).start()
    yield {"redis": server, "gateway": gateway.url, "workdir": workdir, "clips": clips,
           "clip": clip}
    gateway.stop()
    server.stop()


def start_worker(env: dict[str, Any], **settings: Any) -> procs.Service:
    # batching off: these tests check predicted waits of work run one task at a time (a
    # batch starts several at once, which the estimate does not model: it over-states)
    settings.setdefault("batch_window_ms", "0")
    return procs.worker(env["redis"].url, env["workdir"], idle_unload_seconds="-1",
                        allowed_roots=[str(env["clips"])], preload="true", **settings).start()


def submit(env: dict[str, Any], **params: Any) -> httpx.Response:
    return http.post(f"{env['gateway']}/api/faster-whisper-submit",
                      data={"audio_path": str(env["clip"]), **params}, timeout=30)


def task_id(reply: httpx.Response) -> str:
    assert reply.status_code == 200, reply.text
    return reply.json()["task_id"]


def record(env: dict[str, Any], tid: str) -> dict[str, Any]:
    reply = http.get(f"{env['gateway']}/v1/tasks/{tid}", timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()


def queue_position(env: dict[str, Any], tid: str) -> int:
    return http.get(f"{env['gateway']}/api/status", params={"task_id": tid},
                     timeout=30).json()["queue_position"]


def test_interactive_overtakes_a_batch_backlog_and_batch_still_runs_once(admission):
    env = admission
    batch = [task_id(submit(env)) for _ in range(20)]
    interactive = [task_id(submit(env, priority="interactive")) for _ in range(3)]
    # positions per lane: interactive counts only interactive ahead; batch counts both
    assert [queue_position(env, tid) for tid in interactive] == [1, 2, 3]
    assert queue_position(env, batch[0]) == 4
    assert queue_position(env, batch[-1]) == 23
    worker = start_worker(env, batch_promotion_seconds="600")
    try:
        # more interactive work arrives while the worker drains the batch backlog
        late = [task_id(submit(env, priority="interactive")) for _ in range(2)]
        for tid in batch + interactive + late:
            assert wait_done(env["gateway"], tid, timeout=120)["status"] == "SUCCEEDED"
    finally:
        worker.stop()
    batch_records = [record(env, tid) for tid in batch]
    assert all(r["attempts"] == 1 and r["status"] == "SUCCEEDED" for r in batch_records)
    batch_starts = sorted(r["started_at"] for r in batch_records)
    for tid in interactive:  # queued before the worker started: before any batch task
        assert record(env, tid)["started_at"] < batch_starts[0]
    for tid in late:  # queued behind 20 batch tasks: started long before the backlog drained
        assert record(env, tid)["started_at"] < batch_starts[-5]


def test_old_batch_task_is_promoted_past_fresh_interactive_work(admission):
    env = admission
    old = task_id(submit(env))
    time.sleep(2.5)
    fresh = task_id(submit(env, priority="interactive"))
    worker = start_worker(env, batch_promotion_seconds="2")
    try:
        for tid in (old, fresh):
            assert wait_done(env["gateway"], tid, timeout=60)["status"] == "SUCCEEDED"
    finally:
        worker.stop()
    assert record(env, old)["started_at"] < record(env, fresh)["started_at"]


def test_unknown_priority_is_refused(admission):
    reply = submit(admission, priority="urgent")
    assert reply.status_code == 400 and "priority" in reply.text


def wait_status(env: dict[str, Any], tid: str, timeout: float = 60) -> dict[str, Any]:
    return wait_done(env["gateway"], tid, timeout=timeout)


def test_a_deadline_that_passes_while_queued_fails_the_task_unrun(admission):
    env = admission
    tid = task_id(submit(env, max_wait_seconds="2"))
    time.sleep(3)
    worker = start_worker(env)
    try:
        reply = wait_status(env, tid, timeout=30)
    finally:
        worker.stop()
    assert reply["status"] == "FAILED" and "deadline" in reply["error"]
    task = record(env, tid)
    assert task["error_code"] == "deadline_exceeded"
    assert task["attempts"] == 0 and task["started_at"] is None and not task["worker"]


@pytest.mark.alone
def test_the_predicted_start_is_within_30_percent_and_a_missed_deadline_is_refused(admission):
    env = admission
    worker = start_worker(env)
    try:
        for tid in [task_id(submit(env)) for _ in range(4)]:  # a stable measured rate
            assert wait_status(env, tid)["status"] == "SUCCEEDED"
        # the worker measures the rate per model (and for the backend as a whole)
        rates = env["redis"].client().hgetall(keys.rate("faster-whisper"))
        assert float(rates[b"rate:tiny.en"]) > 0 and int(rates[b"tasks:tiny.en"]) >= 4
        assert float(rates[b"rate"]) > 0
        replies = [submit(env) for _ in range(8)]
        last = replies[-1].json()
        assert replies[-1].status_code == 200 and "estimated_start_seconds" in last, last
        assert last["estimated_finish_seconds"] > last["estimated_start_seconds"]
        view = http.get(f"{env['gateway']}/v1/tasks/{last['task_id']}", timeout=30).json()
        assert view["status"] == "PENDING" and view["queue_position"] >= 1, view
        assert view["estimated_finish_seconds"] > view["estimated_start_seconds"] > 0, view
        # a deadline the queue ahead already misses is refused at once, nothing queued
        refused = submit(env, max_wait_seconds="0.05")
        assert refused.status_code == 429, refused.text
        assert "misses the deadline" in refused.json()["error"]
        assert int(refused.headers["retry-after"]) >= 1
        with env["clip"].open("rb") as handle:  # the OpenAI dialect names the code
            # (batch: behind the queued tasks; interactive waits only for what is left of
            # the running one, which the estimate now knows, and may well meet 0.05 s)
            openai = http.post(f"{env['gateway']}/v1/audio/transcriptions",
                                files={"file": ("a.wav", handle)},
                                data={"model": "whisper-1", "max_wait_seconds": "0.05",
                                      "priority": "batch"}, timeout=30)
        assert openai.status_code == 429
        assert openai.json()["error"]["code"] == "deadline_unreachable"
        for reply in replies:
            assert wait_status(env, task_id(reply))["status"] == "SUCCEEDED"
        with env["clip"].open("rb") as handle:  # an OpenAI call says where it stood
            openai = http.post(f"{env['gateway']}/v1/audio/transcriptions",
                                files={"file": ("a.wav", handle)}, data={"model": "whisper-1"},
                                timeout=60)
        assert openai.status_code == 200, openai.text
        assert int(openai.headers["x-queue-position"]) in (0, 1)
        # nothing was ahead of it and the worker was idle: its predicted start is now
        assert float(openai.headers["x-estimated-wait"]) < 1.0, openai.headers
    finally:
        worker.stop()
    task = record(env, last["task_id"])
    actual = task["started_at"] - task["created_at"]
    predicted = last["estimated_start_seconds"]
    assert abs(predicted - actual) <= 0.3 * actual, (predicted, actual)


@pytest.mark.alone
def test_retry_after_of_a_long_predicted_wait_is_within_30_percent(admission):
    """Retry-After says when the queue falls under `max_queue_seconds_ahead`: one worker, so a
    task submitted at time T starts when the last queued one finishes, and the queue is under
    the limit from (that finish - the limit) on."""
    env, limit = admission, 2.0
    worker = start_worker(env)
    limited = procs.gateway(env["redis"].url, env["workdir"], allowed_roots=[str(env["clips"])],
                            max_queue_seconds_ahead={"faster-whisper": limit}).start()
    try:
        for tid in [task_id(submit(env)) for _ in range(8)]:  # a stable measured rate
            assert wait_status(env, tid)["status"] == "SUCCEEDED"
        queued = [task_id(submit(env)) for _ in range(40)]  # through the unlimited gateway
        refused = http.post(f"{limited.url}/api/faster-whisper-submit",
                             data={"audio_path": str(env["clip"])}, timeout=30)
        refused_at = time.time()
        assert refused.status_code == 429 and "predicted wait" in refused.json()["error"]
        retry_after = int(refused.headers["retry-after"])
        for tid in queued:
            assert wait_status(env, tid, timeout=180)["status"] == "SUCCEEDED"
    finally:
        limited.stop()
        worker.stop()
    last_finish = max(record(env, tid)["finished_at"] for tid in queued)
    actual = last_finish - limit - refused_at
    assert actual > 3, actual  # long enough for a whole-second header to be judged by 30 %
    assert abs(retry_after - actual) <= 0.3 * actual, (retry_after, actual)


def test_a_full_queue_refuses_with_retry_after_and_queues_nothing(admission):
    env = admission
    gateway = procs.gateway(env["redis"].url, env["workdir"], allowed_roots=[str(env["clips"])],
                            max_queued_tasks={"faster-whisper": 3}).start()
    client = env["redis"].client()
    try:
        queued = [task_id(http.post(f"{gateway.url}/api/faster-whisper-submit",
                                     data={"audio_path": str(env["clip"])}, timeout=30))
                  for _ in range(3)]
        before = queue_counts(client)
        refused = http.post(f"{gateway.url}/api/faster-whisper-submit",
                             data={"audio_path": str(env["clip"])}, timeout=30)
        assert refused.status_code == 429, refused.text
        assert int(refused.headers["retry-after"]) >= 1
        assert queue_counts(client) == before  # no record, no entry
        # the OpenAI route refuses the same way; Sage's status polls still answer 200
        with env["clip"].open("rb") as handle:
            openai = http.post(f"{gateway.url}/v1/audio/transcriptions",
                                files={"file": ("a.wav", handle)}, data={"model": "whisper-1"},
                                timeout=30)
        assert openai.status_code == 429 and openai.json()["error"]["code"] == "queue_full"
        assert "retry-after" in openai.headers
        assert http.get(f"{gateway.url}/api/status", params={"task_id": queued[0]},
                         timeout=30).status_code == 200
    finally:
        gateway.stop()
    drain(env, queued)


def drain(env: dict, queued: list[str]) -> None:
    """Start a worker, see every queued task SUCCEED, stop it."""
    worker = start_worker(env)
    try:
        for tid in queued:
            assert wait_status(env, tid)["status"] == "SUCCEEDED"
    finally:
        worker.stop()


def test_a_long_predicted_wait_refuses_and_the_backlog_balances(admission):
    env = admission
    gateway = procs.gateway(env["redis"].url, env["workdir"], allowed_roots=[str(env["clips"])],
                            max_queue_seconds_ahead={"faster-whisper": 0.5}).start()
    client = env["redis"].client()
    queued: list[str] = []
    try:
        for _ in range(20):  # the earlier tests measured the rate; no worker runs now
            reply = http.post(f"{gateway.url}/api/faster-whisper-submit",
                               data={"audio_path": str(env["clip"])}, timeout=30)
            if reply.status_code != 200:
                break
            queued.append(task_id(reply))
        assert reply.status_code == 429 and "predicted wait" in reply.json()["error"]
        assert int(reply.headers["retry-after"]) >= 1
        assert 1 <= len(queued) < 20
        before = queue_counts(client)
        assert http.post(f"{gateway.url}/api/faster-whisper-submit",
                          data={"audio_path": str(env["clip"])}, timeout=30).status_code == 429
        assert queue_counts(client) == before
    finally:
        gateway.stop()
    drain(env, queued)
    # every task that left the queue left the backlog: nothing queued, nothing running
    backlog = {k.decode(): float(v) for k, v in
               client.hgetall(keys.backlog("faster-whisper")).items()}
    assert all(abs(value) < 1e-6 for value in backlog.values()), backlog


def test_the_sweeper_fails_a_queued_task_past_its_deadline(admission):
    env = admission

    async def scenario() -> None:
        redis = Redis.from_url(env["redis"].url)
        store = TaskStore(redis, 60)
        task = Task(id=new_task_id(), backend="faster-whisper", model="tiny.en",
                    state=TaskState.PENDING, input_path=str(env["clip"]), audio_seconds=1.0,
                    deadline=time.time() + 0.2)
        await store.submit(task, None)
        sweeper = Sweeper(store, Settings())
        assert await sweeper.fail_past_deadline("faster-whisper") == 0  # not yet
        await asyncio.sleep(0.4)
        assert await sweeper.fail_past_deadline("faster-whisper") == 1
        failed = await store.get(task.id)
        assert failed is not None and failed.state == TaskState.FAILED
        assert failed.error_code == "deadline_exceeded" and failed.attempt == 0
        await redis.aclose()

    asyncio.run(scenario())
