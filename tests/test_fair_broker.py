"""A device broker that heals (issue 30, finding 4), on a real redis-server: the ledger's Lua
rules, and real in-process workers (faster-whisper's bundled tiny.en) on a cpu budget. Peaks
are kept per model and class (diarizer, audio length), never lowered by a lighter task, age out,
and one past the whole budget is measured again after one lease; a load refused for memory
shows on the device's view (/ready) until one fits."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import numpy as np
import pytest
from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError

from common import keys
from common.audio import decode_audio, encode_wav
from common.schemas import TaskState
from common.store import Task, TaskStore, new_task_id
from common.store.devices import DeviceLedger, devices
from harness import procs
from tests.helpers import JFK
from tests.test_consumer_inprocess import run_worker, submit, task_of, worker_settings
from workers.device_budget import PeakClass

LEASE = 1.0


def test_peaks_per_class_never_lowered_aged_and_a_spurious_one_lapses(
        redis: procs.RedisServer) -> None:
    async def scenario() -> None:
        client = Redis.from_url(redis.url)
        a = DeviceLedger(client, "dev", "a")

        async def reserve(model: str, peak_class: str = "", max_age: float = 0.0
                          ) -> tuple[int, float, bool]:
            answer = await a.reserve("fw", model, 100, 260, LEASE, peak_class, max_age)
            await a.release()
            return answer.status, answer.need, answer.measured

        # a diarized task's peak is its class's, not the plain one's
        await a.record_peak("fw", "m", 180.0, "diarized")
        assert await reserve("m") == (1, 100, False)
        assert await reserve("m", "diarized") == (1, 180.0, True)
        # a lighter measurement never lowers a live peak
        assert await a.record_peak("fw", "m", 150.0) == 150.0
        assert await a.record_peak("fw", "m", 120.0) == 150.0
        assert await reserve("m") == (1, 150.0, True)
        # a class not measured yet starts from the model's plain peak, as a measuring load
        assert await reserve("m", "long") == (1, 150.0, False)
        # peaks age out and are measured again
        await a.record_peak("fw", "old", 200.0, max_age=0.3)
        await asyncio.sleep(0.5)
        assert await reserve("old", max_age=0.3) == (1, 100, False)
        # a spurious peak past the whole budget: refused (and shown) for one lease, no longer
        await a.record_peak("fw", "spiked", 900.0)
        started = time.monotonic()
        assert (await reserve("spiked"))[:2] == (-1, 900.0)
        (view,) = await devices(client)
        assert [r["model"] for r in view.refused] == ["fw/spiked"]
        assert view.public()["refused_loads"] == 1
        while (await reserve("spiked"))[0] != 1:
            await asyncio.sleep(0.05)
        assert time.monotonic() - started <= LEASE + 0.5  # recovered within one lease
        assert (await devices(client))[0].refused == []
        await client.aclose()

    asyncio.run(scenario())


def test_a_holder_grows_in_place_without_waiting_behind_the_line(
        redis: procs.RedisServer) -> None:
    """A holds 600 of 1000 MiB and B waits for 600 (for A's memory, in effect): A's growth
    to 700 fits and is granted at once; queued behind B it would wait until B gave up."""
    async def scenario() -> None:
        client = Redis.from_url(redis.url)
        a, b = DeviceLedger(client, "dev", "a"), DeviceLedger(client, "dev", "b")
        assert (await a.reserve("fw", "m", 600, 1000, LEASE)).status == 1
        assert (await b.reserve("fw", "n", 600, 1000, LEASE)).status == 0  # in line
        grown = await a.reserve("fw", "m", 700, 1000, LEASE)
        assert (grown.status, grown.value) == (1, 700), grown
        assert (await b.reserve("fw", "n", 600, 1000, LEASE)).status == 0  # still waits
        await client.aclose()

    asyncio.run(scenario())


def test_a_worker_recovers_within_one_lease_after_a_spurious_peak(
        redis: procs.RedisServer) -> None:
    settings = worker_settings(redis.url, {"tiny.en": "bundled"}).model_copy(update={
        "device_memory_mib": {"cpu": 100_000}, "device_lease_seconds": LEASE})

    async def record(mib: float, peak_class: str = "") -> None:
        client = Redis.from_url(redis.url)
        await DeviceLedger(client, "any", "x").record_peak("faster-whisper", "tiny.en", mib,
                                                           peak_class)
        await client.aclose()

    # a diarized request's peak past the budget leaves plain tasks alone
    asyncio.run(record(500_000, "diarized"))
    plain = asyncio.run(submit(redis.url, "tiny.en"))
    asyncio.run(run_worker(settings))
    assert asyncio.run(task_of(redis.url, plain)).state == TaskState.SUCCEEDED
    # a spurious plain peak past the budget: the next task is refused, and /ready says so
    asyncio.run(record(500_000))
    refused = asyncio.run(submit(redis.url, "tiny.en"))
    spiked = time.monotonic()
    asyncio.run(run_worker(settings))
    task = asyncio.run(task_of(redis.url, refused))
    assert task.state == TaskState.FAILED and task.error_code == "out_of_memory", task

    async def view() -> list[dict]:
        client = Redis.from_url(redis.url)
        found = (await devices(client))[0].refused
        await client.aclose()
        return found

    assert [r["model"] for r in asyncio.run(view())] == ["faster-whisper/tiny.en"]
    # one lease later the peak is measured again: the task runs and the refusal is gone
    time.sleep(max(0.0, LEASE + 0.1 - (time.monotonic() - spiked)))
    healed = asyncio.run(submit(redis.url, "tiny.en"))
    asyncio.run(run_worker(settings))
    assert asyncio.run(task_of(redis.url, healed)).state == TaskState.SUCCEEDED
    assert asyncio.run(view()) == []


@pytest.mark.parametrize("declared", ["its length", "understated"])
def test_a_long_task_is_measured_in_its_own_length_class(redis: procs.RedisServer,
                                                         declared: str) -> None:
    """A long file's peak (its decoded audio alone is 64 KB a second) is recorded apart from
    the plain one, which it neither raises nor lowers; a file that understated its length to
    the submit (2 s) is reserved for, and measured in, the class of what it decodes to."""
    settings = worker_settings(redis.url, {"tiny.en": "bundled"}).model_copy(update={
        "device_memory_mib": {"cpu": 100_000},
        # a configured size over any peak: the plain load is never refused for the RSS a
        # cpu "device" measures (it varies with what the test process ran before)
        "model_memory_mib": {"faster-whisper/tiny.en": 1000}})
    speech = decode_audio(JFK.read_bytes(), 16000, None)
    long_audio = encode_wav(np.concatenate([speech, np.zeros(150 * 16000, np.float32)]), 16000)

    async def submit_long() -> str:
        client = Redis.from_url(redis.url)
        task = Task(id=new_task_id(), backend="faster-whisper", model="tiny.en",
                    state=TaskState.PENDING, params={"vad_filter": True, "beam_size": 1},
                    audio_seconds=len(long_audio) / 32000 if declared == "its length" else 2.0)
        await TaskStore(client, 600).submit(task, long_audio)
        await client.aclose()
        return task.id

    def peaks() -> dict[str, float]:
        raw = redis.client().hgetall(keys.model_peaks())
        return {k.decode(): float(v) for k, v in raw.items() if b"@" not in k}

    plain_task = asyncio.run(submit(redis.url, "tiny.en"))
    asyncio.run(run_worker(settings))
    plain = peaks()
    assert list(plain) == ["faster-whisper/tiny.en"]
    long_task = asyncio.run(submit_long())
    asyncio.run(run_worker(settings))
    for task_id in (plain_task, long_task):
        found = asyncio.run(task_of(redis.url, task_id))
        assert found.state == TaskState.SUCCEEDED, (found.error_code, found.error)
    after = peaks()
    assert set(after) == {"faster-whisper/tiny.en", "faster-whisper/tiny.en:len1"}
    assert after["faster-whisper/tiny.en"] == plain["faster-whisper/tiny.en"]


def test_peak_classes_name_the_diarizer_and_the_length() -> None:
    assert [PeakClass.of("", s).name for s in (None, 0, 120, 120.5, 600.5, 1800.5, 9e9)] == [
        "", "", "", "len1", "len2", "len3", "len3"]
    long_plain, short_diarized = PeakClass.of("", 700), PeakClass.of("diarized", 30)
    assert long_plain.join(short_diarized).name == "diarized+len2"
    assert short_diarized.join(PeakClass.of("", 30)) == short_diarized  # already covered
    # a class not measured yet starts from the same diarizer's plain length, then plain
    assert PeakClass.of("pyannote", 700).lighter.name == "pyannote"
    assert short_diarized.lighter.name == long_plain.lighter.name == ""


def test_a_resident_model_reserves_the_peak_its_first_long_task_measured(
        redis: procs.RedisServer) -> None:
    """A plain task, then two of 581 s (class len1) on the resident model: the first long one
    reserves from the plain peak and measures its own; the second holds a reservation of at
    least that measured peak while it runs (the broker counts what the worker uses). A plain
    task after them holds the plain reservation again: the long audio is gone, and the
    memory its class held is the other backends' again while the model stays loaded."""
    settings = worker_settings(redis.url, {"tiny.en": "bundled"}).model_copy(update={
        "device_memory_mib": {"cpu": 100_000}, "idle_unload_seconds": -1,
        "batch_max_size": 1})
    speech = decode_audio(JFK.read_bytes(), 16000, None)
    # 581 s (len1): its decoded audio and features alone are ~200 MB over a plain task, a
    # margin the noise of a cpu "device" (the process RSS) cannot hide
    long_audio = encode_wav(np.concatenate([speech, np.zeros(570 * 16000, np.float32)]), 16000)
    held: dict[str, list[float]] = {}
    measured: list[float] = []

    async def scenario() -> None:
        client = Redis.from_url(redis.url)
        store = TaskStore(client, 600)
        ids = []
        for blob in (JFK.read_bytes(), long_audio, long_audio, JFK.read_bytes()):
            task = Task(id=new_task_id(), backend="faster-whisper", model="tiny.en",
                        state=TaskState.PENDING, params={"vad_filter": True, "beam_size": 1},
                        audio_seconds=len(blob) / 32000 if blob is long_audio else 11.0)
            await store.submit(task, blob)
            ids.append(task.id)
        worker = asyncio.create_task(run_worker(settings))
        while not worker.done():  # each task's reservations while it runs
            for task_id in ids:
                if await client.hget(keys.task(task_id), "state") == b"RUNNING":
                    if task_id == ids[2] and task_id not in held:  # what the second measured
                        measured.append(float(await client.hget(
                            keys.model_peaks(), "faster-whisper/tiny.en:len1") or 0))
                    for device in await client.smembers(keys.devices()):
                        for raw in (await client.hgetall(
                                keys.device_holders(device.decode()))).values():
                            held.setdefault(task_id, []).append(json.loads(raw)["mib"])
            await asyncio.sleep(0.02)
        await worker
        for task_id in ids:
            found = await store.get(task_id)
            assert found.state == TaskState.SUCCEEDED, (found.error_code, found.error)
        peaks = {k.decode(): float(v) for k, v in (await client.hgetall(keys.model_peaks())).items()
                 if b"@" not in k}
        await client.aclose()
        # else the check proves nothing
        assert measured[0] > peaks["faster-whisper/tiny.en"] + 10, (measured, peaks)
        assert held[ids[2]][-1] >= measured[0], (held, measured)  # (reserved after its start)
        assert held[ids[3]][-1] < measured[0], (held, measured)

    asyncio.run(scenario())


def test_a_release_the_broker_missed_is_retried(redis: procs.RedisServer,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """A worker unloads (an idle unload, a yield) and its release meets a Redis blip: its
    entry, last marked busy by a process that is alive, would count against the device for
    ever (another worker's load waited, then failed device_busy). The release is owed, and
    retried while the worker idles, so the other worker's load is granted."""
    from common.store.worker import WorkerStore
    from workers.device_budget import BrokeredBudget
    from workers.device_holding import DeviceHolding
    from workers.engines.faster_whisper import FasterWhisperEngine
    from workers.models import ModelSlot

    settings = worker_settings(redis.url, {"tiny.en": "bundled"}).model_copy(update={
        "device_lease_seconds": LEASE, "device_poll_seconds": 0.1, "device_wait_seconds": 3.0,
        "model_memory_mib": {"faster-whisper/tiny.en": 600}})

    async def on_loop(function: Any, *args: Any) -> Any:
        return function(*args)

    async def scenario() -> None:
        client = Redis.from_url(redis.url)
        budgets = [BrokeredBudget(settings, WorkerStore(client, settings, name), "dev", 1000)
                   for name in ("a", "b")]
        slot = ModelSlot(FasterWhisperEngine(settings), "cpu", {"tiny.en": "bundled"})
        holding = DeviceHolding(budgets[0], slot, on_loop, False, "cpu")
        await holding.reserve("tiny.en")
        slot.acquire("tiny.en")
        await holding.settle()  # idle: the model stays, its reservation marked so
        keeper = asyncio.create_task(holding.keep(asyncio.Lock()))
        await holding.reserve("tiny.en")  # a task starts: busy
        real, blips = budgets[0].ledger.release, [0]

        async def blip() -> None:
            if not blips[0]:
                blips[0] += 1
                raise RedisConnectionError("a Redis blip")
            await real()

        monkeypatch.setattr(budgets[0].ledger, "release", blip)
        slot.unload()  # (as a failed call or an exit path leaves it: the model gone)
        await holding.settle()
        assert blips == [1] and holding.release_owed
        try:
            assert await budgets[1].reserve("tiny.en") == 600  # the whole 1000 MiB is free
        finally:
            keeper.cancel()
            await budgets[1].release()
            await client.aclose()
        assert not holding.release_owed

    asyncio.run(scenario())
