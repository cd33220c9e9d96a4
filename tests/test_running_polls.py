"""A RUNNING task polled often is answered without Redis until its state can have changed
(common/store/running_polls.py). On a real redis-server with the store's own scripts and the
gateway's own EventHub: every read counted in INFO commandstats (one EVALSHA a read)."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager

import pytest
from redis.asyncio import Redis

from common import keys
from common.schemas import TaskState
from common.store import Task, TaskStore, new_task_id
from common.store.events import EventHub
from common.store.running_polls import RunningPolls
from harness import procs

BACKEND = "faster-whisper"


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    server = procs.RedisServer(tmp_path_factory.mktemp("running-polls") / "redis").start()
    yield server.url
    server.stop()


@asynccontextmanager
async def parts(redis_url: str, max_age: float, most: int = 100,
                pace: float = 0.0) -> AsyncIterator[tuple[TaskStore, EventHub, RunningPolls]]:
    store = TaskStore(Redis.from_url(redis_url), 60)
    await store.ensure_queue(BACKEND)
    hub = EventHub(store, 10)
    await hub.start()
    try:
        yield store, hub, RunningPolls(store.poll, hub, max_age=max_age, most=most, pace=pace)
    finally:
        await hub.close()
        await store.close()


async def running(store: TaskStore) -> Task:
    task = Task(id=new_task_id(), backend=BACKEND, model="tiny.en", state=TaskState.PENDING,
                audio_seconds=1.0)
    await store.submit(task, b"x" * 100)
    assert await store.start(task.id, "test-worker", 1, BACKEND) == 1
    return task


async def reads(store: TaskStore) -> int:
    """Poll reads Redis has answered so far (each is one EVALSHA of the poll script)."""
    stats = await store.redis.info("commandstats")
    return int(stats.get("cmdstat_evalsha", {}).get("calls", 0))


async def until(condition: Callable[[], bool], seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.01)


async def kept(store: TaskStore, hub: EventHub, polls: RunningPolls, task: Task) -> None:
    """Polls as a rapid poller does until the reply is kept: read, read again soon (the
    subscription), read once it holds (kept)."""
    for _ in range(2):
        assert (await polls.read(task.id)).task.state == TaskState.RUNNING  # type: ignore[union-attr]
    await until(lambda: hub.subscribed(task.id))
    assert (await polls.read(task.id)).task.state == TaskState.RUNNING  # type: ignore[union-attr]
    before = await reads(store)
    assert (await polls.read(task.id)).task.state == TaskState.RUNNING  # type: ignore[union-attr]
    assert await reads(store) == before, "the reply was not kept"


def test_a_running_task_polled_often_reads_redis_again_only_when_its_state_changes(
        redis_url: str) -> None:
    """Kept for as long as no message says otherwise (max_age far away): twenty polls, no
    read; a segment event changes nothing; the terminal write's message ends it at once,
    and the finished task's subscription is dropped."""
    async def scenario() -> None:
        async with parts(redis_url, max_age=600) as (store, hub, polls):
            task = await running(store)
            await kept(store, hub, polls, task)
            before = await reads(store)
            replies = [await polls.read(task.id) for _ in range(20)]
            await store.publish(task.id, {"type": "segment", "id": 0, "text": "so far"})
            await asyncio.sleep(0.05)
            replies.append(await polls.read(task.id))
            assert await reads(store) == before
            assert {reply.task.state for reply in replies if reply} == {TaskState.RUNNING}
            assert all(reply is not None and reply.task.owner == task.owner
                       for reply in replies)

            assert await store.finish(task, TaskState.SUCCEEDED, attempt=1,
                                      entry_id=task.entry_id, result={"text": "done"})
            seen: list[TaskState] = []

            async def poll() -> bool:
                reply = await polls.read(task.id)
                assert reply is not None
                seen.append(reply.task.state)
                return reply.task.state == TaskState.SUCCEEDED

            deadline = time.monotonic() + 5
            while not await poll():
                assert time.monotonic() < deadline, f"still {seen[-1]} after the terminal write"
                await asyncio.sleep(0.01)
            assert seen[-1] == TaskState.SUCCEEDED
            assert (await polls.read(task.id)).result  # type: ignore[union-attr]
            assert not hub.subscribed(task.id)

    asyncio.run(scenario())


def test_a_change_no_message_tells_of_is_read_after_max_age_and_at_once_after_a_reconnect(
        redis_url: str) -> None:
    """A state written without a message (as a restore or a failover can leave it): served
    from the kept reply for at most max_age; when the hub's connection drops, the kept
    reply is not served any more (the messages in between may be lost)."""
    async def scenario() -> None:
        async with parts(redis_url, max_age=2.0) as (store, hub, polls):
            task = await running(store)
            await kept(store, hub, polls, task)
            await store.redis.hset(keys.task(task.id), "state", "FAILED")
            started = time.monotonic()
            while (await polls.read(task.id)).task.state != TaskState.FAILED:  # type: ignore[union-attr]
                assert time.monotonic() - started < 2.0 + 2, "the kept reply outlived max_age"
                await asyncio.sleep(0.05)

        async with parts(redis_url, max_age=600) as (store, hub, polls):
            task = await running(store)
            await kept(store, hub, polls, task)
            await store.redis.execute_command("CLIENT", "KILL", "TYPE", "pubsub")
            await until(lambda: not hub.subscribed(task.id))
            await store.redis.hset(keys.task(task.id), "state", "FAILED")
            reply = await polls.read(task.id)
            assert reply is not None and reply.task.state == TaskState.FAILED

    asyncio.run(scenario())


def test_a_process_keeps_at_most_its_limit_of_tasks(redis_url: str) -> None:
    """Beyond `most` tasks, a poll reads Redis as before (and no subscription is taken)."""
    async def scenario() -> None:
        async with parts(redis_url, max_age=600, most=1) as (store, hub, polls):
            first, second = await running(store), await running(store)
            await kept(store, hub, polls, first)
            for _ in range(3):
                await polls.read(second.id)
                await asyncio.sleep(0.02)
            before = await reads(store)
            assert (await polls.read(second.id)).task.state == TaskState.RUNNING  # type: ignore[union-attr]
            assert await reads(store) == before + 1
            assert not hub.subscribed(second.id)

    asyncio.run(scenario())


def test_a_poll_sooner_than_the_pace_waits_for_it_or_for_the_next_state_change(
        redis_url: str) -> None:
    """With a pace, a kept task is answered at most once a pace: a poll sent right after a
    reply waits out the rest (no read of Redis meanwhile), and the terminal write's message
    ends the wait at once, with the finished state. Bounds are lower ones, or a long pace
    against an early end: no speed is measured."""
    pace = 2.0

    async def scenario() -> None:
        async with parts(redis_url, max_age=600, pace=pace) as (store, hub, polls):
            task = await running(store)
            await kept(store, hub, polls, task)
            before = await reads(store)
            answered = []
            for _ in range(3):
                reply = await polls.read(task.id)
                assert reply is not None and reply.task.state == TaskState.RUNNING
                answered.append(time.monotonic())
            assert await reads(store) == before
            gaps = [later - earlier for earlier, later in itertools.pairwise(answered)]
            assert min(gaps) >= pace * 0.9, f"polls answered {gaps} s apart, pace {pace} s"

            async def finish_soon() -> None:
                await asyncio.sleep(0.1)
                assert await store.finish(task, TaskState.SUCCEEDED, attempt=1,
                                          entry_id=task.entry_id, result={"text": "done"})

            finishing = asyncio.create_task(finish_soon())
            asked = time.monotonic()
            reply = await polls.read(task.id)  # waits: the last reply was just now
            waited = time.monotonic() - asked
            await finishing
            assert reply is not None and reply.task.state == TaskState.SUCCEEDED
            assert waited < pace - 0.5, f"the terminal write did not end the wait ({waited} s)"
            assert not hub.subscribed(task.id)

        async with parts(redis_url, max_age=600, pace=pace) as (store, hub, polls):
            task = await running(store)
            # polls of a task not kept (yet) are never held
            asked = time.monotonic()
            for _ in range(2):
                await polls.read(task.id)
            assert time.monotonic() - asked < pace * 0.9

    asyncio.run(scenario())
