"""A failover that loses a task's start hands its attempt number out twice.

Replication is asynchronous: a primary can die after a worker's start (attempt 1, worker A)
and before any replica has it. The promoted replica still has the task PENDING at attempt 0,
its stream entry is delivered again, and worker B's start opens attempt 1 once more while A
still runs. Every write a worker fences by its attempt (the terminal write, a spoken piece,
a segment's delivered mark, a charge's top-up) must then tell B's attempt from A's: only
the worker that started the attempt the record holds may write, and the two never share an
output file. On a real Redis, with the workers' own store; the lost start is what the
promoted replica holds (the record before A's start).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from redis.asyncio import Redis

from common import keys
from common.schemas import SpeechChunk, TaskState
from common.settings import Settings
from common.store.chunks import StaleAttempt
from common.store.record import Task
from common.store.tasks import TaskStore
from common.store.worker import WorkerStore
from harness import procs


def test_a_start_lost_in_a_failover_leaves_one_writer_per_attempt(tmp_path: Path) -> None:
    server = procs.RedisServer(tmp_path / "redis").start()
    settings = Settings(_env_file=None, backend="xtts", blob_dir=tmp_path / "blobs",  # type: ignore[call-arg]
                        blob_dir_min_kib=1)

    async def scenario() -> None:
        client = Redis.from_url(server.url)
        first, second = (WorkerStore(client, settings, name) for name in ("host:a", "host:b"))
        tasks = TaskStore.for_settings(client, settings)
        task = Task(id="t1", backend="xtts", model="tiny", state=TaskState.PENDING)
        await tasks.submit(task, None)
        day, month = "usage:test:day", "usage:test:month"
        await client.hset(day, mapping={"audio_seconds": 5.0})
        await client.hset(month, mapping={"audio_seconds": 5.0})
        charge = {"amount": 5.0, "unit": "audio_seconds", "backend": "xtts", "day": day,
                  "month": month, "total": "usage:test:total", "limits": {}}
        await client.hset(keys.task("t1"), "charge", json.dumps(charge))
        replica_had = await client.hgetall(keys.task("t1"))

        stale = await first.start("t1", 1)
        # the primary dies; the promoted replica never saw that start
        await client.delete(keys.task("t1"))
        await client.hset(keys.task("t1"), mapping=replica_had)
        current = await second.start("t1", 1)
        assert stale == current == 1  # the same number, two workers

        piece = SpeechChunk(0, b"\x01\x00" * 8, 24000)
        with pytest.raises(StaleAttempt):
            await first.append_chunk("t1", stale, piece)
        await second.append_chunk("t1", current, piece)

        await first.publish_segment("t1", stale, 9.0, {"type": "segment"})
        await second.publish_segment("t1", current, 2.0, {"type": "segment"})
        assert float(await client.hget(keys.task("t1"), "delivered")) == 2.0

        assert await first.top_up("t1", stale, 50.0) is None  # nothing charged: not its attempt
        assert json.loads(await client.hget(keys.task("t1"), "charge"))["amount"] == 5.0
        assert await second.top_up("t1", current, 7.0) is None
        assert json.loads(await client.hget(keys.task("t1"), "charge"))["amount"] == 7.0
        assert float(await client.hget(day, "audio_seconds")) == 7.0

        record = await first.get("t1")
        assert record is not None
        winner, loser = b"B" * 4096, b"A" * 4096
        assert await second.finish(record, TaskState.SUCCEEDED, attempt=current, entry_id="",
                                   result={"who": "b"}, output=winner)
        # A finishes later with the same attempt number: refused, and B's audio stays B's
        assert not await first.finish(record, TaskState.SUCCEEDED, attempt=stale, entry_id="",
                                      result={"who": "a"}, output=loser)
        done = await first.get("t1")
        assert done is not None and done.state == TaskState.SUCCEEDED
        assert done.result == {"who": "b"}
        output = await client.hget(keys.task("t1"), "output_file")
        assert output is not None
        assert (tmp_path / "blobs" / output.decode()).read_bytes() == winner
        assert sorted(p.name for p in (tmp_path / "blobs").iterdir()) == [output.decode()]
        await client.aclose()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()
