"""Delivery details without supervisord: preload, lease extension, the janitor that takes
over a dead worker's task, and the memory cap that refuses work (issue 3). One redis-server
(emptied for each test) and one gateway serve the module; a worker is a process where the
test kills it or its process exits, and in-process (tests/inprocess.py) elsewhere."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import procs
from harness.http_client import http
from harness.procs import TEST_AUDIO, wait_until
from tests.helpers import JFK, pending_count, submit_file, wait_done
from tests.inprocess import InProcessWorker, worker_settings

LONG = TEST_AUDIO / "multilingual.mp3"  # ~5 s of work: longer than the visibility timeout
VISIBILITY = 3.0


@pytest.fixture(scope="module")
def gateway(module_redis: procs.RedisServer,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The module's gateway (default settings) on the module's redis-server."""
    service = procs.gateway(module_redis.url, tmp_path_factory.mktemp("delivery")).start()
    yield service.url
    service.stop()


@pytest.fixture
def in_process(redis: procs.RedisServer) -> Iterator[InProcessWorker]:
    """A worker in the test process, serving HTTP too, on the emptied module redis."""
    worker = InProcessWorker(worker_settings(redis.url), http=True).start()
    yield worker
    worker.stop()


@pytest.fixture
def pair(redis: procs.RedisServer, gateway: str, tmp_path: Path) -> Iterator[dict]:
    """Two preloading worker processes with a short visibility timeout."""
    settings = {"visibility_timeout_seconds": str(VISIBILITY), "preload": "true",
                "idle_unload_seconds": "-1"}
    workers = [procs.worker(redis.url, tmp_path, **settings).start() for _ in range(2)]
    yield {"gateway": gateway, "workers": workers, "redis": redis}
    for service in workers:
        service.stop()


def health(worker: procs.Service) -> dict:
    return http.get(f"{worker.url}/health", timeout=5).json()


def test_preload_lease_and_janitor(pair: dict) -> None:
    gateway, workers = pair["gateway"], pair["workers"]
    # preload: the default model is resident before any task
    for worker in workers:
        wait_until(lambda w=worker: health(w)["loaded_models"] == ["tiny.en"], 30, "preload")
    # lease: a task longer than the visibility timeout is not stolen from its live worker
    task_id = submit_file(gateway, LONG).json()["taskid"]
    assert wait_done(gateway, task_id, timeout=120)["status"] == "SUCCEEDED"
    view = http.get(f"{gateway}/v1/tasks/{task_id}").json()
    assert view["attempts"] == 1 and view["deliveries"] == 1
    # janitor: a worker killed for good; the other claims its task after the timeout. Each
    # worker's name is read first, so the kill follows the RUNNING state at once (on a
    # loaded machine, asking both workers then could outlast the task).
    by_consumer = {health(w)["consumer"]: w for w in workers}
    task_id = submit_file(gateway, LONG).json()["taskid"]
    running = wait_until(lambda: (v := http.get(f"{gateway}/v1/tasks/{task_id}").json())
                         ["status"] == "RUNNING" and v, 30, "RUNNING", 0.02)
    victim = by_consumer[running["worker"]]
    os.kill(victim.pid, signal.SIGKILL)
    survivor = next(w for w in workers if w is not victim)
    final = wait_done(gateway, task_id, timeout=120)
    assert final["status"] == "SUCCEEDED"
    view = http.get(f"{gateway}/v1/tasks/{task_id}").json()
    assert view["deliveries"] == 2 and view["worker"] == health(survivor)["consumer"]
    assert pending_count(pair["redis"].client()) == 0


def test_a_graceful_stop_does_not_count_against_the_delivery_limit(
        redis: procs.RedisServer, gateway: str, tmp_path: Path) -> None:
    """SIGTERM (a rollout, a scale-in, `ctl.sh restart`) whose grace ends before the task:
    its entry is redelivered, and that delivery is not the task's doing. With
    SPEECH_MAX_DELIVERIES=1 the next worker runs it to SUCCEEDED (it was FAILED
    delivery_limit and dead-lettered); a crash (SIGKILL) still counts."""
    settings = {"stop_grace_seconds": "0.2", "max_deliveries": "1", "preload": "true",
                "idle_unload_seconds": "-1", "consumer": "graceful"}
    for stop, outcome in ((signal.SIGTERM, "SUCCEEDED"), (signal.SIGKILL, "FAILED")):
        worker = procs.worker(redis.url, tmp_path, **settings).start()
        wait_until(lambda w=worker: health(w)["loaded_models"] == ["tiny.en"], 30, "preload")
        task_id = submit_file(gateway, LONG).json()["taskid"]
        wait_until(lambda t=task_id: http.get(f"{gateway}/v1/tasks/{t}").json()["status"]
                   == "RUNNING", 30, "RUNNING", 0.02)
        os.kill(worker.pid, stop)
        assert worker.proc is not None and worker.proc.wait(30) is not None
        again = procs.worker(redis.url, tmp_path, **settings).start()  # reads its own first
        try:
            final = wait_done(gateway, task_id, timeout=120)
        finally:
            again.stop()
        assert final["status"] == outcome, (stop, final)
        view = http.get(f"{gateway}/v1/tasks/{task_id}").json()
        if outcome == "SUCCEEDED":
            assert view["deliveries"] == 2 and view["attempts"] == 2, view
        else:
            assert "gave up after 1 deliveries" in view["error"], view


def test_an_abandoned_entry_is_found_behind_any_number_of_leased_ones(
        redis: procs.RedisServer) -> None:
    """Two workers hold 30 entries leased (their gathered batches), a third died holding one
    more: another worker's janitor takes the dead one's within a few turns (XAUTOCLAIM looks
    at ten pending entries a call), and never a leased one."""
    import asyncio

    from redis.asyncio import Redis

    from common import keys
    from common.store.queue import Queue

    stream = keys.queue("faster-whisper", keys.BATCH)

    async def scenario() -> tuple[list[str], str]:
        client = Redis.from_url(redis.url)
        for lane in keys.LANES:
            await client.xgroup_create(keys.queue("faster-whisper", lane), keys.WORKER_GROUP,
                                       id="0", mkstream=True)
        ids = [await client.xadd(stream, {"task_id": f"t{i}"}) for i in range(31)]
        for holder in ("w1", "w2"):
            await client.xreadgroup(keys.WORKER_GROUP, holder, {stream: ">"}, count=15)
        await client.xreadgroup(keys.WORKER_GROUP, "dead", {stream: ">"}, count=1)
        await client.xclaim(stream, keys.WORKER_GROUP, "dead", 0, [ids[-1]], idle=60_000,
                            justid=True)  # its lease long lapsed
        janitor = Queue(client, "faster-whisper", "w3")
        found = []
        for _ in range(3):  # turns; the leased entries stay fresh (idle well under 30 s)
            found += [d.task_id or "" for d in await janitor.claim_abandoned(30.0)]
        owner = (await client.xpending_range(stream, keys.WORKER_GROUP, min=ids[-1],
                                             max=ids[-1], count=1))[0]["consumer"]
        await client.aclose()
        return found, owner.decode()

    found, owner = asyncio.run(scenario())
    assert found == ["t30"] and owner == "w3", (found, owner)


def test_an_engine_call_past_its_bound_fails_its_task_and_the_worker_leaves(
        redis: procs.RedisServer, gateway: str) -> None:
    """A call that does not return within SPEECH_MAX_ENGINE_CALL_SECONDS is taken for stuck
    (a driver call never returns; its worker would beat on, holding the task RUNNING): its
    task FAILS engine_error at once, a task the worker had gathered but not started goes
    back to the others, and the worker leaves (its thread cannot be stopped). Here the call
    is a real one, only longer than the bound the test sets."""
    stuck = submit_file(gateway, LONG, beam_size="1").json()["taskid"]
    other = submit_file(gateway, LONG, beam_size="2").json()["taskid"]  # its own call
    bounded = worker_settings(redis.url, max_engine_call_seconds=0.3,
                              visibility_timeout_seconds=VISIBILITY)
    worker = InProcessWorker(bounded).start()
    try:
        final = wait_done(gateway, stuck, timeout=60)
        assert final["status"] == "FAILED" and "ran past" in final["error"], final
        view = http.get(f"{gateway}/v1/tasks/{stuck}", timeout=10).json()
        assert view["error_code"] == "engine_error" and view["attempts"] == 1, view
        wait_until(lambda: worker.exits == [1], 30, "the worker left", 0.1)
        assert http.get(f"{gateway}/v1/tasks/{other}", timeout=10).json()["status"] == "PENDING"
    finally:
        worker.stop()
    fresh = InProcessWorker(worker_settings(redis.url, consumer="fresh",
                                            visibility_timeout_seconds=VISIBILITY)).start()
    try:  # the gathered task was given back: another worker runs it, as its first attempt
        final = wait_done(gateway, other, timeout=120)
        assert final["status"] == "SUCCEEDED", final
    finally:
        fresh.stop()


def test_memory_cap_refuses_work_and_the_worker_keeps_serving(redis: procs.RedisServer,
                                                               gateway: str) -> None:
    worker = InProcessWorker(worker_settings(redis.url, memory_cap_mib=1),  # below any RSS
                             http=True).start()
    try:
        final = wait_done(gateway, submit_file(gateway, JFK).json()["taskid"])
        assert final["status"] == "FAILED" and "memory cap is 1 MiB" in final["error"]
        reply = http.post(f"{gateway}/v1/audio/transcriptions",
                           files={"file": JFK.open("rb")}, timeout=60)
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "out_of_memory"
        state = http.get(f"{worker.url}/health", timeout=5).json()
        assert state["loaded_models"] == [] and state["memory_cap_mib"] == 1
        assert worker.exits == []  # it never asked to exit
    finally:
        worker.stop()


def test_a_task_no_worker_takes_fails_after_max_queue_seconds(redis: procs.RedisServer,
                                                              tmp_path: Path) -> None:
    models = {"faster-whisper": {"tiny.en": "bundled"}, "parakeet": {"tiny": "/models/p.nemo"}}
    gateway = procs.gateway(redis.url, tmp_path, models=models, max_queue_seconds="2").start()
    try:  # no parakeet worker runs at all; the submitted task waits while the call does
        task_id = submit_file(gateway.url, JFK, backend="parakeet").json()["taskid"]
        reply = http.post(f"{gateway.url}/v1/audio/transcriptions", timeout=30,
                           files={"file": JFK.open("rb")}, data={"model": "parakeet/tiny"})
        assert reply.status_code == 503 and reply.json()["error"]["code"] == "no_worker"
        final = wait_done(gateway.url, task_id, timeout=30)
        assert final["status"] == "FAILED" and "no parakeet worker" in final["error"]
    finally:
        gateway.stop()


def test_a_worker_whose_loop_cannot_run_exits_instead_of_looking_alive(
        redis: procs.RedisServer, tmp_path: Path) -> None:
    """Its HTTP port is taken: the server loop dies, so the whole process exits 1."""
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        worker = procs.worker(redis.url, tmp_path)
        worker.env["SPEECH_WORKER_PORT"] = str(port)
        worker.start(wait=False)
        try:
            assert worker.proc is not None and worker.proc.wait(timeout=60) == 1
            assert "exiting" in worker.log() and "Address already in use" in worker.log()
        finally:
            worker.stop()


def test_streams_are_trimmed_past_retention(redis: procs.RedisServer, gateway: str,
                                            in_process: InProcessWorker) -> None:
    import asyncio

    from redis.asyncio import Redis

    from common import keys
    from common.store import TaskStore
    from gateway.jobs.sweeper import trim

    ids = [submit_file(gateway, JFK).json()["taskid"] for _ in range(2)]
    assert all(wait_done(gateway, t)["status"] == "SUCCEEDED" for t in ids)
    assert redis.client().xlen(keys.queue("faster-whisper")) == 2

    async def trim_now(older_than: float) -> None:
        client = Redis.from_url(redis.url)
        await trim(TaskStore(client, 60), "faster-whisper", older_than)
        await client.aclose()

    asyncio.run(trim_now(3600))  # nothing is an hour old
    assert redis.client().xlen(keys.queue("faster-whisper")) == 2
    asyncio.run(trim_now(0))
    assert redis.client().xlen(keys.queue("faster-whisper")) == 0
    # the queue still works after a trim
    again = submit_file(gateway, JFK).json()["taskid"]
    assert wait_done(gateway, again)["status"] == "SUCCEEDED"


def test_a_successful_load_closes_the_breaker(redis: procs.RedisServer, gateway: str,
                                              in_process: InProcessWorker) -> None:
    from common import keys

    # earlier failures left tiny.en's breaker open (say the files were being replaced)
    breaker = keys.breaker("faster-whisper", "tiny.en")
    redis.client().hset(breaker, mapping={"open": 1, "failures": 3, "error": "model was broken",
                                          "reopens_at": time.time() + 3600})
    assert submit_file(gateway, JFK).status_code == 503
    with JFK.open("rb") as handle:  # open: a direct call is refused as a submit is
        refused = http.post(f"{in_process.url}/transcribe", files={"file": handle}, timeout=60)
    assert refused.status_code == 503 and refused.json()["code"] == "model_unavailable"
    redis.client().hset(breaker, "reopens_at", time.time() - 1)  # its cool-down is over
    with JFK.open("rb") as handle:  # the files are fine again: the direct call is its probe
        assert http.post(f"{in_process.url}/transcribe", files={"file": handle},
                          timeout=60).status_code == 200
    assert not redis.client().exists(breaker)
    task_id = submit_file(gateway, JFK).json()["taskid"]
    assert wait_done(gateway, task_id)["status"] == "SUCCEEDED"
