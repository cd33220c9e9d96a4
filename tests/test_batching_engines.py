"""Cross-request batching (issue 29) on the torch engines: a real parakeet (NeMo) and qwen3
(transformers) worker process on their tiny checkpoints gives each clip of a batch the
result it gives that clip alone (greedy decoding), and /metrics' histogram saw batches."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from redis.asyncio import Redis

from common import keys
from common.schemas import TaskState
from common.store import Task, TaskStore, new_task_id
from harness import procs
from harness.procs import wait_until
from tests.test_batching import clips
from tests.tiny import env_python, tiny_model

ENVIRONMENTS = {"parakeet": "nemo", "qwen3": "hf"}


#: qwen3 detects the language, as an OpenAI call that names none asks (its batches share one
#: language setting, "detect" included); parakeet is English
PARAMS = {"parakeet": {"beam_size": 1, "language": "en"}, "qwen3": {"beam_size": 1}}


async def submit(redis_url: str, backend: str, audio: bytes) -> str:
    client = Redis.from_url(redis_url)
    task = Task(id=new_task_id(), backend=backend, model="tiny", state=TaskState.PENDING,
                params=PARAMS[backend], audio_seconds=len(audio) / 32000)
    await TaskStore(client, 600).submit(task, audio)
    await client.aclose()
    return task.id


async def get(redis_url: str, task_ids: list[str]) -> list[Task]:
    client = Redis.from_url(redis_url)
    found = [await TaskStore(client, 600).get(task_id) for task_id in task_ids]
    await client.aclose()
    return [task for task in found if task is not None]


def finished(redis_url: str, task_ids: list[str]) -> list[Task] | None:
    found = asyncio.run(get(redis_url, task_ids))
    return found if len(found) == len(task_ids) and all(t.state.terminal for t in found) \
        else None


@pytest.mark.parametrize("backend", ["parakeet", "qwen3"])
def test_a_batch_gives_each_clip_its_result_alone(backend: str, redis: procs.RedisServer,
                                                  tmp_path: Path) -> None:
    python = env_python(ENVIRONMENTS[backend])
    if not python.exists():
        pytest.skip(f".venvs/{ENVIRONMENTS[backend]} is missing")
    model = tiny_model(backend)
    audios = clips()[:6]
    worker = procs.worker(redis.url, tmp_path, backend=backend, python=python,
                          models={backend: {"tiny": str(model)}}, preload="true",
                          idle_unload_seconds="-1", parakeet_warmup_seconds="[1.0]").start()
    try:
        alone = []
        for audio in audios:  # one by one: each is a lone task, never batched
            task_id = asyncio.run(submit(redis.url, backend, audio))
            alone += wait_until(lambda t=task_id: finished(redis.url, [t]), 120, "alone")
        sizes = redis.client().hgetall(keys.histogram(backend, "batch_size"))
        assert int(sizes[b"count"]) == int(sizes[b"sum"]) == len(audios)
        # all queued before the worker reads on (a paused worker): on a loaded machine the
        # submits could otherwise trail a tiny model's runs, and each would run alone
        assert worker.proc is not None
        os.kill(worker.proc.pid, signal.SIGSTOP)
        try:
            ids = asyncio.run(_submit_all(redis.url, backend, audios))
        finally:
            os.kill(worker.proc.pid, signal.SIGCONT)
        together = wait_until(lambda: finished(redis.url, ids), 300, "together")
    finally:
        worker.stop()
    assert all(t.state == TaskState.SUCCEEDED for t in alone + together), alone + together
    assert [t.result for t in together] == [t.result for t in alone]
    sizes = redis.client().hgetall(keys.histogram(backend, "batch_size"))
    assert int(sizes[b"count"]) < 2 * len(audios)  # some calls had several tasks


async def _submit_all(redis_url: str, backend: str, audios: list[bytes]) -> list[str]:
    return [await submit(redis_url, backend, audio) for audio in audios]
