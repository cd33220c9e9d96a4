"""What Redis keeps, and for how long (issue 12): inputs leave with the terminal write,
positions survive a Redis restart, an idempotency key makes one task, and the optional
blob directory keeps the same lifetimes. One redis-server, gateway and in-process worker
(tests/inprocess.py) serve the whole module: nothing here is about a worker's death."""

from __future__ import annotations

import asyncio
import hashlib
import io
import os
import time
import wave
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from common import keys
from common.blobs import BlobDir
from common.schemas import TaskState
from common.store import Duplicate, Task, TaskStore, new_task_id
from harness import procs
from harness.http_client import http
from harness.procs import wait_until
from harness.reply_dropper import ReplyDropper
from tests.helpers import JFK, status, submit_file, wait_done
from tests.inprocess import InProcessWorker, worker_settings

BACKEND = "faster-whisper"


def noise_wav(seconds: float, seed: int, rate: int = 16000, channels: int = 1) -> bytes:
    """Quiet noise, 16-bit (at 16 kHz mono 32 KB per second); VAD finds no speech in it."""
    samples = np.random.default_rng(seed).normal(
        0, 30, int(rate * seconds) * channels).astype(np.int16)
    buffer = io.BytesIO()
    with wave.open(buffer, "wb") as out:
        out.setnchannels(channels)
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(samples.tobytes())
    return buffer.getvalue()


@pytest.fixture(scope="module")
def service(module_redis: procs.RedisServer,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    workdir = tmp_path_factory.mktemp("lifetimes")
    gateway = procs.gateway(module_redis.url, workdir).start()
    worker = InProcessWorker(worker_settings(module_redis.url, preload=True)).start()
    yield {"redis": module_redis, "gateway": gateway, "worker": worker, "tmp": workdir}
    worker.stop()
    gateway.stop()


def input_blobs(client: object) -> list[bytes]:
    """Every input blob, staged uploads (BlobStore.stage) included."""
    return [*client.scan_iter(match=f"{keys.PREFIX}blob:*:input", count=500),  # type: ignore[attr-defined]
            *client.scan_iter(match=keys.staged_input("*"), count=500)]  # type: ignore[attr-defined]


def test_a_refused_or_repeated_upload_leaves_no_staged_blob(service: dict) -> None:
    """An upload is staged while it is probed: a refusal drops it, a repeat drops its own, a
    queued task's becomes its input (and leaves with its terminal write)."""
    gateway, client = service["gateway"].url, service["redis"].client()
    clip, garbage = noise_wav(2.0, seed=3), os.urandom(200_000)
    sage, openai = f"{gateway}/api/{BACKEND}-submit", f"{gateway}/v1/audio/transcriptions"
    refused = http.post(openai, files={"file": ("g.wav", garbage)},
                         data={"model": "whisper-1"}, timeout=60)
    assert refused.status_code == 400, refused.text
    # a good upload refused for another field, read after the upload was staged
    odd = http.post(openai, files={"file": ("n.wav", clip)},
                    data={"model": "whisper-1", "stream": "maybe"}, timeout=60)
    assert odd.status_code == 400 and odd.json()["error"]["param"] == "stream", odd.text
    assert input_blobs(client) == []
    failed = http.post(sage, files={"file": ("g.wav", garbage)}, timeout=60).json()
    assert failed["status"] == "FAILED", failed  # Sage's refusals are FAILED tasks
    headers = {"Idempotency-Key": "staged-once"}
    first, again = (http.post(sage, files={"file": ("n.wav", clip)}, headers=headers,
                               timeout=60).json()["taskid"] for _ in range(2))
    assert first == again
    assert wait_done(gateway, first)["status"] == "SUCCEEDED"
    assert input_blobs(client) == []


def test_inputs_leave_redis_with_their_terminal_write(service: dict) -> None:
    gateway, client = service["gateway"].url, service["redis"].client()
    # 1 MiB in 5.5 s of audio (48 kHz stereo): the blobs' size is what matters here, and the
    # worker's decode and VAD then cover 5.5 s a task, not 32
    clip = noise_wav(5.5, seed=1, rate=48000, channels=2)
    assert len(clip) > 1_000_000
    first = http.post(f"{gateway}/api/{BACKEND}-submit", files={"file": ("n.wav", clip)},
                       data={"vad_filter": "true"}, timeout=60).json()["taskid"]
    assert wait_done(gateway, first)["status"] == "SUCCEEDED"
    client.memory_purge()
    before = int(client.info("memory")["used_memory"])

    def one(index: int) -> str:
        reply = http.post(f"{gateway}/api/{BACKEND}-submit",
                           files={"file": (f"n{index}.wav", clip)},
                           data={"vad_filter": "true"}, timeout=120)
        assert reply.status_code == 200, reply.text
        return reply.json()["taskid"]

    with ThreadPoolExecutor(4) as pool:
        ids = list(pool.map(one, range(200)))
    outcomes = [wait_done(gateway, task_id, timeout=300)["status"] for task_id in ids]
    assert outcomes == ["SUCCEEDED"] * 200
    assert input_blobs(client) == []
    client.memory_purge()
    after = int(client.info("memory")["used_memory"])
    hashes = sum(client.memory_usage(keys.task(task_id)) or 0 for task_id in ids)
    assert after - before - hashes < 10 * 1024 * 1024, (before, after, hashes)


def test_queue_positions_and_waiting_survive_a_redis_restart(service: dict,
                                                            tmp_path: Path) -> None:
    gateway, redis, worker = service["gateway"].url, service["redis"], service["worker"]
    short = tmp_path / "short.wav"  # what is queued matters here, not what it says
    short.write_bytes(noise_wav(1.0, seed=2))
    done = submit_file(gateway, short).json()["taskid"]  # the group has delivered something
    assert wait_done(gateway, done)["status"] == "SUCCEEDED"
    worker.stop()
    ids = [submit_file(gateway, short).json()["taskid"] for _ in range(20)]
    assert [status(gateway, t)["queue_position"] for t in ids] == list(range(1, 21))
    assert waiting_metric(gateway) == 20
    redis.restart()
    head = wait_until(lambda: _position(gateway, ids[0]), 30, "status after the restart")
    assert head == 1
    assert status(gateway, ids[-1])["queue_position"] == 20
    assert waiting_metric(gateway) == 20
    worker.start()
    assert [wait_done(gateway, t, timeout=240)["status"] for t in ids] == ["SUCCEEDED"] * 20
    assert waiting_metric(gateway) == 0


def _position(gateway: str, task_id: str) -> int | None:
    reply = status(gateway, task_id)
    return reply.get("queue_position")


def waiting_metric(gateway: str) -> float:
    text = http.get(f"{gateway}/metrics", timeout=10).text
    line = next(line for line in text.splitlines()
                if line.startswith(f'speech_queue_waiting{{backend="{BACKEND}"}}'))
    return float(line.split()[-1])


def test_an_idempotency_key_makes_one_task(service: dict) -> None:
    gateway, client = service["gateway"].url, service["redis"].client()
    length_before = queued_entries(client)
    first = submit_file(gateway, JFK, idempotency_key="order-17").json()["taskid"]
    again = submit_file(gateway, JFK, idempotency_key="order-17").json()["taskid"]
    assert again == first

    def concurrent(_: int) -> str:
        with JFK.open("rb") as handle:
            reply = http.post(f"{gateway}/api/{BACKEND}-submit", files={"file": handle},
                               headers={"Idempotency-Key": "burst-1"}, timeout=60)
        assert reply.status_code == 200, reply.text
        return reply.json()["taskid"]

    with ThreadPoolExecutor(10) as pool:
        burst = set(pool.map(concurrent, range(10)))
    assert len(burst) == 1 and first not in burst
    assert queued_entries(client) == length_before + 2
    finished = wait_done(gateway, first)
    assert finished["status"] == "SUCCEEDED"
    replay = submit_file(gateway, JFK, idempotency_key="order-17").json()
    assert replay["taskid"] == first and replay["state"] == "SUCCEEDED"
    assert queued_entries(client) == length_before + 2
    too_long = submit_file(gateway, JFK, idempotency_key="x" * 300)
    assert too_long.status_code == 400 and "idempotency" in too_long.json()["error"]
    wait_done(gateway, burst.pop())

    def openai_call() -> httpx.Response:  # a client retrying a sync call it lost the reply of
        with JFK.open("rb") as handle:
            return http.post(f"{gateway}/v1/audio/transcriptions", files={"file": handle},
                              data={"model": "whisper-1"},
                              headers={"Idempotency-Key": "sync-1"}, timeout=120)

    first_call, retry = openai_call(), openai_call()
    assert first_call.status_code == retry.status_code == 200, retry.text
    assert first_call.headers["x-task-id"] == retry.headers["x-task-id"]
    assert retry.json()["text"] == first_call.json()["text"]
    assert queued_entries(client) == length_before + 3


def test_idempotency_keys_belong_to_their_owner(service: dict, tmp_path: Path) -> None:
    digests = [f"sha256:{hashlib.sha256(k.encode()).hexdigest()}"
               for k in ("key-a", "key-b")]
    gateway = procs.gateway(service["redis"].url, tmp_path, api_keys=digests).start()
    try:
        ids = []
        for key in ("key-a", "key-b", "key-a"):
            with JFK.open("rb") as handle:
                reply = http.post(f"{gateway.url}/api/{BACKEND}-submit", files={"file": handle},
                                   headers={"Authorization": f"Bearer {key}",
                                            "Idempotency-Key": "same"}, timeout=60)
            assert reply.status_code == 200, reply.text
            ids.append(reply.json()["taskid"])
        assert ids[0] == ids[2] and ids[0] != ids[1]
    finally:
        gateway.stop()


def test_an_empty_blob_dir_setting_is_none_not_the_working_directory(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from common.settings import Settings

    for blank in ("", "  "):
        monkeypatch.setenv("SPEECH_BLOB_DIR", blank)
        assert Settings().blob_dir is None
    monkeypatch.setenv("SPEECH_BLOB_DIR", "/srv/blobs")
    assert Settings().blob_dir == Path("/srv/blobs")


def test_blob_dir_keeps_the_same_lifetimes(service: dict, tmp_path: Path) -> None:
    """The store on a real Redis with a blob directory: big blobs go to files, small ones
    stay in Redis; a finished task's input file is gone; only the winning attempt's output
    is kept; a repeated idempotency key leaves no file; the janitor removes orphans. In a
    database of its own (1), emptied first: the module's worker consumes database 0."""
    url = f"redis://127.0.0.1:{service['redis'].port}/1"
    blob_root = tmp_path / "blobs"

    async def scenario() -> None:
        redis = Redis.from_url(url)
        await redis.flushdb()
        store = TaskStore(redis, 3600, BlobDir(blob_root, min_bytes=1000))
        big, small = b"i" * 5000, b"s" * 10

        def task(task_id: str) -> Task:
            return Task(id=task_id, backend=BACKEND, model="tiny.en", state=TaskState.PENDING)

        await store.submit(task("big"), big, idempotency_key="k1")
        await store.submit(task("small"), small)
        assert (blob_root / "big.input").read_bytes() == big
        assert await redis.get(keys.input_blob("big")) is None
        assert await store.blobs.input("big") == big and await store.blobs.input("small") == small
        with pytest.raises(Duplicate) as repeat:
            await store.submit(task("big2"), big, idempotency_key="k1")
        assert repeat.value.task_id == "big" and not (blob_root / "big2.input").exists()

        first = await store.start("big", "w1", 1, BACKEND)
        # a redelivery: the first attempt is stale
        second = await store.start("big", "w2", 2, BACKEND)
        stale = await store.finish(task("big"), TaskState.SUCCEEDED, attempt=first, entry_id="",
                                   result={}, output=b"o" * 4000)
        won = await store.finish(task("big"), TaskState.SUCCEEDED, attempt=second, entry_id="",
                                 result={}, output=b"w" * 4000)
        assert (stale, won) == (False, True)
        assert await store.blobs.output("big") == b"w" * 4000
        assert sorted(p.name for p in blob_root.iterdir()) == ["big.output.2"]
        assert await store.blobs.input("big") is None

        attempt = await store.start("small", "w1", 1, BACKEND)
        assert await store.finish(task("small"), TaskState.SUCCEEDED, attempt=attempt,
                                  entry_id="", result={}, output=b"tiny")
        assert await store.blobs.output("small") == b"tiny"
        assert await redis.get(keys.input_blob("small")) is None

        orphan = blob_root / "gone.input"  # its task vanished before the file was deleted
        orphan.write_bytes(b"x")
        old = time.time() - 120
        os.utime(orphan, (old, old))
        assert await store.blobs.sweep() == 1 and not orphan.exists()
        assert (blob_root / "big.output.2").exists()
        await redis.aclose()

    asyncio.run(scenario())


def queued_entries(client) -> int:
    """Entries in both priority lanes' streams (an OpenAI call queues on the interactive one)."""
    return sum(client.xlen(keys.queue(BACKEND, lane)) for lane in keys.LANES)


def test_a_staged_upload_becomes_the_input_or_the_submit_carries_it(service: dict) -> None:
    """The submit renames a staged upload to its task's input (with the task's lifetime);
    where the staged key is gone (staged on a primary that failed over since), the submit
    sends the blob itself. In a database of its own (2): the module's worker uses 0."""
    url = f"redis://127.0.0.1:{service['redis'].port}/2"

    async def scenario() -> None:
        redis = Redis.from_url(url)
        await redis.flushdb()
        store = TaskStore(redis, 3600)
        blob = os.urandom(50_000)

        def task(task_id: str) -> Task:
            return Task(id=task_id, backend=BACKEND, model="tiny.en", state=TaskState.PENDING)

        staged = await store.blobs.stage(blob)
        assert staged and await redis.get(staged) == blob
        await store.submit(task("renamed"), blob, staged=staged)
        assert await redis.exists(staged) == 0
        assert await store.blobs.input("renamed") == blob
        assert 3500 < await redis.ttl(keys.input_blob("renamed")) <= 3600
        lost = await store.blobs.stage(blob)
        await redis.delete(lost)
        await store.submit(task("carried"), blob, staged=lost)
        assert await store.blobs.input("carried") == blob
        assert await redis.hget(keys.task("carried"), "state") == b"PENDING"
        await redis.flushdb()
        await redis.aclose()

    asyncio.run(scenario())


def test_a_submit_whose_reply_is_lost_withdraws_a_task_without_a_key(
        module_redis: procs.RedisServer) -> None:
    """Redis ran the submit, its reply never came: the caller is told the store is away (a
    503) and, without an idempotency key, sends the work again as a new task; the first is
    withdrawn where it was written, so the 503 queued nothing. With a key it stays queued:
    the retry finds it."""

    # no worker of this backend runs beside the test's (the module's worker would take them)
    backend = "vibevoice"

    async def scenario() -> dict[str, bytes | None]:
        proxy = ReplyDropper(module_redis.port)
        port = await proxy.start()
        client = Redis(host="127.0.0.1", port=port, socket_timeout=0.5,
                       retry=Retry(NoBackoff(), 0))
        store = TaskStore(client, 60)
        states: dict[str, bytes | None] = {}
        warm = Task(id=new_task_id(), backend=backend, model="tiny",
                    state=TaskState.PENDING, input_path="x.wav")
        await store.submit(warm, None)  # the scripts are cached before any reply is lost
        await store.cancel(warm.id, warm.backend)
        direct = Redis.from_url(module_redis.url)
        for name, key in (("no key", ""), ("a key", "lost-reply")):
            task = Task(id=new_task_id(), backend=backend, model="tiny",
                        state=TaskState.PENDING, input_path="x.wav")
            proxy.drop_next = True
            with pytest.raises(RedisError):
                await store.submit(task, None, idempotency_key=key)
            states[name] = await direct.hget(keys.task(task.id), "state")
        await client.aclose()
        await direct.aclose()
        await proxy.stop()
        return states

    assert asyncio.run(scenario()) == {"no key": b"CANCELLED", "a key": b"PENDING"}


def test_a_lost_submit_whose_withdrawal_fails_too_is_withdrawn_once_redis_is_back(
        module_redis: procs.RedisServer) -> None:
    """The submit's reply is lost and Redis is away for the withdrawal as well: the task
    stays queued at first, and is withdrawn in the background once Redis answers again (it
    was left to run, a second copy of the work its caller was told 503 of and sends again)."""
    backend = "vibevoice"  # no worker of it runs beside the test's

    async def scenario() -> tuple[bytes | None, bytes | None]:
        proxy = ReplyDropper(module_redis.port)
        port = await proxy.start()
        client = Redis(host="127.0.0.1", port=port, socket_timeout=0.5,
                       retry=Retry(NoBackoff(), 0))
        store = TaskStore(client, 60)
        warm = Task(id=new_task_id(), backend=backend, model="tiny",
                    state=TaskState.PENDING, input_path="x.wav")
        await store.submit(warm, None)
        await store.cancel(warm.id, warm.backend)
        direct = Redis.from_url(module_redis.url)
        task = Task(id=new_task_id(), backend=backend, model="tiny", state=TaskState.PENDING,
                    input_path="x.wav")
        proxy.drop_next = proxy.refuse_after_drop = True
        with pytest.raises(RedisError):
            await store.submit(task, None)
        during = await direct.hget(keys.task(task.id), "state")
        proxy.refuse_after_drop = proxy.refusing = False
        deadline = time.monotonic() + 10
        while (after := await direct.hget(keys.task(task.id), "state")) != b"CANCELLED" \
                and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        await client.aclose()
        await direct.aclose()
        await proxy.stop()
        return during, after

    assert asyncio.run(scenario()) == (b"PENDING", b"CANCELLED")


def test_a_live_sessions_charge_sent_again_after_a_lost_reply_counts_once(
        module_redis: procs.RedisServer) -> None:
    """A session's meter charges its audio outside tasks as it goes; a charge whose reply was
    lost (Redis ran it) is sent again with the next, and the owner's usage and all-time total
    count each second once, not the lost charge twice."""
    from common.store.usage import Charge, UsageStore

    owner = f"owner-{new_task_id()}"

    async def scenario() -> tuple[list[float], bytes | None]:
        proxy = ReplyDropper(module_redis.port)
        port = await proxy.start()
        client = Redis(host="127.0.0.1", port=port, socket_timeout=0.5,
                       retry=Retry(NoBackoff(), 0))
        usage = UsageStore(client)
        meter = "meter-a"
        await usage.charge_now(Charge(owner, "faster-whisper", "audio_seconds", 2.0),
                               session=(meter, 2.0))
        proxy.drop_next = True  # 3 s more, run but never answered: the meter still says 2
        with pytest.raises(RedisError):
            await usage.charge_now(Charge(owner, "faster-whisper", "audio_seconds", 3.0),
                                   session=(meter, 5.0))
        # sent again with the next second of audio: from 2 to 6, of which Redis has 5
        await usage.charge_now(Charge(owner, "faster-whisper", "audio_seconds", 4.0),
                               session=(meter, 6.0))
        await usage.charge_now(Charge(owner, "faster-whisper", "audio_seconds", 1.0),
                               session=("meter-b", 1.0))  # another session's own count
        used = [period.used.get("audio_seconds", 0.0) for period in await usage.periods(owner)]
        total = await client.hget(keys.usage_total(owner), "audio_seconds:faster-whisper")
        await client.aclose()
        await proxy.stop()
        return used, total

    used, total = asyncio.run(scenario())
    assert used == [7.0, 7.0] and total is not None and float(total) == 7.0, (used, total)
