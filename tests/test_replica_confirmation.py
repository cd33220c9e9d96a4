"""Writes a client is told of wait for a replica (SPEECH_REDIS_WAIT_REPLICAS), also when a
worker is quick: on a lone Redis with one replica required, nothing is ever confirmed, which
is what a replica that has fallen behind looks like to the primary (a failover would lose
every such write).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import pytest
from redis.asyncio import Redis

from common import keys
from common.schemas import TaskState
from common.store import Task, TaskStore
from common.store.replicas import NotReplicated, ReplicaWait
from harness import procs
from tests.helpers import JFK, submit_file

UNCONFIRMED = ReplicaWait(replicas=1, timeout_ms=50)


def test_a_submit_no_replica_confirmed_is_refused_even_with_an_idle_worker(
        tmp_path: Path) -> None:
    """An idle worker reads a new entry within milliseconds, long before the submit's WAIT
    gives up: it must not start the task, so the submit can withdraw it and answer 503 (it
    answered 200 for a task only the primary held)."""
    redis = procs.RedisServer(tmp_path / "redis").start()
    settings = {"redis_wait_replicas": "1", "redis_wait_timeout_ms": "300"}
    worker = procs.worker(redis.url, tmp_path, **settings).start()
    gateway = procs.gateway(redis.url, tmp_path, **settings).start()
    try:
        replies = [submit_file(gateway.url, JFK) for _ in range(3)]
        # with a key the task stays queued for the retry to find; the retry is refused too
        # while no replica holds it (its 200 would promise what a failover loses)
        keyed = [submit_file(gateway.url, JFK, idempotency_key="k1") for _ in range(2)]
        time.sleep(1.0)  # what a worker would have started by now
        client = redis.client()
        records = [client.hgetall(key) for key in client.keys(keys.task("*"))]
    finally:
        gateway.stop()
        worker.stop()
        redis.stop()
    assert [reply.status_code for reply in replies] == [503] * 3, [r.text for r in replies]
    assert all(reply.headers.get("retry-after") for reply in replies)
    assert [reply.status_code for reply in keyed] == [503] * 2, [r.text for r in keyed]
    assert len(records) == 4
    withdrawn = [record for record in records if record[b"state"] == b"CANCELLED"]
    assert len(withdrawn) == 3 and all(r[b"attempt"] == b"0" for r in withdrawn), records
    (kept,) = [record for record in records if record[b"state"] != b"CANCELLED"]
    assert kept[b"state"] == b"PENDING" and b"unconfirmed" in kept, kept  # never started


def test_cancel_and_the_sweepers_fail_wait_for_a_replica(tmp_path: Path) -> None:
    """A cancel answered before a replica holds it could be lost with the primary, and the
    task run after its client was told CANCELLED: unconfirmed, it is the caller's 503. A
    cancel that changed nothing (a running task) has nothing to confirm; the sweeper's FAILED
    waits too, and stands unconfirmed (it tells no client itself)."""
    server = procs.RedisServer(tmp_path / "redis").start()

    async def scenario() -> None:
        client = Redis.from_url(server.url)
        plain, waiting = TaskStore(client, 600), TaskStore(client, 600, replicas=UNCONFIRMED)
        for task_id in ("c1", "f1", "r1"):
            await plain.submit(Task(id=task_id, backend="faster-whisper", model="tiny.en",
                                    state=TaskState.PENDING), b"\0" * 64)
        with pytest.raises(NotReplicated):
            await waiting.cancel("c1", "faster-whisper")
        await plain.start("r1", "w1", 1, "faster-whisper")
        assert await waiting.cancel("r1", "faster-whisper") == "RUNNING"  # nothing written
        queued = await plain.get("f1")
        assert queued is not None
        started = time.monotonic()
        assert await waiting.fail_if_unchanged(queued, "no worker", "no_worker")
        assert time.monotonic() - started >= 0.04  # it waited for the replica
        failed = await plain.get("f1")
        assert failed is not None and failed.state == TaskState.FAILED
        await client.aclose()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_a_terminal_write_can_be_written_again_until_a_replica_holds_it(
        tmp_path: Path) -> None:
    """A worker whose terminal write no replica confirmed writes it again (workers/consumer
    `_until_replicated`): the write is idempotent for its own attempt, and lands again where
    a switchover's new primary lost it."""
    server = procs.RedisServer(tmp_path / "redis").start()

    async def scenario() -> None:
        client = Redis.from_url(server.url)
        plain, waiting = TaskStore(client, 600), TaskStore(client, 600, replicas=UNCONFIRMED)
        task = Task(id="t1", backend="faster-whisper", model="tiny.en", state=TaskState.PENDING)
        await plain.submit(task, b"\0" * 64)
        attempt = await plain.start("t1", "w1", 1, "faster-whisper")
        before = await client.hgetall(keys.task("t1"))  # what a lagging replica holds

        async def finish(again: bool) -> bool:
            try:
                return await waiting.finish(task, TaskState.SUCCEEDED, attempt=attempt,
                                            entry_id="", result={"text": "hi"}, worker="w1",
                                            again=again)
            except NotReplicated as short:
                return bool(short.result)

        assert await finish(False)
        assert not await finish(False)  # a second finisher of one attempt is not this one
        assert await finish(True)  # written again: still this attempt's write
        await client.delete(keys.task("t1"))  # the switchover's new primary lost it
        await client.hset(keys.task("t1"), mapping=before)
        assert await finish(True)
        done = await plain.get("t1")
        assert done is not None and done.state == TaskState.SUCCEEDED
        # another worker with the same attempt number is still refused
        assert not await plain.finish(task, TaskState.SUCCEEDED, attempt=attempt,
                                      entry_id="", result={}, worker="w2")
        await client.aclose()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_a_webhook_is_sent_only_once_a_replica_holds_the_write_it_reports(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A deliverer's claim waits for a replica (which then also holds the terminal write that
    made the delivery due): unconfirmed, nothing is claimed (a failover could lose the write
    and the task run again to another outcome), and the delivery is due again a moment later.
    A claim that found nothing due waits for nothing (and warns of nothing)."""
    from common.store.webhooks import UNCONFIRMED_RETRY_SECONDS, WebhookStore

    caplog.set_level(logging.WARNING, logger="gateway.deliverer")
    server = procs.RedisServer(tmp_path / "redis").start()

    async def scenario() -> None:
        client = Redis.from_url(server.url)
        store = TaskStore(client, 600)
        assert await WebhookStore(client, UNCONFIRMED).claim(10, 60.0) == []
        assert "webhooks held" not in caplog.text, caplog.text
        task = Task(id="h1", backend="faster-whisper", model="tiny.en",
                    state=TaskState.PENDING, callback_url="http://127.0.0.1:9/hook")
        await store.submit(task, b"\0" * 64)
        attempt = await store.start("h1", "w1", 1, "faster-whisper")
        assert await store.finish(task, TaskState.SUCCEEDED, attempt=attempt, entry_id="",
                                  result={"text": "done"}, worker="w1")
        before = time.time()
        assert await WebhookStore(client, UNCONFIRMED).claim(10, 60.0) == []
        assert "webhooks held" in caplog.text  # this one was held
        due = await client.zscore(keys.webhooks_due(), "h1")
        assert due is not None and due / 1000 <= before + UNCONFIRMED_RETRY_SECONDS + 1.0
        await asyncio.sleep(UNCONFIRMED_RETRY_SECONDS + 0.1)
        claims = await WebhookStore(client).claim(10, 60.0)  # no replica asked for
        assert [claim.task_id for claim in claims] == ["h1"]
        await client.aclose()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()
