"""A real worker run inside the test process (issue 14): engine host, consumer and
WorkerStore composed as `python -m workers` composes them, on a real redis-server with the
real faster-whisper engine and the bundled tiny.en, but handed no signal handling, an exit
policy that records instead of exiting, and burst mode: it drains the queue and returns."""

from __future__ import annotations

import ast
import asyncio
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

import pytest
from redis.asyncio import Redis

from common import keys
from common.schemas import TaskState
from common.settings import Settings
from common.store import BreakerPolicy, Task, TaskStore, new_task_id
from harness import procs
from tests import inprocess
from tests.helpers import JFK, JFK_TEXT, pending_count, wer
from workers.engines.faster_whisper import FasterWhisperEngine, bundled_model_dir
from workers.runtime import Worker

BACKEND = "faster-whisper"
CONSUMER = "in-process"


def worker_settings(redis_url: str, models: dict[str, str]) -> Settings:
    return inprocess.worker_settings(redis_url, models={BACKEND: models}, consumer=CONSUMER,
                                     heartbeat_seconds=0.1)


async def submit(redis_url: str, model: str, by_path: bool = False) -> str:
    """Queue a task as the gateway does: its record, entry and input blob in one write."""
    client = Redis.from_url(redis_url)
    task = Task(id=new_task_id(), backend=BACKEND, model=model, state=TaskState.PENDING,
                input_path=str(JFK) if by_path else "", audio_seconds=11.0)
    await TaskStore(client, 600).submit(task, None if by_path else JFK.read_bytes())
    await client.aclose()
    return task.id


async def run_worker(settings: Settings) -> dict[str, Any]:
    """Run one Worker in burst mode until it returns: what it left, the exits it asked for,
    and every heartbeat seen while it ran."""
    exits: list[int] = []
    client, watcher = Redis.from_url(settings.redis_url), Redis.from_url(settings.redis_url)
    worker = Worker(settings, FasterWhisperEngine(settings), client, handle_signals=False,
                    exit=exits.append, burst=True)
    heartbeat = keys.heartbeat(BACKEND, CONSUMER)
    beats = []
    run = asyncio.create_task(worker.run())
    while not run.done():
        if raw := await watcher.get(heartbeat):
            beats.append(json.loads(raw))
        await asyncio.wait({run}, timeout=0.05)
    await run  # raises what the worker raised
    left = {"worker": worker, "exits": exits, "heartbeats": beats,
            "heartbeat_left": await watcher.exists(heartbeat)}
    await client.aclose()
    await watcher.aclose()
    return left


async def task_of(redis_url: str, task_id: str) -> Task:
    client = Redis.from_url(redis_url)
    task = await TaskStore(client, 600).get(task_id)
    await client.aclose()
    assert task is not None
    return task


def counters(redis: procs.RedisServer) -> dict[str, int]:
    raw = redis.client().hgetall(keys.counters(BACKEND))
    return {k.decode(): int(v) for k, v in raw.items()}


def test_a_worker_in_process_drains_the_queue_and_returns(redis: procs.RedisServer) -> None:
    settings = worker_settings(redis.url, {"tiny.en": "bundled"})

    async def scenario() -> tuple[list[str], dict[str, Any]]:
        task_ids = [await submit(redis.url, "tiny.en"),
                    await submit(redis.url, "tiny.en", by_path=True)]
        return task_ids, await run_worker(settings)

    task_ids, run = asyncio.run(scenario())
    assert run["exits"] == []
    for task_id in task_ids:
        task = asyncio.run(task_of(redis.url, task_id))
        assert task.state == TaskState.SUCCEEDED, task
        assert task.result is not None and wer(JFK_TEXT, task.result["text"]) <= 0.10, task.result
        assert task.attempt == 1 and task.worker == CONSUMER
    assert pending_count(redis.client()) == 0
    assert run["worker"].consumer.tasks_done == 2
    # the heartbeat was written while it ran, and taken away when it returned
    beats = run["heartbeats"]
    assert beats and {b["consumer"] for b in beats} == {CONSUMER}
    assert all(b["backend"] == BACKEND and b["pid"] == os.getpid() for b in beats)
    assert {"loading", "busy", "ready"} & {b["state"] for b in beats}, beats
    assert not run["heartbeat_left"]
    # metrics went through WorkerStore
    assert counters(redis) == {"worker_starts": 1, "tasks_SUCCEEDED": 2}
    client = redis.client()
    assert int(client.hget(keys.histogram(BACKEND, "inference_seconds"), "count")) == 2
    assert int(client.hget(keys.histogram(BACKEND, "model_load_seconds"), "count")) == 1


def test_a_corrupt_model_asks_for_an_exit_instead_of_exiting(
        redis: procs.RedisServer, tmp_path: Path) -> None:
    """A load that fails half-built ends a real worker's process; here the exit policy only
    records it, so the test process lives to check what the worker did before."""
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
        shutil.copy(bundled_model_dir() / name, corrupt / name)
    (corrupt / "model.bin").write_bytes(os.urandom(4096))
    settings = worker_settings(redis.url, {"tiny.en": "bundled", "corrupt": str(corrupt)})

    async def scenario() -> tuple[str, str, dict[str, Any]]:
        broken = await submit(redis.url, "corrupt")
        behind = await submit(redis.url, "tiny.en")
        return broken, behind, await run_worker(settings)

    broken, behind, run = asyncio.run(scenario())
    assert run["exits"] == [1]
    failed = asyncio.run(task_of(redis.url, broken))
    assert failed.state == TaskState.FAILED and "failed to load" in failed.error, failed
    assert failed.error_code == "model_load_failed" and failed.attempt == 1
    assert counters(redis) == {"worker_starts": 1, "load_failures": 1, "tasks_FAILED": 1}
    assert asyncio.run(breaker_failures(redis.url, str(corrupt))) == 1
    assert not run["heartbeat_left"]
    # a worker that asked to exit takes no further task: the next one (supervisord's
    # restart, here a second in-process worker under the same name) runs it
    assert asyncio.run(task_of(redis.url, behind)).state == TaskState.PENDING
    again = asyncio.run(run_worker(settings))
    assert again["exits"] == []
    done = asyncio.run(task_of(redis.url, behind))
    assert done.state == TaskState.SUCCEEDED and done.attempt == 1, done
    assert pending_count(redis.client()) == 0


def test_a_stop_during_the_wait_before_a_load_failures_exit_is_not_held_up(
        redis: procs.RedisServer, tmp_path: Path) -> None:
    """A worker whose load failed half-built waits out SPEECH_MIN_UPTIME_SECONDS before it
    exits (supervisord's startsecs); a stop asked meanwhile (SIGTERM) ends that wait, where
    it waited on to its SIGKILL."""
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
        shutil.copy(bundled_model_dir() / name, corrupt / name)
    (corrupt / "model.bin").write_bytes(os.urandom(4096))
    settings = inprocess.worker_settings(
        redis.url, models={BACKEND: {"tiny.en": "bundled", "corrupt": str(corrupt)}},
        consumer=CONSUMER, heartbeat_seconds=0.1, min_uptime_seconds=120)

    async def scenario() -> tuple[list[int], float]:
        broken = await submit(redis.url, "corrupt")
        exits: list[int] = []
        client = Redis.from_url(redis.url)
        worker = Worker(settings, FasterWhisperEngine(settings), client, handle_signals=False,
                        exit=exits.append, burst=True)
        run = asyncio.create_task(worker.run())
        async with asyncio.timeout(60):
            while (await task_of(redis.url, broken)).state != TaskState.FAILED:
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # into its wait
        assert not run.done() and exits == []
        asked = time.monotonic()
        worker.stop()
        await asyncio.wait_for(run, 30)
        took = time.monotonic() - asked
        await client.aclose()
        return exits, took

    exits, took = asyncio.run(scenario())
    assert exits == [1]
    assert took < 10, took  # not the 120 s of SPEECH_MIN_UPTIME_SECONDS


async def breaker_failures(redis_url: str, source: str) -> int:
    client = Redis.from_url(redis_url)
    breakers = await TaskStore(client, 600).breakers.read(BACKEND, {"corrupt": source},
                                                           BreakerPolicy())
    await client.aclose()
    return breakers["corrupt"].failures


def test_workers_reach_redis_only_through_the_store() -> None:
    """No worker module builds a key or touches a Redis client's commands: WorkerStore
    (common/store/worker.py) does."""
    for path in sorted((procs.ROOT / "workers").rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                names = {f"{node.module}.{alias.name}" for alias in node.names}
                assert "common.keys" not in {node.module, *names}, path
            elif isinstance(node, ast.Import):
                assert all(alias.name != "common.keys" for alias in node.names), path
            elif isinstance(node, ast.Attribute):
                assert node.attr not in ("redis", "_redis"), (path, node.lineno)


def test_the_processing_rate_counts_the_audio_decoded_not_what_the_file_claimed(
        redis: procs.RedisServer) -> None:
    """A container whose timestamps claim 600 s and whose packets hold jfk.flac's 11 s (its
    probe says 600, the charge and the backlog count that until it runs): the rate every
    predicted wait divides by folds in the 11 s decoded. With the 600 s it rose ~50 times
    (a few such files drove every estimate to 0 and no queue ever read as full)."""
    from tests.audio_fakes import decoded_seconds, lying_matroska

    lying = lying_matroska(JFK, 1, 600.0)
    assert decoded_seconds(lying) == pytest.approx(11.0, abs=0.5)

    async def scenario() -> str:
        client = Redis.from_url(redis.url)
        task = Task(id=new_task_id(), backend=BACKEND, model="tiny.en", state=TaskState.PENDING,
                    audio_seconds=600.0, work=600.0)
        await TaskStore(client, 600).submit(task, lying)
        await client.aclose()
        return task.id

    task_id = asyncio.run(scenario())
    left = asyncio.run(run_worker(worker_settings(redis.url, {"tiny.en": "bundled"})))
    assert left["exits"] == []
    done = asyncio.run(task_of(redis.url, task_id))
    assert done.state == TaskState.SUCCEEDED, done
    assert wer(JFK_TEXT, done.result["text"]) <= 0.2  # type: ignore[index]
    rate = float(redis.client().hget(keys.rate(BACKEND), "rate:tiny.en"))
    # tiny.en on these cores: ~5-20 audio-seconds a second; 600 s over its ~1 s is 400+
    assert rate < 60, rate


def test_a_full_redis_at_the_terminal_write_is_waited_out_not_taken_for_a_crash(
        redis: procs.RedisServer) -> None:
    """Redis full (noeviction) while the result is written: the worker keeps the result and
    writes it once there is room, as it does through an outage. Dropped, it would have run
    again as if the worker had died (three blips: FAILED `delivery_limit`)."""
    settings = worker_settings(redis.url, {"tiny.en": "bundled"})

    async def scenario() -> tuple[str, list[int]]:
        task_id = await submit(redis.url, "tiny.en")
        client = Redis.from_url(redis.url)
        exits: list[int] = []
        worker = Worker(settings, FasterWhisperEngine(settings), Redis.from_url(redis.url),
                        handle_signals=False, exit=exits.append, burst=True)
        run = asyncio.create_task(worker.run())
        try:
            async with asyncio.timeout(120):
                while not worker.host.busy:  # its engine call runs
                    await asyncio.sleep(0.005)
                await client.config_set("maxmemory", 1)
                while worker.host.busy:  # done: its terminal write meets a full Redis
                    await asyncio.sleep(0.005)
                await asyncio.sleep(2.0)  # past what three refusals take (0.6 s)
                assert await client.hget(keys.task(task_id), "state") == b"RUNNING"
        finally:
            await client.config_set("maxmemory", 0)
        await asyncio.wait_for(run, 60)
        await client.aclose()
        return task_id, exits

    task_id, exits = asyncio.run(scenario())
    assert exits == []
    task = asyncio.run(task_of(redis.url, task_id))
    assert task.state == TaskState.SUCCEEDED and task.attempt == 1, task
    assert wer(JFK_TEXT, task.result["text"]) < 0.2
    assert "store_refusals" not in counters(redis)
