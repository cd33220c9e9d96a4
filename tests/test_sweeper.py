"""The sweeper has no blind spots (issue 12, item 5 and the no-worker half of item 2): it
walks the whole queue, never fails a task a worker started, and fails what a backend
without a live worker still owes. Real redis-server (the module's, emptied for each test),
gateway and worker processes (the worker is killed)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest
from redis.asyncio import Redis

from common import keys
from common.schemas import TaskState
from common.settings import Settings
from common.store import Task, TaskStore, new_task_id, upkeep
from common.store.record import Duplicate
from gateway.jobs.sweeper import Sweeper
from harness import procs
from harness.http_client import http
from harness.procs import TEST_AUDIO, wait_until
from tests import inprocess
from tests.helpers import JFK, submit_file, wait_done
from workers.engines.faster_whisper import FasterWhisperEngine
from workers.runtime import Worker

BACKEND = "faster-whisper"
LONG = TEST_AUDIO / "multilingual.mp3"  # seconds of work with tiny.en


def test_a_stuck_task_behind_250_finished_ones_fails_in_time(redis: procs.RedisServer,
                                                             tmp_path: Path) -> None:
    limit, period = 2.0, 0.5  # the sweeper runs every limit / 4
    gateway = procs.gateway(redis.url, tmp_path, max_queue_seconds=str(limit),
                            no_worker_seconds="0").start()
    try:
        asyncio.run(_finished_tasks(redis.url, 250))
        time.sleep(limit + 2 * period)  # all 250 are past the cutoff, and swept past
        submitted = time.monotonic()
        task_id = submit_file(gateway.url, JFK).json()["taskid"]  # no worker runs
        final = wait_done(gateway.url, task_id, timeout=30)
        took = time.monotonic() - submitted
        assert final["status"] == "FAILED" and "within 2 s" in final["error"], final
        view = http.get(f"{gateway.url}/v1/tasks/{task_id}", timeout=10).json()
        assert view["error_code"] == "no_worker"
        assert took <= limit + period + 1.0, took  # + polling and a loaded machine's slack
    finally:
        gateway.stop()


def test_a_backend_taken_out_of_the_models_still_has_its_tasks_swept(
        redis: procs.RedisServer) -> None:
    """qwen3 had a task queued, then the gateways were restarted without it: the task still
    fails by its wait (it read PENDING for ever); a backend with nothing in Redis is not
    walked, nor given a queue."""

    async def scenario() -> None:
        client = Redis.from_url(redis.url)
        store = TaskStore(client, 60)
        task = Task(id=new_task_id(), backend="qwen3", model="tiny", state=TaskState.PENDING)
        await store.submit(task, b"\0" * 64)
        sweeper = Sweeper(store, Settings(max_queue_seconds=0.5, no_worker_seconds=0))
        assert "qwen3" not in sweeper.settings.models
        assert await sweeper.backends() == ["faster-whisper", "qwen3"]
        await asyncio.sleep(0.8)
        await sweeper.sweep()
        failed = await store.get(task.id)
        assert failed is not None and failed.state == TaskState.FAILED, failed
        assert failed.error_code == "no_worker" and "no qwen3 worker" in failed.error
        assert not await client.exists(keys.queue("parakeet"))
        entry = await client.xadd(keys.queue("parakeet"), {"task_id": "gone"})
        await client.xdel(keys.queue("parakeet"), entry)  # a queue emptied: not walked
        assert "parakeet" not in await sweeper.backends()
        await client.aclose()

    asyncio.run(scenario())


def test_the_sweeper_never_fails_a_task_a_worker_started(redis: procs.RedisServer) -> None:

    async def scenario() -> None:
        client = Redis.from_url(redis.url)
        store = TaskStore(client, 60)
        sweeper = Sweeper(store, Settings(max_queue_seconds=1.0))
        # read PENDING by the sweeper, then started by a worker before the sweeper's write
        seen_pending = await _queued(store)
        assert await store.start(seen_pending.id, "worker-a", 1, BACKEND) == 1
        assert await sweeper.fail_tasks([seen_pending], lambda task: "too late") == 0
        assert await store.fail_if_unchanged(seen_pending, "too late", "no_worker") is False
        # read RUNNING, then re-attempted by another worker: refused as well
        seen_running = await store.get(seen_pending.id)
        assert seen_running is not None
        assert await store.start(seen_running.id, "worker-b", 2, BACKEND) == 2
        assert await sweeper.fail_tasks([seen_running], lambda task: "too late") == 0
        current = await store.get(seen_pending.id)
        assert current is not None and current.state == TaskState.RUNNING
        assert current.worker == "worker-b" and not current.error
        # the age walk reads the started task as it is now: not PENDING, left alone
        assert await sweeper.fail_overdue(BACKEND, 0.0) == 0
        # a task still PENDING when the write lands is failed
        still_pending = await _queued(store)
        assert await sweeper.fail_tasks([still_pending], lambda task: "no worker") == 1
        failed = await store.get(still_pending.id)
        assert failed is not None and failed.state == TaskState.FAILED
        assert failed.error_code == "no_worker"
        await client.aclose()

    asyncio.run(scenario())


def test_tasks_waiting_in_a_keys_line_are_swept_by_their_age_and_with_no_worker(
        redis: procs.RedisServer) -> None:
    """A key's tasks past its share wait in its line with no stream entry yet
    (common/store/shares.py): the overdue walk dates them from their submit, not from when
    they come in, and a backend with no worker fails them with the rest."""
    from common.api_keys import ApiKey

    key = ApiKey(key="sha256:" + "ab" * 32)

    async def scenario() -> None:
        client = Redis.from_url(redis.url)
        store = TaskStore(client, 60)
        sweeper = Sweeper(store, Settings(api_keys=[key], max_queue_seconds=1.0))
        # lines exist where any key has a share: the default's, or its own with none
        own = ApiKey(key="sha256:" + "cd" * 32, max_queued=2)
        assert Sweeper(store, Settings(api_keys=[own], queued_per_key=0)).lines_used
        assert not Sweeper(store, Settings(api_keys=[key], queued_per_key=0)).lines_used

        async def submit(count: int) -> list[str]:
            made = [Task(id=new_task_id(), backend=BACKEND, model="tiny.en", owner=key.owner,
                         state=TaskState.PENDING, input_path=str(JFK)) for _ in range(count)]
            for task in made:
                await store.submit(task, None, lane_share=1)
            return [task.id for task in made]

        old = await submit(3)  # one in the lane, two in line
        await asyncio.sleep(1.1)
        young = await submit(1)  # in line too, behind them
        # the second comes in (a new entry, dated now): still overdue from its submit
        assert await store.cancel(old[0], BACKEND) == TaskState.CANCELLED
        assert await sweeper.fail_overdue(BACKEND, 1.0) == 2
        states = [task.state for task in await store.tasks(old + young) if task]
        assert states == [TaskState.CANCELLED] + [TaskState.FAILED] * 2 + [
            TaskState.PENDING], states
        more = await submit(2)  # one more in line behind `young`
        await client.set(keys.no_worker_since(BACKEND), repr(time.time() - 3600))
        sweeper.settings.no_worker_seconds = 60.0
        assert await sweeper.fail_stranded(BACKEND, live=False) == 3
        states = [task.state for task in await store.tasks(young + more) if task]
        assert states == [TaskState.FAILED] * 3, states
        await client.aclose()

    asyncio.run(scenario())


def test_a_backend_whose_worker_is_gone_fails_its_running_and_pending_tasks(
        redis: procs.RedisServer, tmp_path: Path) -> None:
    no_worker, period, heartbeat_ttl = 2.0, 0.5, 1.5  # heartbeat 0.5 s (procs.service_env)
    gateway = procs.gateway(redis.url, tmp_path, no_worker_seconds=str(no_worker)).start()
    worker = procs.worker(redis.url, tmp_path).start()
    try:
        wait_until(lambda: _ready(gateway.url)["ready"], 10, "worker live")
        running = submit_file(gateway.url, LONG).json()["taskid"]
        wait_until(lambda: _task(gateway.url, running)["status"] == "RUNNING", 60, "RUNNING",
                   0.02)
        os.kill(worker.pid, signal.SIGKILL)
        killed = time.monotonic()
        pending = submit_file(gateway.url, JFK).json()["taskid"]
        finals = [wait_done(gateway.url, task_id, timeout=30) for task_id in (running, pending)]
        took = time.monotonic() - killed
        assert [final["status"] for final in finals] == ["FAILED", "FAILED"], finals
        assert [_task(gateway.url, t)["error_code"] for t in (running, pending)] == \
            ["no_worker", "no_worker"]
        assert "stopped" in finals[0]["error"] and "none can start" in finals[1]["error"]
        assert took <= heartbeat_ttl + no_worker + period + 1.5, took
        backend = _ready(gateway.url)
        assert backend["ready"] is False and backend["workers"] == 0
    finally:
        worker.stop()
        gateway.stop()


def _ready(url: str) -> dict:
    return http.get(f"{url}/ready", timeout=10).json()["backends"][BACKEND]


def _task(url: str, task_id: str) -> dict:
    return http.get(f"{url}/v1/tasks/{task_id}", timeout=10).json()


def test_a_sweep_cut_short_leaves_its_work_for_the_next(redis: procs.RedisServer) -> None:
    """A pass that read the tasks past their deadline, or the waiting entries of a backend
    with no worker, and then stopped (Redis gone, the gateway stopped) before failing them:
    the next pass finds them again, so each still fails."""

    async def scenario() -> list[str]:
        client = Redis.from_url(redis.url)
        store = TaskStore(client, 60)
        late = Task(id=new_task_id(), backend=BACKEND, model="tiny.en",
                    state=TaskState.PENDING, input_path=str(JFK), deadline=time.time() + 0.2)
        await store.submit(late, None)
        await asyncio.sleep(0.3)
        assert await upkeep.deadlines_passed(store, BACKEND, 10) == [late.id]  # then cut
        sweeper = Sweeper(store, Settings(no_worker_seconds=0.5))
        assert await sweeper.fail_past_deadline(BACKEND) == 1
        stranded = await _queued(store)
        await upkeep.no_worker_since(store, BACKEND, 60)
        await asyncio.sleep(0.6)

        async def cut_short(tasks: list[Task], *_: object) -> int:
            raise ConnectionError("the pass ends here")

        failing, sweeper.fail_tasks = sweeper.fail_tasks, cut_short  # type: ignore[method-assign]
        with pytest.raises(ConnectionError):
            await sweeper.fail_stranded(BACKEND, live=False)
        sweeper.fail_tasks = failing  # type: ignore[method-assign]
        assert await sweeper.fail_stranded(BACKEND, live=False) == 1
        codes = [(await store.get(task_id)) for task_id in (late.id, stranded.id)]
        await client.aclose()
        return [task.error_code if task else "gone" for task in codes]

    assert asyncio.run(scenario()) == ["deadline_exceeded", "no_worker"]


async def _queued(store: TaskStore) -> Task:
    task = Task(id=new_task_id(), backend=BACKEND, model="tiny.en", state=TaskState.PENDING,
                input_path=str(JFK))
    await store.submit(task, None)
    stored = await store.get(task.id)
    assert stored is not None and stored.state == TaskState.PENDING
    return stored


async def _finished_tasks(redis_url: str, count: int) -> None:
    client = Redis.from_url(redis_url)
    store = TaskStore(client, 3600)

    for _ in range(count):
        task = await _queued(store)
        assert await store.finish(task, TaskState.SUCCEEDED, attempt=None,
                                  entry_id=task.entry_id, result={"text": ""})
    await client.aclose()


def test_a_task_queued_past_the_retention_keeps_what_it_needs_to_run(
        redis: procs.RedisServer) -> None:
    """With no bound on the wait (SPEECH_MAX_QUEUE_SECONDS=0) and a 1 s retention, a task
    queued for 2.5 s keeps its input, its idempotency key and its queue entry through the
    sweeps, and a worker then runs it; a cancelled task's deadline entry goes at once, the
    finished task's idempotency key a retention after its end, and the entries then."""
    settings = inprocess.worker_settings(redis.url, retention_seconds=1,
                                         max_queue_seconds=0, no_worker_seconds=0)

    async def scenario() -> None:
        client = Redis.from_url(redis.url)
        store = TaskStore.for_settings(client, settings)
        sweeper = Sweeper(store, settings)
        far = time.time() + 1e6
        waiting, cancelled = (Task(id=new_task_id(), backend=BACKEND, model="tiny.en",
                                   state=TaskState.PENDING, params={"beam_size": 1},
                                   audio_seconds=11.0, deadline=far) for _ in range(2))
        await store.submit(cancelled, JFK.read_bytes())
        await store.submit(waiting, JFK.read_bytes(), idempotency_key="once")
        assert await store.cancel(cancelled.id, BACKEND) == TaskState.CANCELLED
        assert await client.zrange(keys.deadlines(BACKEND), 0, -1) == [waiting.id.encode()]
        await asyncio.sleep(2.5)
        await sweeper.sweep()
        assert await store.blobs.input(waiting.id) == JFK.read_bytes()
        with pytest.raises(Duplicate):
            await store.submit(Task(id=new_task_id(), backend=BACKEND, model="tiny.en",
                                    state=TaskState.PENDING), b"x", idempotency_key="once")
        # the cancelled task's entry (ahead of it) is trimmed, its own kept
        assert await client.xlen(keys.queue(BACKEND)) == 1
        worker = Worker(settings, FasterWhisperEngine(settings), client, handle_signals=False,
                        exit=lambda code: None, burst=True)
        await worker.run()
        done = await store.get(waiting.id)
        assert done is not None and done.state == TaskState.SUCCEEDED, done
        assert await client.zcard(keys.deadlines(BACKEND)) == 0
        assert 0 < await client.ttl(keys.idempotency("", "once")) <= 1
        await asyncio.sleep(1.2)
        await sweeper.sweep()
        assert await client.xlen(keys.queue(BACKEND)) == 0
        await client.aclose()

    asyncio.run(scenario())


def test_consumers_leave_the_group_when_stopped_or_long_idle(redis: procs.RedisServer) -> None:
    """A worker that stops leaves the group (every pod is a new consumer name); one that
    did not (killed) goes once idle with nothing pending; one holding an entry stays."""
    settings = inprocess.worker_settings(redis.url, consumer="leaver")

    async def names(client: Redis) -> set[str]:
        found: set[str] = set()
        for lane in keys.LANES:
            found |= {c["name"].decode() for c in await client.xinfo_consumers(
                keys.queue(BACKEND, lane), keys.WORKER_GROUP)}
        return found

    async def scenario() -> None:
        client = Redis.from_url(redis.url)
        store = TaskStore(client, 60)
        done = await _queued(store)
        worker = Worker(settings, FasterWhisperEngine(settings), client, handle_signals=False,
                        exit=lambda code: None, burst=True)
        await worker.run()
        assert (await store.get(done.id)).state == TaskState.SUCCEEDED  # type: ignore[union-attr]
        assert await names(client) == set()  # it read, ran, and left
        await _queued(store)  # a killed worker's name: what it read was claimed and done
        [[stream, [(entry_id, _)]]] = await client.xreadgroup(
            keys.WORKER_GROUP, "killed", {keys.queue(BACKEND): ">"}, count=1)
        await client.xack(stream, keys.WORKER_GROUP, entry_id)
        await _queued(store)
        await client.xreadgroup(keys.WORKER_GROUP, "holder", {keys.queue(BACKEND): ">"}, count=1)
        await asyncio.sleep(0.3)
        assert await names(client) == {"killed", "holder"}
        assert await upkeep.forget_idle_consumers(store, BACKEND, 0.2) == 1
        assert await names(client) == {"holder"}
        await client.aclose()

    asyncio.run(scenario())


def test_every_backend_has_its_consumer_group_without_a_worker(redis: procs.RedisServer,
                                                                tmp_path: Path) -> None:
    """With its workers scaled to zero, KEDA's stream scalers read a backend's consumer group
    to wake one; only a worker made it, so on a fresh or flushed Redis a backend at zero
    never woke. The gateway makes every enabled backend's group at start and on each pass."""
    client = redis.client()
    models = {"faster-whisper": {"tiny.en": "bundled"}, "parakeet": {"tiny": "unused"}}
    gateway = procs.gateway(redis.url, tmp_path, models=models, max_queue_seconds="4").start()

    def made() -> bool:
        return all(client.exists(keys.queue(backend, lane)) and any(
            group["name"] == keys.WORKER_GROUP.encode()
            for group in client.xinfo_groups(keys.queue(backend, lane)))
            for backend in models for lane in keys.LANES)

    try:
        wait_until(made, 10, "the groups at the gateway's start")
        client.flushall()
        wait_until(made, 10, "the groups again after a flush")  # a pass is ~1 s here
    finally:
        gateway.stop()
