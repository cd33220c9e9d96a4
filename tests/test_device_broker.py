"""The device memory broker (issue 19): a per-device budget in Redis that loads reserve
before they happen, idle models yield, and loads that cannot fit wait in line (FIFO) or
fail. On cpu with a set budget, with real processes: redis-server, the gateway, and
workers of three backends (faster-whisper's bundled tiny.en, the tiny qwen3 and vibevoice
checkpoints), with per-model sizes from SPEECH_MODEL_MEMORY_MIB so the arithmetic is exact."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from redis.asyncio import Redis

from common import keys
from common.schemas import TaskState
from common.store import WorkerStore
from common.store.devices import DeviceLedger, devices
from harness import procs
from harness.http_client import http
from harness.procs import TEST_AUDIO, wait_until
from tests.helpers import JFK, submit_file, wait_done
from tests.test_consumer_inprocess import run_worker, submit, task_of, worker_settings
from tests.tiny import env_python, tiny_model
from workers.device_budget import device_label, for_worker

LONG = TEST_AUDIO / "multilingual.mp3"  # seconds of work for tiny.en on cpu
LEASE = 2.0
MIB = 1000  # every model's configured size


# --- the ledger's rules, one Lua call each, on a real redis-server -----------------------

def test_the_ledger_reserves_queues_asks_idle_holders_and_expires(
        redis: procs.RedisServer) -> None:
    async def scenario() -> None:
        client = Redis.from_url(redis.url)
        a, b, c = (DeviceLedger(client, "host/cpu", name) for name in "abc")

        async def reserve(ledger: DeviceLedger, model: str, need: float = MIB,
                          lease: float = 30.0) -> tuple[int, float, float]:
            answer = await ledger.reserve("fw", model, need, 2 * MIB, lease)
            return answer.status, answer.need, answer.value

        async def view() -> Any:
            return (await devices(client))[0]

        assert await reserve(a, "m1") == (1, MIB, MIB)
        assert await reserve(b, "m2") == (1, MIB, 2 * MIB)
        # never fits: refused at once, not queued
        assert await reserve(c, "huge", need=3 * MIB) == (-1, 3 * MIB, 2 * MIB)
        assert (await view()).waiting == []
        # both holders busy: c waits in line and asks nobody
        assert await reserve(c, "m3") == (0, MIB, 1)
        holders = (await view()).holders
        assert holders["a"]["evict"] == 0 and holders["b"]["evict"] == 0
        # a second load in line is behind c (FIFO), even once memory is free
        d = DeviceLedger(client, "host/cpu", "d")
        assert await reserve(d, "m4") == (0, MIB, 2)
        # b's task ends, then a's: the head asks the least recently used idle holder only
        assert await b.mark(False, 30.0)
        await asyncio.sleep(0.01)
        assert await a.mark(False, 30.0)
        assert await reserve(c, "m3") == (0, MIB, 1)
        holders = (await view()).holders
        assert holders["b"]["evict"] == 1 and holders["a"]["evict"] == 0
        assert await b.renew(30.0) == 2 and await a.renew(30.0) == 1
        # b starts a task meanwhile: the request stands (a new call does not withdraw it),
        # and b is told to yield before the call
        assert await b.mark(True, 30.0) == 2
        assert (await view()).holders["b"]["evict"] == 1
        # b yields: counted as an eviction; c, first in line, gets in before d
        assert await b.release()
        assert await reserve(d, "m4") == (0, MIB, 2)
        assert await reserve(c, "m3") == (1, MIB, 2 * MIB)
        seen = await view()
        assert seen.evictions == 1 and seen.reserved_mib == 2 * MIB and seen.free_mib == 0
        assert [w["consumer"] for w in seen.waiting] == ["d"]
        # a measured peak above the configured need is what the next reservation asks for
        await d.record_peak("fw", "m4", 1500.0)
        assert await reserve(d, "m4") == (0, 1500.0, 1)
        # a holder that stops renewing is gone after its lease, and the line moves on
        assert await c.renew(0.3) == 1  # c's last renewal: then it is killed
        await a.release()
        await asyncio.sleep(0.5)
        assert await reserve(d, "m4") == (1, 1500.0, 1500.0)
        assert set((await view()).holders) == {"d"}
        await client.aclose()

    asyncio.run(scenario())


def test_a_holder_busy_call_after_call_is_asked_to_yield_past_the_waiters_patience(
        redis: procs.RedisServer) -> None:
    """A holder with a steady queue is busy whenever the head of the line looks, so it was
    never asked to yield and another backend's load waited out its bound and failed. Past
    its patience the head asks busy holders too; the holder learns it as its next call
    starts (mark answers 2) and yields before it."""
    async def scenario() -> None:
        client = Redis.from_url(redis.url)
        a, b = (DeviceLedger(client, "host/steady", name) for name in "ab")
        assert (await a.reserve("fw", "m1", MIB, MIB, 30.0)).status == 1  # busy from here

        async def wait_in_line() -> int:
            return (await b.reserve("qw", "m2", MIB, MIB, 30.0, busy_yield_after=0.3)).status

        assert await wait_in_line() == 0
        for _ in range(3):  # call after call: idle only between two marks
            assert await a.mark(False, 30.0) == 1
            assert await a.mark(True, 30.0) == 1
            assert await wait_in_line() == 0
        await asyncio.sleep(0.35)
        assert await wait_in_line() == 0  # past its patience: a is asked, busy as it is
        assert await a.mark(False, 30.0) == 2 and await a.mark(True, 30.0) == 2
        assert await a.release()
        assert await wait_in_line() == 1
        await client.aclose()

    asyncio.run(scenario())


def test_patience_counts_from_the_head_of_the_line_and_a_request_lapses_with_the_line(
        redis: procs.RedisServer) -> None:
    """A waiter behind another is not impatient when it reaches the head: the holder just
    granted (loading, busy) is asked only once the new head has waited its patience there.
    And a request to yield whose line has gone (its waiter served or gone) is withdrawn: a
    busy holder would unload after its call for nobody."""
    async def scenario() -> None:
        client = Redis.from_url(redis.url)
        a, b, c = (DeviceLedger(client, "host/heads", name) for name in "abc")

        async def wait(ledger: DeviceLedger) -> int:
            return (await ledger.reserve("qw", ledger.consumer, MIB, MIB, 30.0,
                                         busy_yield_after=0.3)).status

        assert (await a.reserve("fw", "a", MIB, MIB, 30.0)).status == 1  # busy
        assert await wait(b) == 0 and await wait(c) == 0  # b first, then c
        await asyncio.sleep(0.35)  # both have waited past their patience
        assert await wait(b) == 0  # b, the head, asks a (busy)
        assert await a.mark(True, 30.0) == 2
        assert await a.release()
        assert await wait(b) == 1  # granted, loading: busy
        assert await wait(c) == 0  # c is the head only now
        assert await b.mark(True, 30.0) == 1  # … and does not ask b yet
        await asyncio.sleep(0.35)
        assert await wait(c) == 0  # its patience at the head is spent: b is asked
        assert await b.mark(False, 30.0) == 2
        await c.leave_line()  # c goes (its task cancelled, or device_busy)
        assert await b.mark(True, 30.0) == 1  # nobody waits: the request is withdrawn
        assert await b.renew(30.0) == 1
        await client.aclose()

    asyncio.run(scenario())


# --- in-process workers: loads that can never fit, and peaks past their reservation ------

def test_a_load_that_can_never_fit_fails_at_once(redis: procs.RedisServer) -> None:
    settings = worker_settings(redis.url, {"tiny.en": "bundled"}).model_copy(update={
        "device_memory_mib": {"cpu": 500}, "model_memory_mib": {"faster-whisper/tiny.en": 900},
        "device_wait_seconds": 60.0})
    task_id = asyncio.run(submit(redis.url, "tiny.en"))
    started = time.monotonic()
    asyncio.run(run_worker(settings))
    assert time.monotonic() - started < 30  # not the 60 s a waiting load would take
    task = asyncio.run(task_of(redis.url, task_id))
    assert task.state == TaskState.FAILED and task.error_code == "out_of_memory", task
    assert "needs 900 MiB, more than the whole 500 MiB budget" in task.error
    view = asyncio.run(_devices(redis.url))[0]
    assert view.waiting == [] and view.holders == {} and view.budget_mib == 500


def test_a_peak_past_its_reservation_is_refused_and_recorded(redis: procs.RedisServer) -> None:
    settings = worker_settings(redis.url, {"tiny.en": "bundled"}).model_copy(update={
        "device_memory_mib": {"cpu": 100_000},
        "model_memory_mib": {"faster-whisper/tiny.en": 1}})
    first = asyncio.run(submit(redis.url, "tiny.en"))
    asyncio.run(run_worker(settings))
    task = asyncio.run(task_of(redis.url, first))
    assert task.state == TaskState.FAILED and task.error_code == "out_of_memory", task
    assert "more than its 1 MiB reservation" in task.error
    peak = float(redis.client().hget(keys.model_peaks(), "faster-whisper/tiny.en"))
    assert peak > 1
    # the next load reserves the recorded peak, and serves
    second = asyncio.run(submit(redis.url, "tiny.en"))
    asyncio.run(run_worker(settings))
    served = asyncio.run(task_of(redis.url, second))
    assert served.state == TaskState.SUCCEEDED, served.error
    assert asyncio.run(_devices(redis.url))[0].holders == {}  # released as it left


def test_a_load_that_waits_past_its_bound_fails_device_busy(redis: procs.RedisServer) -> None:
    """The whole budget held by a busy reservation (another worker's, mid-task): the load
    waits in line `device_wait_seconds`, then its task FAILS with device_busy."""
    settings = worker_settings(redis.url, {"tiny.en": "bundled"}).model_copy(update={
        "device_memory_mib": {"cpu": MIB}, "model_memory_mib": {"faster-whisper/tiny.en": MIB},
        "device_wait_seconds": 1.0})
    async def hold() -> None:
        client = Redis.from_url(redis.url)
        budget = for_worker(settings, WorkerStore(client, settings, "x"), "cpu", 0)
        ledger = DeviceLedger(client, budget.device_id, "busy-neighbour")
        assert (await ledger.reserve("other", "big", MIB, MIB, 600.0)).reserved
        await client.aclose()

    asyncio.run(hold())
    task_id = asyncio.run(submit(redis.url, "tiny.en"))
    started = time.monotonic()
    asyncio.run(run_worker(settings))
    assert 1.0 <= time.monotonic() - started < 20
    task = asyncio.run(task_of(redis.url, task_id))
    assert task.state == TaskState.FAILED and task.error_code == "device_busy", task
    assert "waited 1 s for 1000 MiB" in task.error
    (view,) = asyncio.run(_devices(redis.url))
    assert view.waiting == [] and set(view.holders) == {"busy-neighbour"}
    assert view.device.endswith("/" + device_label("cpu"))


def test_a_model_of_unknown_size_is_measured_not_refused(redis: procs.RedisServer) -> None:
    """No size configured and no cap (the cuda default): its first load reserves 0 MiB,
    serves, and records the peak its next loads reserve."""
    settings = worker_settings(redis.url, {"tiny.en": "bundled"}).model_copy(update={
        "device_memory_mib": {"cpu": 100_000}})
    task_id = asyncio.run(submit(redis.url, "tiny.en"))
    asyncio.run(run_worker(settings))
    assert asyncio.run(task_of(redis.url, task_id)).state == TaskState.SUCCEEDED
    assert float(redis.client().hget(keys.model_peaks(), "faster-whisper/tiny.en")) > 1
    # … also where the model is unloaded after each task (idle unload 0): it was unloaded
    # before its peak was read, so none was ever recorded
    redis.client().delete(keys.model_peaks())
    task_id = asyncio.run(submit(redis.url, "tiny.en"))
    asyncio.run(run_worker(settings.model_copy(update={"idle_unload_seconds": 0})))
    assert asyncio.run(task_of(redis.url, task_id)).state == TaskState.SUCCEEDED
    assert float(redis.client().hget(keys.model_peaks(), "faster-whisper/tiny.en") or 0) > 1


def test_a_broker_call_redis_refuses_is_a_wait_or_a_clear_failure(
        redis: procs.RedisServer) -> None:
    """Redis refusing the broker's call: out of reach or full (a failover, noeviction) is no
    fault of the task's, a wait (its entry given back; a full Redis's error was read as "GPU
    memory limit" and the task FAILED out_of_memory); an error no wait cures (here the
    holders key is another application's string: WRONGTYPE) fails the task saying so, and the
    worker serves on."""
    from redis.exceptions import OutOfMemoryError, ReadOnlyError, ResponseError

    from common.store.connection import store_unreachable
    from workers import memory

    full = OutOfMemoryError("command not allowed when used memory > 'maxmemory'",
                            status_code="OOM")
    assert store_unreachable(full) and not memory.is_out_of_memory(full)
    assert store_unreachable(ReadOnlyError("You can't write against a read only replica."))
    assert not store_unreachable(ResponseError("WRONGTYPE Operation against a key"))
    settings = worker_settings(redis.url, {"tiny.en": "bundled"}).model_copy(update={
        "device_memory_mib": {"cpu": 100_000}})
    holders = keys.device_holders(f"{socket.gethostname()}/cpu")
    redis.client().set(holders, "another application's value")
    task_id = asyncio.run(submit(redis.url, "tiny.en"))
    try:
        left = asyncio.run(run_worker(settings))
    finally:
        redis.client().delete(holders)
    assert not left["exits"], left["exits"]
    task = asyncio.run(task_of(redis.url, task_id))
    assert (task.state, task.error_code) == (TaskState.FAILED, "engine_error"), task.error
    assert "WRONGTYPE" in (task.error or "") and "memory" not in (task.error or "").lower()


def test_a_worker_starting_drops_a_reservation_left_under_its_name(
        redis: procs.RedisServer, tmp_path: Any) -> None:
    """An entry under this worker's name at its start is one an earlier image of it left (a
    re-exec with Redis away: same pid, so no neighbour purges it as dead): a fresh image
    holds nothing, so it goes, and the card's budget with it is whole again (it stayed short
    until this worker next loaded, maybe never)."""
    device, name = f"{socket.gethostname()}/cpu", "worker-left-behind"

    async def left_behind() -> None:
        client = Redis.from_url(redis.url)
        ledger = DeviceLedger(client, device, name)
        await ledger.register(100_000)
        assert (await ledger.reserve("faster-whisper", "tiny.en", 5000, 100_000, 3600)
                ).status == 1
        await client.aclose()

    asyncio.run(left_behind())
    holders = keys.device_holders(device)
    assert name.encode() in redis.client().hkeys(holders)
    worker = procs.worker(redis.url, tmp_path, consumer=name, idle_unload_seconds="-1",
                          device_memory_mib=json.dumps({"cpu": 100_000})).start()
    try:  # up, idle, nothing loaded: only its start can have dropped it
        wait_until(lambda: name.encode() not in redis.client().hkeys(holders), 20,
                   "the entry left under its name", 0.2)
    finally:
        worker.stop()


def test_a_model_whose_source_fails_its_precheck_does_not_evict_the_resident_one(
        redis: procs.RedisServer) -> None:
    """With the broker on, a task for a model whose source fails the check before any load
    (a missing directory) unloaded the resident model first, to reserve for a load that
    allocates nothing: each such task cost the good model a reload. It stays now."""
    settings = worker_settings(redis.url, {"tiny.en": "bundled",
                                           "missing": "/nonexistent/model"}).model_copy(
        update={"device_memory_mib": {"cpu": 100_000}, "idle_unload_seconds": -1,
                "batch_window_ms": 0})  # one task at a time, in order
    good, bad, again = (asyncio.run(submit(redis.url, model))
                        for model in ("tiny.en", "missing", "tiny.en"))
    left = asyncio.run(run_worker(settings))
    states = [asyncio.run(task_of(redis.url, task_id)).state for task_id in (good, bad, again)]
    assert states == [TaskState.SUCCEEDED, TaskState.FAILED, TaskState.SUCCEEDED], states
    assert left["worker"].host.slot.loads == 1  # tiny.en loaded once, kept through the bad one


async def _devices(url: str) -> list[Any]:
    client = Redis.from_url(url)
    try:
        return await devices(client)
    finally:
        await client.aclose()


# --- three backends' workers on one budget that fits two models -------------------------

class Sampler(threading.Thread):
    """Every 100 ms: the device's reservations, as Redis holds them (leases past their expiry
    left out, as every broker call does)."""

    def __init__(self, redis_url: str) -> None:
        super().__init__(daemon=True)
        self.redis_url = redis_url
        self.samples: list[dict[str, dict[str, Any]]] = []
        self.done = threading.Event()

    def run(self) -> None:
        client = procs.redis.Redis.from_url(self.redis_url)
        while not self.done.is_set():
            now = sum(int(x) / (1, 1e6)[i] for i, x in enumerate(client.time()))
            for device_id in client.smembers(keys.devices()):
                holders = {k.decode(): json.loads(v) for k, v in
                           client.hgetall(keys.device_holders(device_id.decode())).items()}
                self.samples.append({k: v for k, v in holders.items() if v["expires"] >= now})
            time.sleep(0.1)

    def stop(self) -> list[dict[str, dict[str, Any]]]:
        self.done.set()
        self.join(5)
        return self.samples


BACKENDS = {"faster-whisper": ("core", None), "qwen3": ("hf", "qwen3"),
            "vibevoice": ("hf", "vibevoice")}


@pytest.fixture(scope="module")
def trio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    if not env_python("hf").exists():
        pytest.skip("the hf environment (.venvs/hf) is not installed")
    workdir = tmp_path_factory.mktemp("broker")
    models = {"faster-whisper": {"tiny.en": "bundled"},
              "qwen3": {"tiny": str(tiny_model("qwen3"))},
              "vibevoice": {"tiny": str(tiny_model("vibevoice"))}}
    sizes = {f"{backend}/{model}": MIB for backend, named in models.items() for model in named}
    redis = procs.RedisServer(workdir / "redis", appendonly=False).start()
    common = {"models": models, "model_memory_mib": sizes,
              "device_memory_mib": {"cpu": 2 * MIB}, "allowed_roots": [str(TEST_AUDIO)]}
    gateway = procs.gateway(redis.url, workdir, **common).start()
    workers = {backend: procs.worker(redis.url, workdir, backend=backend,
                                     python=env_python(env), idle_unload_seconds="-1",
                                     device_lease_seconds=str(LEASE),
                                     device_poll_seconds="0.1", **common)
               for backend, (env, _) in BACKENDS.items()}
    for service in workers.values():
        service.start(wait=False)
    for service in workers.values():
        wait_until(service.healthy, 120, f"{service.log_path}", 0.2)
    yield {"gateway": gateway.url, "workers": workers, "redis": redis}
    for service in (*workers.values(), gateway):
        service.stop()
    redis.stop()


def test_three_models_on_a_budget_of_two_all_succeed(trio: dict) -> None:
    gateway = trio["gateway"]
    sampler = Sampler(trio["redis"].url)
    sampler.start()
    try:
        task_ids = []
        for _ in range(3):  # three rounds, interleaved: every round needs an eviction
            round_ids = [submit_file(gateway, JFK, backend=b).json()["taskid"] for b in BACKENDS]
            task_ids += round_ids
            for task_id in round_ids:
                assert wait_done(gateway, task_id, timeout=120)["status"] == "SUCCEEDED"
    finally:
        samples = sampler.stop()
    assert len(samples) > 20
    for sample in samples:
        assert sum(h["mib"] for h in sample.values()) <= 2 * MIB, sample
        assert len(sample) <= 2, sample  # at most two models loaded (or loading) at once
        # a holder running a task is asked to yield only once a load has waited past its
        # patience (a quarter of SPEECH_DEVICE_WAIT_SECONDS: never here); one asked while
        # idle yields before its next task, never marked busy meanwhile
        assert not any(h["busy"] == 1 and h["evict"] == 1 for h in sample.values()), sample
    ready = http.get(f"{gateway}/ready", timeout=10).json()
    (device,) = ready["devices"].values()
    assert device["budget_mib"] == 2 * MIB and device["reserved_mib"] <= 2 * MIB
    assert device["free_mib"] == 2 * MIB - device["reserved_mib"]
    assert device["waiting_loads"] == 0 and device["evictions"] >= 3
    metrics = http.get(f"{gateway}/metrics", timeout=10).text
    assert f'speech_device_budget_mib{{device="{next(iter(ready["devices"]))}"}} 2000.0' in metrics
    assert "speech_device_evictions_total" in metrics and "speech_device_waiting_loads" in metrics
    # the loads' waits in line are observed, apart from the loads themselves
    assert 'speech_device_wait_seconds_count{backend="qwen3"}' in metrics


def test_a_busy_holder_finishes_and_a_killed_one_lapses(trio: dict) -> None:
    """Half the budget held by a ballast reservation (another process's, busy): a load
    waits for the busy holder's task to end (the holder is never asked to yield mid-task),
    and, when that holder is killed mid-task, for its lease to lapse."""
    gateway, workers, client = trio["gateway"], trio["workers"], trio["redis"].client()
    device_id = next(iter(http.get(f"{gateway}/ready", timeout=10).json()["devices"]))
    holders_key = keys.device_holders(device_id)
    fw_consumer = http.get(f"{workers['faster-whisper'].url}/health").json()["consumer"]

    def holders() -> dict[str, Any]:
        return _live(client, holders_key)

    wait_until(lambda: asyncio.run(ballast(trio, device_id)), 30, "the ballast reservation",
               0.1)
    try:
        long_id = submit_file(gateway, LONG).json()["taskid"]
        wait_until(lambda: holders().get(fw_consumer, {}).get("busy") == 1, 60, "fw busy")
        evictions = int(client.hget(keys.device(device_id), "evictions") or 0)
        qwen_id = submit_file(gateway, JFK, backend="qwen3").json()["taskid"]
        waited = []
        while (view := http.get(f"{gateway}/api/status", params={"taskid": long_id},
                                 timeout=10).json())["status"] not in ("SUCCEEDED", "FAILED"):
            fw = holders().get(fw_consumer)
            assert fw is None or not (fw["busy"] == 1 and fw["evict"] == 1), fw
            device = http.get(f"{gateway}/ready", timeout=10).json()["devices"][device_id]
            waited += [w for w in device["waiting"] if w["backend"] == "qwen3"]
            time.sleep(0.05)
        assert view["status"] == "SUCCEEDED"
        assert waited and waited[0]["need"] == MIB  # qwen3's load waited in line, visibly
        assert wait_done(gateway, qwen_id, timeout=120)["status"] == "SUCCEEDED"
        assert int(client.hget(keys.device(device_id), "evictions")) == evictions + 1
        # a holder killed mid-task: its reservation lapses within the lease, the load goes on
        submit_file(gateway, LONG).json()["taskid"]
        wait_until(lambda: holders().get(fw_consumer, {}).get("busy") == 1, 60, "fw busy")
        vv_id = submit_file(gateway, JFK, backend="vibevoice").json()["taskid"]
        wait_until(lambda: waiting(gateway, device_id, "vibevoice"), 30, "vibevoice in line")
        os.kill(workers["faster-whisper"].pid, signal.SIGKILL)
        killed = time.monotonic()
        wait_until(lambda: fw_consumer not in holders(), LEASE + 1.0, "the lease to lapse")
        assert time.monotonic() - killed <= LEASE + 1.0
        assert wait_done(gateway, vv_id, timeout=120)["status"] == "SUCCEEDED"
    finally:
        asyncio.run(ballast(trio, device_id, release=True))


def test_a_stopped_holder_keeps_its_reservation_until_it_resumes(trio: dict) -> None:
    """A holder SIGSTOPped mid-task stops renewing, but its process (and on a card, its
    memory) is still there: past its lease the load in line keeps waiting, nothing is
    over-committed; resumed, the holder renews, finishes and yields, and the load goes on."""
    gateway, workers, client = trio["gateway"], trio["workers"], trio["redis"].client()
    fw = workers["faster-whisper"]
    if fw.proc.poll() is not None:  # the test before killed it
        fw.start()
    device_id = next(iter(http.get(f"{gateway}/ready", timeout=10).json()["devices"]))
    holders_key = keys.device_holders(device_id)
    fw_consumer = http.get(f"{fw.url}/health").json()["consumer"]

    def vibevoice_waiting() -> bool:
        return waiting(gateway, device_id, "vibevoice")

    def every_holder() -> dict[str, Any]:  # lapsed leases included: what is still counted
        return {k.decode(): json.loads(v) for k, v in client.hgetall(holders_key).items()}

    wait_until(lambda: asyncio.run(ballast(trio, device_id)), 60, "the ballast reservation",
               0.1)  # half the budget, held throughout
    stopped = False
    try:
        long_id = submit_file(gateway, LONG).json()["taskid"]
        wait_until(lambda: _live(client, holders_key).get(fw_consumer, {}).get("busy") == 1,
                   60, "fw busy")
        vv_id = submit_file(gateway, JFK, backend="vibevoice").json()["taskid"]
        wait_until(vibevoice_waiting, 30, "vibevoice in line")
        os.kill(fw.pid, signal.SIGSTOP)
        stopped = True
        time.sleep(LEASE + 1.0)  # the lease lapsed; the line polls every 0.1 s
        assert fw_consumer not in _live(client, holders_key)  # lapsed ...
        held = every_holder()
        assert fw_consumer in held  # ... but not taken away, and /ready says so
        shown = http.get(f"{gateway}/ready", timeout=10).json()["devices"][device_id]
        assert shown["lapsed"][fw_consumer]["lapsed_seconds"] > 0, shown
        assert shown["lapsed_mib"] == held[fw_consumer]["mib"] > 0, shown  # still counted
        assert fw_consumer not in shown["holders"]
        assert sum(h["mib"] for h in held.values()) <= 2 * MIB, held
        assert vibevoice_waiting()  # still in line
        os.kill(fw.pid, signal.SIGCONT)
        stopped = False
        # (stopped past the tests' 1.5 s heartbeat, its task may have been failed meanwhile)
        assert wait_done(gateway, long_id, timeout=120)["status"] in ("SUCCEEDED", "FAILED")
        assert wait_done(gateway, vv_id, timeout=120)["status"] == "SUCCEEDED"
    finally:
        if stopped:
            os.kill(fw.pid, signal.SIGCONT)
        asyncio.run(ballast(trio, device_id, release=True))


async def ballast(trio: dict, device_id: str, release: bool = False) -> bool:
    """Half the budget reserved (or given back) by another process's consumer, busy."""
    redis = Redis.from_url(trio["redis"].url)
    ledger = DeviceLedger(redis, device_id, "ballast")
    try:
        if release:
            return await ledger.release()
        return (await ledger.reserve("other", "ballast", MIB, 2 * MIB, 600.0)).reserved
    finally:
        await redis.aclose()


def waiting(gateway: str, device_id: str, backend: str) -> bool:
    """Whether a load of `backend` waits in the device's line (/ready)."""
    line = http.get(f"{gateway}/ready", timeout=10).json()["devices"][device_id]["waiting"]
    return any(w["backend"] == backend for w in line)


def _live(client: Any, key: str) -> dict[str, Any]:
    """The unexpired holders in `key`, as the broker counts them."""
    seconds, micros = client.time()
    now = seconds + micros / 1e6
    return {k.decode(): json.loads(v) for k, v in client.hgetall(key).items()
            if json.loads(v)["expires"] >= now}


def test_workers_pinned_to_different_cards_keep_apart_budgets(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """One host, two cards, a worker pinned to each (CUDA_VISIBLE_DEVICES): each sees its
    card as cuda:0, and used to key one shared budget, a card's size for both, so loads
    waited or evicted for nothing. The label names the card the process sees first."""
    labels = {}
    for visible in ("", "0", "1", "GPU-5f1c2d3e,GPU-aa", " 1 "):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        labels[visible] = device_label("cuda")
    assert labels == {"": "cuda:0", "0": "cuda:0", "1": "cuda:1",
                      "GPU-5f1c2d3e,GPU-aa": "cuda:GPU-5f1c2d3e", " 1 ": "cuda:1"}
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert (device_label("cuda"), device_label("cpu")) == ("cuda:0", "cpu")
