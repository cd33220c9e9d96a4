"""Predicted waits use each model's own processing rate (issue 18): a backend serving a fast
and a slow model weighs each model's queued audio by its rate. Deterministic, on a real
redis-server and the store's real Lua scripts: rates recorded as a worker records them,
tasks queued, started, finished and cancelled as the gateway and workers do it, and every
estimate checked against the formula in gateway/policy/admission.py.

(No second faster-whisper model of a really different speed ships with the tests, so the
end-to-end check that workers record per-model rates is in test_admission.py.)"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections.abc import Iterator

import pytest
from redis.asyncio import Redis

from common import keys
from common.schemas import TaskState
from common.settings import Settings
from common.store import QueueFull, StoreError, Task, TaskStore, WorkerStore, new_task_id
from common.store import admission as facts
from gateway.errors import RequestError
from gateway.policy import admission
from harness import procs

BACKEND = "faster-whisper"
FAST, SLOW, NEW = "fast", "slow", "unmeasured"  # 10 and 1 audio-seconds per wall second


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = procs.RedisServer(tmp_path_factory.mktemp("rates") / "redis").start()
    yield server.url
    server.stop()


async def queue(store: TaskStore, model: str, seconds: float, lane: str = keys.BATCH,
                backend: str = BACKEND) -> Task:
    task = Task(id=new_task_id(), backend=backend, model=model, state=TaskState.PENDING,
                input_path="/nonexistent/clip.wav", audio_seconds=seconds, lane=lane)
    await store.submit(task, None)
    return task


def test_each_model_counts_at_its_own_rate_and_the_backlog_balances(redis_url: str) -> None:
    async def scenario() -> None:
        redis = Redis.from_url(redis_url)
        store = TaskStore(redis, 60)
        await store.ensure_queue(BACKEND)
        for consumer in ("worker-a", "worker-b"):  # two live workers share the work
            await WorkerStore(redis, Settings(backend=BACKEND), consumer).beat({})
        rates = facts.RateRecorder(redis, BACKEND)
        await rates.record(FAST, 10.0, 1.0)
        await rates.record(SLOW, 2.0, 2.0)

        running = await queue(store, SLOW, 4.0)
        assert await store.start(running.id, "worker-a", 1, BACKEND) == 1
        queued = [await queue(store, FAST, 10.0), await queue(store, FAST, 10.0),
                  await queue(store, SLOW, 3.0), await queue(store, NEW, 6.0),
                  await queue(store, FAST, 5.0, keys.INTERACTIVE)]

        view = await admission.outlook(store, BACKEND)
        assert view.workers == 2
        assert view.rates.models == {FAST: 10.0, SLOW: 1.0}
        # the backend's rate over all models is kept too: the work over the time it took,
        # the older time fading by the newer (facts.RATE_HORIZON_SECONDS)
        keep = math.exp(-2.0 / facts.RATE_HORIZON_SECONDS)
        assert view.rates.backend == pytest.approx((10.0 * keep + 2.0) / (1.0 * keep + 2.0))
        assert view.rate_of(NEW) == pytest.approx(5.5)  # the mean of the measured models
        # a new batch task has both lanes ahead; the running slow task has just started:
        # what is left of it is its processing time less the time it has run
        work_ahead = 5.0 / 10 + 20.0 / 10 + 3.0 / 1 + 6.0 / 5.5
        running_work = 4.0 / 1
        left = view.running_left(time.time())
        assert left is not None and running_work - 1.0 < left <= running_work
        start = (work_ahead + left) / 2
        assert view.ahead(keys.BATCH) == (5, pytest.approx(work_ahead))
        assert view.ahead(keys.INTERACTIVE) == (1, pytest.approx(0.5))
        assert view.start_after(work_ahead) == pytest.approx(start, abs=0.05)
        # with one rate for every model (the backend's, 4.0) the same queue reads shorter
        # (34 audio-seconds queued, 4 running): per-model rates weigh the slow model's
        # share of it by the slow rate
        one_rate = view.rates.backend
        assert one_rate is not None
        assert start > 1.05 * (34.0 / one_rate + 4.0 / one_rate) / 2
        # the task's own finish is at its model's rate
        slow_estimate = view.estimate(work_ahead, SLOW, 2.0)
        fast_estimate = view.estimate(work_ahead, FAST, 2.0)
        assert slow_estimate is not None and fast_estimate is not None
        assert slow_estimate.finish == pytest.approx(start + 2.0, abs=0.05)
        assert fast_estimate.finish == pytest.approx(start + 0.2, abs=0.05)

        # a queued task third in line: two tasks of the mean queued processing time ahead
        third = queued[3]
        estimate = await admission.estimate_queued(store, await store.get(third.id), 3)
        assert estimate is not None
        expected = (2 * work_ahead / 5 + left) / 2
        assert estimate.start == pytest.approx(expected, abs=0.05)
        assert estimate.finish == pytest.approx(expected + 6.0 / 5.5, abs=0.05)

        # Retry-Afters come from the same numbers
        limited = Settings(max_queue_seconds_ahead={BACKEND: 1.0})
        with pytest.raises(RequestError) as refused:
            await admission.admit(store, limited, await queue_view(NEW, 1.0))
        assert refused.value.status_code == 429 and refused.value.code == "queue_full"
        assert refused.value.headers == {"Retry-After": str(math.ceil(start - 1.0))}
        await admission.admit(store, Settings(max_queue_seconds_ahead={BACKEND: start + 1}),
                              await queue_view(NEW, 1.0))
        full = await admission.queue_full(store, await queue_view(FAST, 1.0), QueueFull(5), 4)
        excess = (5 - 4 + 1) * work_ahead / 5
        assert full.headers == {
            "Retry-After": str(math.ceil((excess + left) / 2))}
        # a key past its share of the limit: its next task can go in once a worker is free
        share = await admission.queue_full(store, await queue_view(FAST, 1.0),
                                           QueueFull(2, own=True), 4)
        assert share.status_code == 429 and "its share of the limit 4" in share.message
        assert share.headers == {"Retry-After": str(math.ceil(left / 2))}

        # every task that leaves leaves the backlog, per lane and per model
        for task in queued:
            assert await store.cancel(task.id, BACKEND) == TaskState.CANCELLED
        assert await store.finish(running, TaskState.SUCCEEDED, attempt=1,
                                  entry_id=running.entry_id, result={"text": ""})
        backlog = {k.decode(): float(v) for k, v in
                   (await redis.hgetall(keys.backlog(BACKEND))).items()}
        assert f"batch:seconds:{FAST}" in backlog and f"running:seconds:{SLOW}" in backlog
        assert not {name: value for name, value in backlog.items() if abs(value) >= 1e-9}
        assert await admission.estimate_queued(store, third, 1) is not None  # rates stay
        await redis.aclose()

    asyncio.run(scenario())


async def queue_view(model: str, seconds: float) -> Task:
    """A new task as admit() sees it before its submit (nothing written)."""
    return Task(id=new_task_id(), backend=BACKEND, model=model, state=TaskState.PENDING,
                audio_seconds=seconds)


def test_a_handful_of_tiny_tasks_moves_the_rate_by_the_time_they_take(redis_url: str) -> None:
    """Ten near-empty tasks (a 0.1 s clip Whisper pads to 30 s: 0.33 s each) after ten long
    ones move the rate by the time they really took: it was an average of per-task ratios, and
    any key's handful cut it 30x, so every other key's deadline submit was refused."""
    async def scenario() -> float:
        redis = Redis.from_url(redis_url)
        rates = facts.RateRecorder(redis, "rates-tiny")
        for _ in range(10):
            await rates.record(FAST, 100.0, 2.0)  # 50 audio-seconds a second
        for _ in range(10):
            await rates.record(FAST, 0.1, 0.33)
        rate = float(await redis.hget(keys.rate("rates-tiny"), f"rate:{FAST}") or 0)
        await redis.aclose()
        return rate

    rate = asyncio.run(scenario())
    # the time the tiny tasks took (3.3 s) against the long ones' (~19 s, faded): ~42
    assert 35.0 < rate < 50.0, rate

    async def upgraded() -> float:
        """A rate an older version kept (no sums) is a horizon's worth of history: one
        near-empty task after an upgrade does not set it alone."""
        redis = Redis.from_url(redis_url)
        await redis.hset(keys.rate("rates-old"), mapping={f"rate:{FAST}": "50", "rate": "50"})
        await facts.RateRecorder(redis, "rates-old").record(FAST, 0.1, 0.33)
        rate = float(await redis.hget(keys.rate("rates-old"), f"rate:{FAST}") or 0)
        await redis.aclose()
        return rate

    assert 45.0 < asyncio.run(upgraded()) < 50.0


def test_no_rate_no_estimate_then_the_backend_rate_then_the_models_mean(
        redis_url: str) -> None:
    backend = "parakeet"

    async def scenario() -> None:
        redis = Redis.from_url(redis_url)
        store = TaskStore(redis, 60)
        await store.ensure_queue(backend)
        task = await queue(store, FAST, 8.0, backend=backend)
        view = await admission.outlook(store, backend)
        assert view.ahead(keys.BATCH) is None and view.start_after(0.0) is None
        assert await admission.estimate_queued(store, task, 1) is None
        # no rate, no refusal: a deadline is not held against an unknown wait
        await admission.admit(store, Settings(max_queue_seconds_ahead={backend: 0.1}), task)

        rates = facts.RateRecorder(redis, backend)
        await rates.record("", 4.0, 1.0)  # a rate recorded without a model (as before)
        view = await admission.outlook(store, backend)
        assert view.rates.models == {} and view.rate_of(FAST) == pytest.approx(4.0)
        assert view.ahead(keys.BATCH) == (1, pytest.approx(2.0))

        await rates.record(SLOW, 1.0, 1.0)
        await rates.record(NEW, 3.0, 1.0)
        view = await admission.outlook(store, backend)
        assert view.rate_of(FAST) == pytest.approx(2.0)  # mean of 1 and 3, not the backend's
        assert view.ahead(keys.BATCH) == (1, pytest.approx(4.0))
        await redis.aclose()

    asyncio.run(scenario())


def test_a_backlog_from_before_per_model_sums_still_counts_whole() -> None:
    """Tasks queued by an older version count in the lane totals only: the seconds no model
    is known for count at the fallback rate; per-model sums never exceed their lane's."""
    backlog = facts.backlog_of({"batch:tasks": "3", "batch:seconds": "9.0",
                              "batch:seconds:fast": "4.0", "interactive:seconds": "2.0",
                              "interactive:seconds:fast": "4.0", "running:seconds": "1.0"})
    assert backlog.ahead_by_model(keys.BATCH) == {"fast": 6.0, "": 5.0}
    assert backlog.running_by_model() == {"": 1.0}
    view = admission.Outlook(backlog, facts.Rates(None, {"fast": 2.0, "slow": 1.0}), 1)
    assert view.ahead(keys.BATCH) == (3, pytest.approx(6.0 / 2 + 5.0 / 1.5))


def test_a_poll_reads_in_one_call_what_the_separate_reads_say(redis_url: str) -> None:
    """store.poll (one Lua call) against the record, the position and the outlook read
    apart, for a batch task behind interactive work, an interactive one, a finished one
    (its result and usage as stored, unparsed) and one stored before `usage` was kept."""
    async def scenario() -> None:
        redis = Redis.from_url(redis_url)
        store = TaskStore(redis, 60)
        backend = "qwen3"
        await store.ensure_queue(backend)
        await WorkerStore(redis, Settings(backend=backend), "poller").beat({})
        await facts.RateRecorder(redis, backend).record(FAST, 10.0, 1.0)
        batch = [await queue(store, FAST, 2.0, backend=backend) for _ in range(3)]
        fast = await queue(store, FAST, 1.0, keys.INTERACTIVE, backend=backend)
        for task in (batch[-1], fast):
            poll = await store.poll.read(task.id)
            assert poll is not None and poll.task.state == TaskState.PENDING
            assert poll.position == await store.positions.of(task) == (
                1 if task is fast else 4)
            assert poll.outlook == tuple(await store.outlook.facts(backend))
            assert poll.task.lane == task.lane and poll.task.work_units == task.work_units
        done = batch[0]
        attempt = await store.start(done.id, "poller", 1, backend)
        result = {"text": "hi", "usage": {"audio_seconds": 2.0}}
        assert await store.finish(done, TaskState.SUCCEEDED, attempt=attempt,
                                  entry_id=done.entry_id, result=result)
        poll = await store.poll.read(done.id)
        assert poll is not None and poll.position is None and poll.outlook is None
        assert json.loads(poll.result or b"") == result
        assert json.loads(poll.usage or b"") == result["usage"]
        await redis.hdel(keys.task(done.id), "usage")  # a task finished before this field
        assert (await store.poll.read(done.id)).usage is None  # type: ignore[union-attr]
        assert await store.poll.read("no-such-task") is None
        await redis.aclose()

    asyncio.run(scenario())


def test_polls_made_together_share_one_script_call_and_each_gets_its_own_reply(
        redis_url: str) -> None:
    """Polls made in one turn of the event loop are one EVALSHA (INFO commandstats): queued
    tasks of two backends, a finished one and a missing id, each answered as when polled
    alone; a store error reaches every poll of the call."""
    async def scenario() -> None:
        redis = Redis.from_url(redis_url)
        store = TaskStore(redis, 60)
        for backend in ("qwen3", "parakeet"):
            await store.ensure_queue(backend)
            await facts.RateRecorder(redis, backend).record(FAST, 10.0, 1.0)
        tasks = [await queue(store, FAST, 2.0, backend=backend)
                 for backend in ("qwen3", "parakeet", "qwen3", "parakeet", "qwen3")]
        done = tasks[0]
        attempt = await store.start(done.id, "poller", 1, done.backend)
        assert await store.finish(done, TaskState.SUCCEEDED, attempt=attempt,
                                  entry_id=done.entry_id, result={"text": "hi"})
        ids = [task.id for task in tasks] + ["no-such-task"]
        alone = [await store.poll.read(task_id) for task_id in ids]
        await redis.config_resetstat()
        together = await asyncio.gather(*(store.poll.read(task_id) for task_id in ids))
        stats = await redis.info("commandstats")
        assert stats["cmdstat_evalsha"]["calls"] == 1
        assert together == alone
        assert together[-1] is None and together[0] is not None and together[0].result
        positions = [(poll.task.backend, poll.position) for poll in together[1:-1] if poll]
        (_, first_parakeet), (_, first_qwen3) = positions[:2]  # behind earlier tests' tasks
        assert first_parakeet and first_qwen3
        assert positions == [("parakeet", first_parakeet), ("qwen3", first_qwen3),
                             ("parakeet", first_parakeet + 1), ("qwen3", first_qwen3 + 1)]
        assert together[1].outlook is not None and together[1].outlook[2] == 0  # type: ignore[union-attr]
        await redis.aclose()
        broken = Redis.from_url(redis_url.rsplit(":", 1)[0] + ":1", socket_connect_timeout=1)
        failing = TaskStore(broken, 60)
        replies = await asyncio.gather(*(failing.poll.read(task_id) for task_id in ids),
                                       return_exceptions=True)
        assert len(replies) == len(ids)
        assert all(isinstance(reply, StoreError) for reply in replies)
        await broken.aclose()

    asyncio.run(scenario())
