"""Cross-request batching (issue 29), on real workers with the real tiny.en: tasks that share
one engine call give the text they give alone, each keeps its own life (a bad clip fails
alone, a cancelled task never runs, a killed batch is redelivered task by task), a lone
task is not held by the window, and /metrics and /ready show it."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
from redis.asyncio import Redis

from common import keys
from common.audio import decode_audio, encode_wav
from common.schemas import TaskState
from common.settings import Settings
from common.store import Task, TaskStore, new_task_id
from common.store.worker import WorkerStore
from harness import procs
from harness.http_client import http
from harness.procs import TEST_AUDIO, wait_until
from tests.helpers import JFK_TEXT, pending_count, wer
from tests.inprocess import worker_settings
from workers import batching
from workers.engines.faster_whisper import FasterWhisperEngine
from workers.runtime import Worker

BACKEND = "faster-whisper"
GREEDY = {"beam_size": 1, "language": "en"}


@cache
def clips() -> list[bytes]:
    """12 different clips: the test files, each from three starting points, at most 12 s
    (jfk.flac's 11.0, 9.7, 8.3 s; hotwords' 4.0, 2.7, 1.3; multilingual's three 12.0;
    stereo_16k's 5.0, 3.7, 2.3)."""
    found = []
    for name in ("jfk.flac", "hotwords.mp3", "multilingual.mp3", "stereo_16k.wav"):
        audio = decode_audio((TEST_AUDIO / name).read_bytes(), 16000, None)
        for offset in (0.0, 1.3, 2.7):
            found.append(encode_wav(audio[int(offset * 16000):][:12 * 16000], 16000))
    return found


def settings_for(redis_url: str, **overrides: Any) -> Settings:
    return worker_settings(redis_url, heartbeat_seconds=0.2, cpu_threads=2, **overrides)


async def submit(redis_url: str, audio: bytes, owner: str = "", lane_share: int = 0,
                 **params: Any) -> str:
    client = Redis.from_url(redis_url)
    task = Task(id=new_task_id(), backend=BACKEND, model="tiny.en", state=TaskState.PENDING,
                params={**GREEDY, **params}, audio_seconds=len(audio) / 32000, owner=owner)
    await TaskStore(client, 600).submit(task, audio, lane_share=lane_share)
    await client.aclose()
    return task.id


async def tasks(redis_url: str, task_ids: list[str]) -> list[Task]:
    client = Redis.from_url(redis_url)
    store = TaskStore(client, 600)
    found = [await store.get(task_id) for task_id in task_ids]
    await client.aclose()
    assert all(task is not None for task in found)
    return [task for task in found if task is not None]


def burst_worker(settings: Settings, client: Redis) -> Worker:
    """An in-process worker that stops once the queue is empty."""
    return Worker(settings, FasterWhisperEngine(settings), client, handle_signals=False,
                  exit=lambda code: None, burst=True)


async def drain(settings: Settings) -> Worker:
    """One in-process worker in burst mode, until the queue is empty."""
    client = Redis.from_url(settings.redis_url)
    worker = burst_worker(settings, client)
    await worker.run()
    await client.aclose()
    return worker


def histogram(redis: procs.RedisServer, name: str) -> dict[str, float]:
    raw = redis.client().hgetall(keys.histogram(BACKEND, name))
    return {k.decode(): float(v) for k, v in raw.items()}


def test_twelve_clips_in_batches_give_the_text_they_give_alone(
        redis: procs.RedisServer, tmp_path: Path) -> None:
    async def run(window_ms: float) -> list[Task]:
        ids = [await submit(redis.url, clip) for clip in clips()]
        await drain(settings_for(redis.url, batch_window_ms=window_ms))
        return await tasks(redis.url, ids)

    alone = asyncio.run(run(0))  # batching off: one by one
    assert histogram(redis, "batch_size") == {}
    together = asyncio.run(run(50))
    assert all(t.state == TaskState.SUCCEEDED for t in alone + together)
    same = sum(a.result == b.result for a, b in zip(alone, together, strict=True))
    assert same >= 11, [(a.result, b.result) for a, b in zip(alone, together, strict=True)]
    assert wer(JFK_TEXT, together[0].result["text"]) <= 0.10  # type: ignore[index]
    assert all(t.attempt == 1 for t in together)
    sizes = histogram(redis, "batch_size")
    assert sizes["count"] < 12 and sizes["sum"] == 12, sizes  # calls of several tasks
    assert sizes.get("1.0", 0) < sizes["count"]
    # /metrics shows it per backend
    gateway = procs.gateway(redis.url, tmp_path).start()
    try:
        text = http.get(f"{gateway.url}/metrics", timeout=10).text
    finally:
        gateway.stop()
    assert f'speech_batch_size_count{{backend="{BACKEND}"}} {sizes["count"]}' in text
    # every call within SPEECH_BATCH_MAX_SIZE (8)
    assert f'speech_batch_size_bucket{{backend="{BACKEND}",le="8"}} {sizes["count"]}' in text
    assert f'speech_batch_window_wait_seconds_count{{backend="{BACKEND}"}}' in text


def test_a_keys_line_comes_in_while_the_window_gathers(redis: procs.RedisServer) -> None:
    """A key with a share of one entry waiting (SPEECH_QUEUED_PER_KEY=1) and four tasks:
    each entry the window reads lets the key's next one in from its line at once
    (common/store/shares.py), so the four still share one call (they would go one by one if
    the line came in only as each started)."""
    async def scenario() -> list[Task]:
        ids = [await submit(redis.url, clips()[i], owner="key-one", lane_share=1)
               for i in (0, 1, 2, 6)]
        client = redis.client()
        assert client.xlen(keys.queue(BACKEND)) == 1  # three wait in line
        await drain(settings_for(redis.url, batch_window_ms=500))
        return await tasks(redis.url, ids)

    done = asyncio.run(scenario())
    assert all(t.state == TaskState.SUCCEEDED for t in done), done
    assert histogram(redis, "batch_size") == {**histogram(redis, "batch_size"), "count": 1.0,
                                              "sum": 4.0}


def test_a_task_whose_attempt_ended_before_runs_alone(redis: procs.RedisServer) -> None:
    """A task started before (its worker died running it: maybe its input's doing) shares no
    call: a poison input in a batch took the other keys' tasks down with it on every
    delivery, until the delivery limit failed them all."""
    async def scenario() -> list[Task]:
        ids = [await submit(redis.url, clips()[i]) for i in (0, 1, 2, 6)]
        redis.client().hset(keys.task(ids[1]), "attempt", 1)  # as a crashed attempt leaves it
        # a graceful stop's attempt is spared: no reason to run alone
        redis.client().hset(keys.task(ids[2]), mapping={"attempt": 1, "spared": 1})
        await drain(settings_for(redis.url, batch_window_ms=500))
        return await tasks(redis.url, ids)

    done = asyncio.run(scenario())
    assert all(t.state == TaskState.SUCCEEDED for t in done), done
    sizes = histogram(redis, "batch_size")
    assert sizes == {**sizes, "count": 2.0, "sum": 4.0, "1.0": 1.0}, sizes  # 3 together, 1


def test_a_clip_that_fails_to_decode_fails_alone(redis: procs.RedisServer) -> None:
    async def scenario() -> list[Task]:
        garbage = b"not audio" * (len(clips()[0]) // 9)  # as long: of the clips' length class
        ids = [await submit(redis.url, clips()[0]), await submit(redis.url, garbage),
               await submit(redis.url, clips()[1]), await submit(redis.url, clips()[6])]
        await drain(settings_for(redis.url))
        return await tasks(redis.url, ids)

    good, bad, *rest = asyncio.run(scenario())
    assert bad.state == TaskState.FAILED and bad.error_code == "invalid_audio", bad
    assert all(t.state == TaskState.SUCCEEDED for t in (good, *rest))
    assert wer(JFK_TEXT, good.result["text"]) <= 0.10  # type: ignore[index]
    sizes = histogram(redis, "batch_size")
    assert sizes == {**sizes, "count": 1.0, "sum": 4.0}  # the bad clip was in the batch
    assert pending_count(redis.client()) == 0


def test_a_batch_that_would_not_fit_the_memory_cap_is_split(redis: procs.RedisServer) -> None:
    """Each clip of a call needs SPEECH_BATCH_ITEM_MIB; the cap leaves room for two."""
    import psutil

    rss_mib = psutil.Process().memory_info().rss / 2**20
    settings = settings_for(redis.url, batch_item_mib=1000,
                            memory_cap_mib=int(rss_mib + 2500))

    async def scenario() -> tuple[Worker, list[Task], list[list[TaskState]]]:
        # four clips of one length class (8-16 s): they may share a call
        ids = [await submit(redis.url, clips()[i]) for i in (0, 1, 2, 6)]
        client = Redis.from_url(settings.redis_url)
        worker = burst_worker(settings, client)
        running = asyncio.create_task(worker.run())
        seen: list[list[TaskState]] = []
        while not running.done():  # the states while the calls run
            seen.append([t.state for t in await tasks(redis.url, ids)])
            await asyncio.wait({running}, timeout=0.01)
        await client.aclose()
        return worker, await tasks(redis.url, ids), seen

    worker, done, seen = asyncio.run(scenario())
    assert all(t.state == TaskState.SUCCEEDED for t in done), done
    assert worker.host.last_batch_calls == [2, 2]
    # the first call's tasks are finished while the second call still runs
    # (the second call's tasks may still be PENDING just after: they open as their call begins)
    first_done = [states for states in seen if states[:2] == [TaskState.SUCCEEDED] * 2]
    assert any(states[2:] == [TaskState.RUNNING] * 2 for states in first_done), first_done
    assert histogram(redis, "batch_size")["sum"] == 4.0


def test_interactive_work_goes_between_a_split_batchs_calls(redis: procs.RedisServer) -> None:
    """Calls of two under the cap: an interactive task that arrives while the first call
    runs starts before the second call's tasks, as it would had they been read one by one
    (docs/fairness.md); it waited for the whole batch."""
    import psutil

    rss_mib = psutil.Process().memory_info().rss / 2**20
    settings = settings_for(redis.url, batch_item_mib=1000,
                            memory_cap_mib=int(rss_mib + 2500))

    async def scenario() -> tuple[Worker, list[Task], Task]:
        ids = [await submit(redis.url, clips()[i]) for i in (0, 1, 2, 6)]
        client = Redis.from_url(settings.redis_url)
        worker = burst_worker(settings, client)
        running = asyncio.create_task(worker.run())
        urgent: Task | None = None
        while not running.done():
            states = [t.state for t in await tasks(redis.url, ids)]
            if urgent is None and states[:2] == [TaskState.RUNNING] * 2:
                urgent = Task(id=new_task_id(), backend=BACKEND, model="tiny.en",
                              state=TaskState.PENDING, params=GREEDY, audio_seconds=4.0,
                              lane=keys.INTERACTIVE)
                await TaskStore(client, 600).submit(urgent, clips()[3])
            await asyncio.wait({running}, timeout=0.01)
        await client.aclose()
        assert urgent is not None, "the first call was never seen running"
        return worker, await tasks(redis.url, ids), (await tasks(redis.url, [urgent.id]))[0]

    worker, done, urgent = asyncio.run(scenario())
    assert all(t.state == TaskState.SUCCEEDED for t in (*done, urgent)), (done, urgent)
    assert worker.host.last_batch_calls == [2, 2]
    assert urgent.started_at is not None and all(
        t.started_at is not None and urgent.started_at < t.started_at for t in done[2:]), (
        urgent.started_at, [t.started_at for t in done])


def test_a_split_batchs_later_call_keeps_its_tasks_queued_and_cancellable(
        redis: procs.RedisServer) -> None:
    """Calls of two under the cap: the second call's tasks are not started while the first
    runs (PENDING, no attempt), so a cancel then stops one, and the call takes the rest."""
    import psutil

    rss_mib = psutil.Process().memory_info().rss / 2**20
    settings = settings_for(redis.url, batch_item_mib=1000,
                            memory_cap_mib=int(rss_mib + 2500))

    async def scenario() -> tuple[Worker, list[Task], float, TaskState | None]:
        ids = [await submit(redis.url, clips()[i]) for i in (0, 1, 2, 6)]
        client = Redis.from_url(settings.redis_url)
        worker = burst_worker(settings, client)
        running = asyncio.create_task(worker.run())
        cancelled_at, cancelled = 0.0, None
        while not running.done():
            states = [t.state for t in await tasks(redis.url, ids)]
            if not cancelled_at and states[:2] == [TaskState.RUNNING] * 2:
                cancelled_at = time.time()  # the first call is starting
                cancelled = await TaskStore(client, 600).cancel(ids[3], BACKEND)
            await asyncio.wait({running}, timeout=0.01)
        await client.aclose()
        return worker, await tasks(redis.url, ids), cancelled_at, cancelled

    worker, done, cancelled_at, cancelled = asyncio.run(scenario())
    assert cancelled == TaskState.CANCELLED
    assert [t.state for t in done] == [TaskState.SUCCEEDED] * 3 + [TaskState.CANCELLED], done
    assert done[3].attempt == 0 and done[3].started_at is None and done[3].result is None
    assert worker.host.last_batch_calls == [2, 1]
    assert done[2].started_at is not None and done[2].started_at > cancelled_at
    assert histogram(redis, "batch_size") == {**histogram(redis, "batch_size"),
                                              "count": 2.0, "sum": 3.0}
    assert pending_count(redis.client()) == 0


def test_tasks_that_share_no_call_are_not_gathered_from_the_other_workers(
        redis: procs.RedisServer) -> None:
    """Diarized tasks run alone: a worker that reads one leaves the rest in the queue, so a
    second worker started while the first runs takes some (the sweep took them all)."""
    names = ("first", "second")

    async def scenario() -> list[Task]:
        ids = [await submit(redis.url, clips()[i], diarization={}) for i in (3, 4, 5, 9)]
        clients = [Redis.from_url(redis.url) for _ in names]
        workers = [burst_worker(settings_for(redis.url, consumer=name), client)
                   for name, client in zip(names, clients, strict=True)]
        first = asyncio.create_task(workers[0].run())
        while (await tasks(redis.url, ids[:1]))[0].state == TaskState.PENDING:
            await asyncio.sleep(0.01)
        await asyncio.gather(first, workers[1].run())
        for client in clients:
            await client.aclose()
        return await tasks(redis.url, ids)

    done = asyncio.run(scenario())
    assert all(t.state == TaskState.SUCCEEDED and t.result.get("speakers") is not None
               for t in done), done
    assert {t.worker for t in done} == set(names), [t.worker for t in done]
    assert pending_count(redis.client()) == 0


def test_a_first_batch_under_a_cap_probes_what_a_clip_costs(
        redis: procs.RedisServer) -> None:
    """Nothing measured yet (SPEECH_BATCH_ITEM_MIB 0, a fresh worker) and a memory cap: the
    first call takes two clips, not the whole batch (eight took 915 MiB under a 330 MiB cap)."""
    import psutil

    settings = settings_for(redis.url, memory_cap_mib=int(psutil.Process().memory_info().rss
                                                          / 2**20 + 2500))

    async def scenario() -> tuple[Worker, list[Task]]:
        ids = [await submit(redis.url, clips()[i]) for i in (0, 1, 2, 6, 7, 8)]
        worker = await drain(settings)
        return worker, await tasks(redis.url, ids)

    worker, done = asyncio.run(scenario())
    assert all(t.state == TaskState.SUCCEEDED for t in done), done
    assert worker.host.last_batch_calls[0] == 2, worker.host.last_batch_calls
    assert histogram(redis, "batch_size")["sum"] == 6.0


def test_a_batch_whose_load_breaks_fails_every_task_once(redis: procs.RedisServer,
                                                         tmp_path: Path) -> None:
    """A half-built load ends the process: each task of the batch that asked for it is
    stored FAILED before the exit, so none is redelivered to crash the next worker."""
    from tests.test_breakers import corrupt_model

    settings = settings_for(redis.url).model_copy(
        update={"models": {BACKEND: {"tiny.en": str(corrupt_model(tmp_path / "corrupt"))}}})
    exits: list[int] = []

    async def scenario() -> list[Task]:
        ids = [await submit(redis.url, clip) for clip in clips()[:3]]
        client = Redis.from_url(redis.url)
        await Worker(settings, FasterWhisperEngine(settings), client, handle_signals=False,
                     exit=exits.append, burst=True).run()
        await client.aclose()
        return await tasks(redis.url, ids)

    done = asyncio.run(scenario())
    assert exits == [1]
    assert all(t.state == TaskState.FAILED and t.error_code == "model_load_failed"
               and t.attempt == 1 for t in done), done
    counters = redis.client().hgetall(keys.counters(BACKEND))
    assert int(counters[b"load_failures"]) == 1  # one call, one load, one exit


def test_a_task_cancelled_while_its_batch_forms_never_runs(redis: procs.RedisServer) -> None:
    async def scenario() -> list[Task]:
        client = Redis.from_url(redis.url)
        ids = [await submit(redis.url, clip) for clip in clips()[:3]]
        assert await TaskStore(client, 600).cancel(ids[1], BACKEND) == TaskState.CANCELLED
        await client.aclose()
        await drain(settings_for(redis.url))
        return await tasks(redis.url, ids)

    first, cancelled, last = asyncio.run(scenario())
    assert cancelled.state == TaskState.CANCELLED
    assert cancelled.attempt == 0 and cancelled.started_at is None and cancelled.result is None
    assert first.state == last.state == TaskState.SUCCEEDED
    assert histogram(redis, "batch_size")["sum"] == 2.0  # read with them, not run
    assert pending_count(redis.client()) == 0


def test_interactive_work_goes_before_gathered_batch_tasks_that_run_one_by_one(
        redis: procs.RedisServer) -> None:
    """Six batch-lane tasks that cannot share a call (each its own beam size) are gathered
    at once; an interactive task submitted while the first runs starts next, not after the
    other five (docs/fairness.md: the next interactive task is taken next)."""
    async def scenario() -> tuple[list[Task], Task]:
        client = Redis.from_url(redis.url)
        batch = []
        for beam in range(1, 7):
            task = Task(id=new_task_id(), backend=BACKEND, model="tiny.en",
                        state=TaskState.PENDING, params={**GREEDY, "beam_size": beam},
                        lane=keys.BATCH, audio_seconds=12.0)
            await TaskStore(client, 600).submit(task, clips()[0])
            batch.append(task.id)
        settings = settings_for(redis.url)
        worker = burst_worker(settings, client)
        running = asyncio.create_task(worker.run())
        while (await tasks(redis.url, batch[:1]))[0].state == TaskState.PENDING:
            await asyncio.wait({running}, timeout=0.02)
            assert not running.done()
        urgent = Task(id=new_task_id(), backend=BACKEND, model="tiny.en",
                      state=TaskState.PENDING, params=GREEDY, lane=keys.INTERACTIVE,
                      audio_seconds=12.0)
        await TaskStore(client, 600).submit(urgent, clips()[1])
        await running
        await client.aclose()
        return await tasks(redis.url, batch), (await tasks(redis.url, [urgent.id]))[0]

    batch, urgent = asyncio.run(scenario())
    assert all(task.state == TaskState.SUCCEEDED for task in [*batch, urgent])
    assert histogram(redis, "batch_size")["count"] >= 1  # they were gathered together
    assert urgent.started_at is not None
    ahead = [task for task in batch if task.started_at is not None
             and urgent.created_at < task.started_at < urgent.started_at]
    assert ahead == [], [(t.params["beam_size"], t.started_at) for t in ahead]


def test_interactive_work_gathered_into_a_forming_batch_runs_before_the_batch_lane(
        redis: procs.RedisServer) -> None:
    """Four batch-lane tasks are swept and the worker waits out its window for company; an
    interactive task that arrives in that wait, with options of its own, starts before any
    of them (not after their shared call)."""
    async def scenario() -> tuple[list[Task], Task]:
        client = Redis.from_url(redis.url)
        batch = []
        for clip in clips()[:4]:
            task = Task(id=new_task_id(), backend=BACKEND, model="tiny.en",
                        state=TaskState.PENDING, params=GREEDY, lane=keys.BATCH,
                        audio_seconds=12.0)
            await TaskStore(client, 600).submit(task, clip)
            batch.append(task.id)
        settings = settings_for(redis.url, batch_window_ms=3000)
        worker = burst_worker(settings, client)
        running = asyncio.create_task(worker.run())
        await asyncio.wait({running}, timeout=1.0)  # swept, waiting for company
        assert not running.done()
        assert all(t.state == TaskState.PENDING for t in await tasks(redis.url, batch))
        urgent = Task(id=new_task_id(), backend=BACKEND, model="tiny.en",
                      state=TaskState.PENDING, params={**GREEDY, "beam_size": 2},
                      lane=keys.INTERACTIVE, audio_seconds=12.0)
        await TaskStore(client, 600).submit(urgent, clips()[5])
        await running
        await client.aclose()
        return await tasks(redis.url, batch), (await tasks(redis.url, [urgent.id]))[0]

    batch, urgent = asyncio.run(scenario())
    assert all(task.state == TaskState.SUCCEEDED for task in [*batch, urgent])
    assert urgent.started_at is not None and urgent.finished_at is not None
    assert all(task.started_at is not None and task.started_at > urgent.finished_at
               for task in batch), [(t.started_at, urgent.finished_at) for t in batch]


def test_a_short_clip_never_shares_a_call_with_a_long_one(redis: procs.RedisServer) -> None:
    """A call returns when its longest clip is done: a 6 s clip and a 48 s one with equal
    options run in calls of their own, while two 6 s clips share one."""
    long_clip = encode_wav(np.concatenate(
        [decode_audio(clip, 16000, None) for clip in clips()[:4]]), 16000)
    short_clip = encode_wav(decode_audio(clips()[0], 16000, None)[:6 * 16000], 16000)

    async def scenario() -> list[Task]:
        ids = [await submit(redis.url, long_clip), await submit(redis.url, short_clip),
               await submit(redis.url, short_clip)]
        await drain(settings_for(redis.url, batch_window_ms=200))
        return await tasks(redis.url, ids)

    done = asyncio.run(scenario())
    assert all(task.state == TaskState.SUCCEEDED for task in done)
    sizes = histogram(redis, "batch_size")
    assert sizes["count"] == 2 and sizes["sum"] == 3, sizes  # the long alone, the shorts together


def four_clips() -> bytes:
    """~48 s of speech (the first four clips end to end)."""
    return encode_wav(np.concatenate(
        [decode_audio(clip, 16000, None) for clip in clips()[:4]]), 16000)


def test_a_clip_longer_than_its_file_told_runs_after_its_company(
        redis: procs.RedisServer) -> None:
    """A file can tell the submit's probe a fraction of its length (tests/audio_fakes.py
    builds such files): it is grouped with short clips, and decodes to ~48 s of speech. It
    leaves their call once decoded and runs alone after it, so their results never wait
    for its length (it was submitted first: with one call for all, its result came first)."""
    short_clip = encode_wav(decode_audio(clips()[3], 16000, None)[:int(1.5 * 16000)], 16000)

    async def scenario() -> list[Task]:
        client = Redis.from_url(redis.url)
        liar = Task(id=new_task_id(), backend=BACKEND, model="tiny.en",
                    state=TaskState.PENDING, params=GREEDY, audio_seconds=1.5)
        await TaskStore(client, 600).submit(liar, four_clips())
        await client.aclose()
        ids = [liar.id, await submit(redis.url, short_clip), await submit(redis.url, short_clip)]
        await drain(settings_for(redis.url, batch_window_ms=200))
        return await tasks(redis.url, ids)

    liar, *shorts = asyncio.run(scenario())
    assert all(task.state == TaskState.SUCCEEDED for task in (liar, *shorts))
    assert all(task.finished_at < liar.finished_at for task in shorts), (  # type: ignore
        [task.finished_at for task in (liar, *shorts)])
    assert wer(JFK_TEXT, liar.result["text"][:len(JFK_TEXT)]) <= 0.2  # type: ignore[index]
    sizes = histogram(redis, "batch_size")
    assert sizes["count"] == 1 and sizes["sum"] == 3, sizes  # gathered as one batch


def test_only_a_clip_past_its_groups_probed_class_leaves_the_call() -> None:
    """The probed class is the floor: a clip that decodes shorter than its file told (an
    overstated header) keeps its company; one two classes past it leaves."""
    rate = 16000
    audios = {index: np.zeros(int(seconds * rate), np.float32)
              for index, seconds in enumerate((40.0, 45.0, 3.0, 50.0, 400.0))}
    assert batching._alike(audios, rate, batching.length_class(50.0)) == [0, 1, 2, 3]


def test_an_engine_calls_bound_follows_the_length_its_audio_decodes_to(
        redis: procs.RedisServer, monkeypatch: Any) -> None:
    """SPEECH_MAX_ENGINE_CALL_SECONDS=0 bounds a call by its audio's length: by what the
    audio decodes to, not what its file told the probe, so a file that understates its
    length is neither cut short (a stuck call, a worker restart, no charge) nor given less
    time than an honest one. The bound's parts are made small here, so that the length the
    file claims would give the call less than it takes."""
    from workers import engine_host

    monkeypatch.setattr(engine_host, "CALL_FLOOR_SECONDS", 0.2)
    monkeypatch.setattr(engine_host, "CALL_SECONDS_PER_WORK_SECOND", 0.5)
    bound = engine_host.CallBound(settings_for(redis.url), 0.95)
    bound.decoded(190.0)
    assert bound.seconds == 0.2 + 0.5 * 190.0
    fixed = engine_host.CallBound(settings_for(redis.url, max_engine_call_seconds=5.0), 5.0)
    fixed.decoded(1000.0)
    assert fixed.seconds == 5.0  # an operator's own bound stays as set
    long_clip = encode_wav(np.tile(decode_audio(four_clips(), 16000, None), 4), 16000)

    async def scenario() -> tuple[Task, Worker]:
        client = Redis.from_url(redis.url)
        liar = Task(id=new_task_id(), backend=BACKEND, model="tiny.en",
                    state=TaskState.PENDING, params=GREEDY, audio_seconds=1.5)
        await TaskStore(client, 600).submit(liar, long_clip)  # ~190 s, bound 0.95 s as told
        await client.aclose()
        worker = await drain(settings_for(redis.url, batch_max_size=1))
        return (await tasks(redis.url, [liar.id]))[0], worker

    task, worker = asyncio.run(scenario())
    assert task.state == TaskState.SUCCEEDED, (task.error, task.error_code)
    assert not worker.host.stalled


def test_the_window_holds_no_lone_task_and_a_burst_only_that_long(
        redis: procs.RedisServer) -> None:
    """With a 2 s window: a lone task (no company yet) starts at once; after a batch, a task
    arriving alone waits for company, but no longer than the window."""
    window = 2.0
    settings = settings_for(redis.url, batch_window_ms=window * 1000)

    async def scenario() -> list[Task]:
        client = Redis.from_url(redis.url)
        worker = Worker(settings, FasterWhisperEngine(settings), client, handle_signals=False,
                        exit=lambda code: None)
        running = asyncio.create_task(worker.run())
        ids = []

        async def settle(task_id: str) -> None:
            while (await tasks(redis.url, [task_id]))[0].state != TaskState.SUCCEEDED:
                await asyncio.wait({running}, timeout=0.05)
                assert not running.done()

        ids.append(await submit(redis.url, clips()[0]))  # alone
        await settle(ids[-1])
        burst = [await submit(redis.url, clip) for clip in clips()[3:7]]
        for task_id in burst:
            await settle(task_id)
        ids.append(await submit(redis.url, clips()[9]))  # alone, after a batch
        await settle(ids[-1])
        worker.stop()
        await running
        await client.aclose()
        return await tasks(redis.url, ids)

    lone, after_batch = asyncio.run(scenario())
    assert lone.started_at is not None and after_batch.started_at is not None
    assert lone.started_at - lone.created_at < window  # not held at all
    assert after_batch.started_at - after_batch.created_at < window + 1.5
    waits = histogram(redis, "batch_window_wait_seconds")
    assert waits["count"] >= 3 and waits["sum"] <= waits["count"] * window


def test_a_worker_killed_mid_batch_loses_nothing(redis: procs.RedisServer,
                                                 tmp_path: Path) -> None:
    """SIGKILL while a batch runs: its restart (same consumer) redelivers the tasks one by
    one, and each ends SUCCEEDED exactly once."""
    gateway = procs.gateway(redis.url, tmp_path).start()
    settings = {"preload": "true", "idle_unload_seconds": "-1", "consumer": "batcher",
                "cpu_threads": "2"}
    worker = procs.worker(redis.url, tmp_path, **settings).start()
    try:
        ready = http.get(f"{gateway.url}/ready", timeout=10).json()
        live = ready["backends"][BACKEND]["live"]
        assert live and live[0]["batch"] == {"enabled": True, "max_size": 8, "window_ms": 50.0}
        long_clip = (TEST_AUDIO / "multilingual.mp3").read_bytes()  # ~60 s: seconds of work
        ids = asyncio.run(_submit_all(redis.url, [long_clip] * 4))
        wait_until(lambda: sum(t.state == TaskState.RUNNING
                               for t in asyncio.run(tasks(redis.url, ids))) >= 2,
                   60, "a batch running", 0.05)
        os.kill(worker.pid, signal.SIGKILL)
        worker.proc.wait(10)  # type: ignore[union-attr]
        worker = procs.worker(redis.url, tmp_path, **settings).start()
        wait_until(lambda: all(t.state.terminal for t in asyncio.run(tasks(redis.url, ids))),
                   300, "every task finished", 0.2)
    finally:
        worker.stop()
        gateway.stop()
    done = asyncio.run(tasks(redis.url, ids))
    assert all(t.state == TaskState.SUCCEEDED for t in done), done
    assert max(t.attempt for t in done) == 2  # the killed batch's tasks ran again
    client = redis.client()
    counters = {k.decode(): int(v) for k, v in client.hgetall(keys.counters(BACKEND)).items()}
    assert counters["tasks_SUCCEEDED"] == 4 and "tasks_FAILED" not in counters
    assert pending_count(client) == 0 and client.xlen(keys.dead_letter(BACKEND)) == 0


def test_a_stopping_worker_gives_its_gathered_tasks_to_the_others(
        redis: procs.RedisServer, tmp_path: Path) -> None:
    """A worker gathered four tasks that cannot share a call (each its own beam size) and is
    stopped while the first runs: it finishes that one and gives the other three back, and a
    second worker runs them at once (they waited out the 60 s visibility timeout)."""
    settings = {"preload": "true", "idle_unload_seconds": "-1", "cpu_threads": "2",
                "visibility_timeout_seconds": "60"}
    first = procs.worker(redis.url, tmp_path, consumer="first", **settings).start()
    second = procs.worker(redis.url, tmp_path, consumer="second", **settings)
    long_clip = (TEST_AUDIO / "multilingual.mp3").read_bytes()  # ~60 s: seconds of work
    try:
        ids = [asyncio.run(submit(redis.url, long_clip, beam_size=beam)) for beam in (1, 2, 3, 4)]

        def holding_all() -> bool:
            running = [t for t in asyncio.run(tasks(redis.url, ids)) if t.state.value == "RUNNING"]
            return bool(running) and pending_count(redis.client()) == 4

        wait_until(holding_all, 60, "the first worker holding all four", 0.05)
        second.start()
        os.kill(first.pid, signal.SIGTERM)
        stopped = time.monotonic()
        wait_until(lambda: all(t.state.terminal for t in asyncio.run(tasks(redis.url, ids))),
                   45, "every task finished before the visibility timeout", 0.2)
        took = time.monotonic() - stopped
    finally:
        second.stop()
        first.stop()
    done = asyncio.run(tasks(redis.url, ids))
    assert all(t.state == TaskState.SUCCEEDED for t in done), done
    assert sorted(t.worker for t in done) == ["first", "second", "second", "second"], took


async def _submit_all(redis_url: str, audios: list[bytes]) -> list[str]:
    return [await submit(redis_url, audio) for audio in audios]


def test_the_sweep_for_company_is_one_round_trip_over_both_lanes(
        redis: procs.RedisServer) -> None:
    """A lone task pays one empty read for the window; a burst is taken in one read too,
    interactive entries first."""
    async def scenario() -> tuple[list[str], list[str], int, int]:
        client = Redis.from_url(redis.url)
        store = WorkerStore(client, settings_for(redis.url), "sweeper")
        await store.ensure_queue()
        before = await reads(client)
        assert await store.sweep(3) == []
        empty_calls = await reads(client) - before
        ids = {}
        for lane in (keys.BATCH, keys.BATCH, keys.INTERACTIVE, keys.BATCH, keys.INTERACTIVE):
            task = Task(id=new_task_id(), backend=BACKEND, model="tiny.en",
                        state=TaskState.PENDING, lane=lane, audio_seconds=1.0)
            await TaskStore(client, 600).submit(task, b"\0" * 64)
            ids[task.id] = lane
        before = await reads(client)
        found = await store.sweep(2)
        calls = await reads(client) - before
        await client.aclose()
        return ([ids[d.task_id] for d in found], [d.lane for d in found], empty_calls, calls)

    async def reads(client: Redis) -> int:
        stats = await client.info("commandstats")
        return int(stats.get("cmdstat_xreadgroup", {}).get("calls", 0))

    owners, lanes, empty_calls, calls = asyncio.run(scenario())
    assert (empty_calls, calls) == (1, 1)
    assert lanes == [keys.INTERACTIVE, keys.INTERACTIVE, keys.BATCH, keys.BATCH]
    assert owners == lanes  # each delivery is its own task's entry


def test_a_calls_size_follows_what_a_clip_was_measured_to_cost() -> None:
    """Not measured yet: a probe of two; measured as nothing (a call that fitted in memory
    already held): the whole batch, not probes of two for ever; measured: what fits."""
    assert batching.next_call(8, None, 1000.0) == batching.PROBE_CALL
    assert batching.next_call(8, 0.0, 1000.0) == 8
    assert batching.next_call(8, 100.0, 250.0) == 2
    assert batching.next_call(8, 100.0, 50.0) == 1
    assert batching.next_call(8, None, None) == 8


def test_a_lying_clip_is_neither_decoded_whole_nor_told_before_its_company_runs() -> None:
    """run_batch with the real tiny.en: a file that told the probe 1.5 s but holds ~48 s of
    speech is decoded only up to where it would leave the call, and its decoded length
    (the charge top-up and the device memory it would wait for: `on_decoded`) is told only
    by its own run after the others, never before their call."""
    from workers.engines.base import ModelRef

    settings = Settings(cpu_threads=2)
    engine = FasterWhisperEngine(settings)
    handle = engine.load(ModelRef("tiny.en", "bundled"), "cpu")
    events: list[tuple[str, int, float]] = []
    short = encode_wav(decode_audio(clips()[3], 16000, None)[:int(1.5 * 16000)], 16000)
    items = [batching.BatchItem(
        params=GREEDY, source=source,
        on_segment=lambda segment, i=index: events.append(("segment", i, segment.end)),
        on_decoded=lambda seconds, i=index: events.append(("decoded", i, seconds)))
        for index, source in enumerate((four_clips(), short, short))]
    outcomes = batching.run_batch(engine, handle, backend=BACKEND, model="tiny.en",
                                  items=items, max_audio_seconds=4 * 3600.0,
                                  allowed_roots=(), probed_seconds=1.5)
    engine.unload(handle)
    assert isinstance(outcomes[0], batching.Longer), outcomes[0]
    assert all(not isinstance(outcome, batching.Longer | Exception) for outcome in outcomes[1:])
    assert [event for event in events if event[1] == 0] == [], events  # told nothing yet
    assert sorted(i for kind, i, _ in events if kind == "decoded") == [1, 2], events


def test_a_clip_the_shared_call_failed_runs_again_alone_after_the_others() -> None:
    """run_batch with the real tiny.en: a clip the shared call fails (here an option the
    English-only model refuses, as its neighbours' memory or an engine error might) comes
    back `Again`, not retried inside the call: the others' results go out first, and its
    own run alone (the engine host's, after them) gives its own error."""
    from workers.engines.base import ModelRef

    engine = FasterWhisperEngine(Settings(cpu_threads=2))
    handle = engine.load(ModelRef("tiny.en", "bundled"), "cpu")
    jfk = (TEST_AUDIO / "jfk.flac").read_bytes()

    def item(language: str) -> batching.BatchItem:
        return batching.BatchItem(params={**GREEDY, "language": language}, source=jfk,
                                  on_segment=lambda segment: None)

    def run(items: list[batching.BatchItem]) -> list[Any]:
        return batching.run_batch(engine, handle, backend=BACKEND, model="tiny.en",
                                  items=items, max_audio_seconds=600.0, allowed_roots=(),
                                  probed_seconds=11.0)

    first, again, last = run([item("en"), item("de"), item("en")])
    (alone,) = run([item("de")])
    engine.unload(handle)
    assert isinstance(again, batching.Again), again
    for outcome in (first, last):
        assert wer(JFK_TEXT, outcome.result["text"]) <= 0.1, outcome
    assert "English-only" in str(alone), alone


def test_what_a_long_batch_measured_does_not_shrink_short_ones() -> None:
    """A batch call teaches the worker what a clip of its length class costs in memory; a
    batch of long clips does not set what a batch of short ones may take (it was one
    lifetime maximum: one long batch made every later short call probe-sized or smaller)."""
    from workers.engine_host import EngineHost
    from workers.engines.base import ModelRef

    settings = worker_settings("redis://127.0.0.1:9/0", cpu_threads=2)
    engine = FasterWhisperEngine(settings)
    host = EngineHost(settings, engine)
    handle = engine.load(ModelRef("tiny.en", "bundled"), "cpu")
    long_clip = encode_wav(np.concatenate(
        [decode_audio(clip, 16000, None) for clip in clips()[:6]]), 16000)  # ~70 s
    items = [batching.BatchItem(params=GREEDY, source=long_clip,
                                on_segment=lambda segment: None) for _ in range(2)]
    host._run_batch(engine, handle, "tiny.en", items, 70.0)
    engine.unload(handle)
    host.executor.shutdown()
    assert host.batch_item_mib(70.0) is not None  # measured for its class
    assert host.batch_item_mib(3.0) is None  # nothing known of short clips: they probe


def test_a_fixed_call_bound_is_each_clips_in_a_batched_call() -> None:
    """SPEECH_MAX_ENGINE_CALL_SECONDS sized for one task: a batched call of four clips gets
    it four times (it got it once, and a batch that fit per task was taken for stuck, its
    tasks FAILED and the worker restarted); the default bound already follows the work."""
    from workers.engine_host import EngineHost

    fixed = worker_settings("redis://127.0.0.1:9/0", max_engine_call_seconds=30.0)
    host = EngineHost(fixed, FasterWhisperEngine(fixed))
    default = worker_settings("redis://127.0.0.1:9/0")
    scaled = EngineHost(default, FasterWhisperEngine(default))
    try:
        bound, alone = host._bound(30.0, 4), host._bound(30.0)
        assert bound is not None and alone is not None
        assert (bound.seconds, alone.seconds) == (120.0, 30.0)
        by_work = scaled._bound(700.0, 4)
        assert by_work is not None and by_work.seconds == 700.0  # (the batch's whole work)
        assert host._bound(None, 4) is None
    finally:
        host.executor.shutdown()
        scaled.executor.shutdown()
