"""Redis hygiene: one client factory with one retry policy, no SCAN on a request path,
a worker that gives up on a write Redis keeps refusing (logged and counted, not stalled),
scripts loaded again where they are missing, and the replica wait on submits."""

from __future__ import annotations

import ast
import asyncio
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.asyncio import Redis

from common import keys
from common.schemas import TaskState
from common.settings import Settings
from common.store import Task, TaskStore, new_task_id
from common.store.connection import RETRIES, bounded_client, worker_client
from common.store.queue import Lease
from common.store.replicas import NotReplicated
from common.store.worker import WorkerStore
from harness import procs
from harness.http_client import http
from tests.helpers import JFK
from tests.test_metrics import sample
from workers.engines.faster_whisper import FasterWhisperEngine
from workers.runtime import Worker

BACKEND = "faster-whisper"


def test_every_client_is_built_by_the_factory_with_the_one_retry_policy() -> None:
    with_url = Settings()
    with_sentinels = Settings(redis_sentinels=["127.0.0.1:26379", "127.0.0.1:26380"])
    for settings in (with_url, with_sentinels):
        for client in (bounded_client(settings, "g"), worker_client(settings, "w")):
            retry = client.connection_pool.connection_kwargs["retry"]
            assert retry.get_retries() == RETRIES
    # and nothing else in the services builds a client (redis-py's defaults differ by how)
    root = Path(__file__).resolve().parents[1]
    builders = {"from_url", "from_pool", "Redis", "Sentinel", "StrictRedis"}
    found = []
    for package in ("gateway", "workers", "common"):
        for path in (root / package).rglob("*.py"):
            if path.name == "connection.py" and path.parent.name == "store":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call):
                    name = getattr(node.func, "attr", getattr(node.func, "id", ""))
                    if name in builders:
                        found.append(f"{path.relative_to(root)}:{node.lineno}")
    assert found == []


def test_metrics_scrape_issues_no_scan(tmp_path: Path, redis: procs.RedisServer) -> None:
    client = redis.client()
    pipe = client.pipeline(transaction=False)
    for n in range(10_000):
        pipe.set(f"unrelated:{n}", n)
    pipe.execute()
    client.hset(keys.breaker(BACKEND, "tiny.en"),
                mapping={"open": 1, "failures": 3, "reopens_at": time.time() + 3600})
    gateway = procs.gateway(redis.url, tmp_path).start()
    try:
        client.config_resetstat()
        scraped = http.get(f"{gateway.url}/metrics", timeout=30).text
        stats = client.info("commandstats")
    finally:
        gateway.stop()
    assert sample(scraped, "speech_redis_up") == 1
    # the breakers are still read: by their models' names
    assert sample(scraped, "speech_breaker_open", backend=BACKEND, model="tiny.en") == 1
    assert stats["cmdstat_hgetall"]["calls"] > 0  # the scrape did read Redis
    assert "cmdstat_scan" not in stats and "cmdstat_keys" not in stats, sorted(stats)


def test_a_terminal_write_redis_keeps_refusing_is_given_up_not_retried_for_ever(
        redis: procs.RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    settings = Settings(redis_url=redis.url, models={BACKEND: {"tiny.en": "bundled"}},
                        consumer="refused", heartbeat_seconds=0.2, idle_unload_seconds=-1,
                        min_uptime_seconds=0)
    task = Task(id=new_task_id(), backend=BACKEND, model="tiny.en", state=TaskState.PENDING,
                audio_seconds=11.0)

    async def scenario() -> Worker:
        client = Redis.from_url(redis.url)
        await TaskStore(client, 600).submit(task, JFK.read_bytes())
        events = client.pubsub()
        await events.subscribe(keys.events(task.id))
        worker = Worker(settings, FasterWhisperEngine(settings), worker_client(settings, "t"),
                        handle_signals=False, exit=lambda code: None, burst=True)
        run = asyncio.create_task(worker.run())
        async with asyncio.timeout(120):  # never stalls: the burst run returns
            async for message in events.listen():
                if message["type"] == "message" and b"RUNNING" in message["data"]:
                    break
            # a real refusal while the engine runs: the record is no hash any more, so
            # Redis answers WRONGTYPE to the finish script's first command, every time
            await client.set(keys.task(task.id), "not a hash")
            await run
        await events.aclose()
        await client.aclose()
        return worker

    with caplog.at_level(logging.WARNING, logger="worker"):
        worker = asyncio.run(scenario())
    assert worker.consumer.tasks_done == 0
    client = redis.client()
    assert client.hget(keys.counters(BACKEND), "store_refusals") == b"1"
    refused = [r.getMessage() for r in caplog.records if "refused a write" in r.getMessage()]
    assert len(refused) == 2 and "WRONGTYPE" in refused[0], refused
    assert any("giving up on a redis write" in r.getMessage() for r in caplog.records)
    # nothing was stored or acked: the entry is still pending, for redelivery
    assert client.get(keys.task(task.id)) == b"not a hash"
    assert int(client.xpending(keys.queue(BACKEND), keys.WORKER_GROUP)["pending"]) == 1


def _task() -> Task:
    return Task(id=new_task_id(), backend=BACKEND, model="tiny.en", state=TaskState.PENDING,
                audio_seconds=1.0)


def test_scripts_are_loaded_again_where_they_are_missing(redis: procs.RedisServer) -> None:
    """A promoted replica has an empty script cache: the next call hears NOSCRIPT."""
    redis.client().config_resetstat()
    async def scenario() -> list[Task | None]:
        store = TaskStore.for_settings(worker_client(Settings(redis_url=redis.url), "t"),
                                       Settings(redis_url=redis.url))
        first, second = _task(), _task()
        await store.submit(first, b"audio")
        await store.redis.script_flush()
        await store.submit(second, b"audio")
        found = [await store.get(first.id), await store.get(second.id)]
        await store.close()
        return found

    assert [t.state if t else None for t in asyncio.run(scenario())] == ["PENDING"] * 2
    assert redis.client().info("errorstats")["errorstat_NOSCRIPT"]["count"] >= 1  # heard


@pytest.fixture
def replica(tmp_path: Path, redis: procs.RedisServer) -> Iterator[procs.RedisServer]:
    """A replica of the test's redis-server, its link up (the test may kill it)."""
    replica = procs.RedisServer(tmp_path / "replica", replica_of=redis).start()
    try:
        procs.wait_until(
            lambda: replica.client().info("replication")["master_link_status"] == "up",
            20, "the replica's link")
        yield replica
    finally:
        replica.stop()


def test_a_submit_waits_for_a_replica(redis: procs.RedisServer,
                                      replica: procs.RedisServer) -> None:
    # generous: on a busy machine a replica may take a while to be scheduled and answer
    settings = Settings(redis_url=redis.url, redis_wait_replicas=1, redis_wait_timeout_ms=1500)

    async def scenario() -> tuple[Task | None, Task | None]:
        store = TaskStore.for_settings(worker_client(settings, "t"), settings)
        held = _task()
        await store.submit(held, b"audio")
        assert replica.client().exists(keys.task(held.id))  # there when the submit returns
        replica.kill()
        refused = _task()
        with pytest.raises(NotReplicated):
            await store.submit(refused, b"audio")
        found = await store.get(held.id), await store.get(refused.id)
        await store.close()
        return found

    held, withdrawn = asyncio.run(scenario())
    assert held is not None and held.state == TaskState.PENDING
    # answered 503 to its client, so withdrawn (no idempotency key would find it again)
    assert withdrawn is not None and withdrawn.state == TaskState.CANCELLED


def test_a_submit_short_of_replicas_keeps_the_input_of_a_task_that_lives(
        tmp_path: Path, redis: procs.RedisServer, replica: procs.RedisServer) -> None:
    """Refused to its client for want of a replica, a task with an idempotency key stays
    queued for the retry that will find it, its input (a file in SPEECH_BLOB_DIR here) with
    it. One without a key is withdrawn: a worker that reads it within the wait is not let
    start it (UNCONFIRMED), so the refusal always stands. Its input file stays until the
    sweeper's (the withdrawal is not confirmed either: a failover could bring it back)."""
    settings = Settings(redis_url=redis.url, redis_wait_replicas=1, redis_wait_timeout_ms=1500,
                        blob_dir=tmp_path / "blobs", blob_dir_min_kib=0)
    blob = b"audio" * 100

    async def scenario() -> tuple[Task | None, Task | None]:
        store = TaskStore.for_settings(worker_client(settings, "t"), settings)
        worker = TaskStore.for_settings(worker_client(settings, "w"), settings)
        replica.kill()
        kept = _task()
        with pytest.raises(NotReplicated):
            await store.submit(kept, blob, idempotency_key="retry-me")
        taken = _task()

        async def take_it() -> int:  # a worker's start, while the submit waits for WAIT
            while await worker.get(taken.id) is None:
                await asyncio.sleep(0.01)
            return await worker.start(taken.id, "w-1", 1, BACKEND)

        submitted, started = await asyncio.gather(store.submit(taken, blob), take_it(),
                                                  return_exceptions=True)
        assert isinstance(submitted, NotReplicated) and started == -3, (submitted, started)
        found = await store.get(kept.id), await store.get(taken.id)
        await store.close()
        await worker.close()
        return found

    kept, taken = asyncio.run(scenario())
    assert kept is not None and kept.state == TaskState.PENDING
    assert (tmp_path / "blobs" / f"{kept.id}.input").read_bytes() == blob
    assert taken is not None and taken.state == TaskState.CANCELLED and taken.attempt == 0
    assert (tmp_path / "blobs" / f"{taken.id}.input").read_bytes() == blob


def test_a_finish_sent_again_keeps_the_output_it_stored(tmp_path: Path,
                                                        redis: procs.RedisServer) -> None:
    """A finish whose reply was lost is sent again (redis-py's retry, the worker's own): it
    finds its own write, so it is stored, and the output file the record names stays."""
    settings = Settings(redis_url=redis.url, blob_dir=tmp_path / "blobs", blob_dir_min_kib=0)
    audio = b"RIFF" + bytes(4000)

    async def scenario() -> tuple[list[bool], bytes | None]:
        store = TaskStore.for_settings(worker_client(settings, "t"), settings)
        task = _task()
        await store.submit(task, b"input")
        attempt = await store.start(task.id, "w-1", 1, BACKEND)
        finished = [await store.finish(task, TaskState.SUCCEEDED, attempt=attempt,
                                       entry_id="", result={"text": ""}, output=audio)
                    for _ in range(2)]
        # a stale attempt (another one's) is still refused, and its file goes
        finished.append(await store.finish(task, TaskState.SUCCEEDED, attempt=attempt - 1,
                                           entry_id="", result={"text": ""}, output=audio))
        output = await store.blobs.output(task.id)
        await store.close()
        return finished, output

    finished, output = asyncio.run(scenario())
    assert finished == [True, True, False]
    assert output == audio


def test_an_entry_another_worker_claimed_is_neither_leased_nor_started_here(
        redis: procs.RedisServer) -> None:
    """A worker whose entry waited past the visibility timeout behind another task (and was
    claimed by a second worker) hears so: its lease says TAKEN, its start check says the
    entry is not its own; once acked, a lease says DONE."""
    settings = Settings(redis_url=redis.url, backend=BACKEND)

    async def scenario() -> list[object]:
        clients = [worker_client(settings, name) for name in ("a", "b")]
        first = WorkerStore(clients[0], settings, "worker-a")
        second = WorkerStore(clients[1], settings, "worker-b")
        await first.ensure_queue()
        store = TaskStore.for_settings(worker_client(settings, "g"), settings)
        await store.submit(_task(), b"audio")
        (taken,) = await first.read(block_ms=None)
        seen: list[object] = [await first.extend_lease(taken), await first.deliveries(taken)]
        (claimed,) = await second.claim_abandoned(0.0)
        assert claimed.entry_id == taken.entry_id
        seen += [await first.extend_lease(taken), await first.deliveries(taken),
                 await second.extend_lease(claimed), await second.deliveries(claimed)]
        await second.ack(claimed)
        seen += [await second.extend_lease(claimed)]
        await store.close()
        for client in clients:
            await client.aclose()
        return seen

    assert asyncio.run(scenario()) == [Lease.HELD, (1, True), Lease.TAKEN, (2, False),
                                       Lease.HELD, (2, True), Lease.DONE]


def test_a_started_task_leaves_the_deadlines_of_queued_tasks(redis: procs.RedisServer) -> None:
    """The set of queued tasks' deadlines does not keep a task once a worker starts it (a far
    deadline, max_wait_seconds=1e9, would otherwise hold it for years)."""
    settings = Settings(redis_url=redis.url)

    async def scenario() -> tuple[int, int]:
        store = TaskStore.for_settings(worker_client(settings, "t"), settings)
        task = _task()
        task.deadline = time.time() + 1e9
        await store.submit(task, b"audio")
        queued = await store.redis.zcard(keys.deadlines(BACKEND))
        assert await store.start(task.id, "w-1", 1, BACKEND) == 1
        started = await store.redis.zcard(keys.deadlines(BACKEND))
        await store.close()
        return queued, started

    assert asyncio.run(scenario()) == (1, 0)
