"""Lanes that interleave and a bound on claims (issue 30, findings 2 and 3), on a real
redis-server, gateway and faster-whisper worker (tiny.en) with short espeak-ng clips: an aged
batch backlog gets one entry per `batch_promotion_every` interactive ones, never all first;
only a key allowed it takes the interactive lane; a key has at most its in-flight tasks; a
container that understates its length is charged, and counted in the backlog, near it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from redis.asyncio import Redis

from common import keys
from common.store.queue import Queue
from gateway.auth import digest
from harness import procs
from harness.conversation import speak_to
from harness.http_client import http
from tests.audio_fakes import decoded_seconds, lying_matroska, silence_opus
from tests.helpers import wait_task

pytestmark = pytest.mark.timeout(300)
KEYS = {name: f"key-lanes-{name}-secret" for name in ("batchy", "live", "capped", "small")}


def auth(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[name]}"}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("fair-lanes")
    clips = workdir / "clips"
    clips.mkdir()
    clip = clips / "short.wav"
    speak_to(clip, "Hello world.")
    server = procs.RedisServer(workdir / "redis").start()
    entries = [{"key": "sha256:" + digest(KEYS["batchy"]), "name": "batchy"},
               {"key": "sha256:" + digest(KEYS["live"]), "name": "live", "interactive": True},
               {"key": "sha256:" + digest(KEYS["capped"]), "name": "capped",
                "max_in_flight": 3},
               {"key": "sha256:" + digest(KEYS["small"]), "name": "small",
                "quotas": {"audio_seconds_per_day": 60}}]
    gateway = procs.gateway(server.url, workdir, api_keys=entries,
                            allowed_roots=[str(clips)]).start()
    yield {"redis": server, "client": server.client(), "gateway": gateway.url,
           "workdir": workdir, "clips": clips, "clip": clip}
    gateway.stop()
    server.stop()


def submit(env: dict[str, Any], key: str, **params: Any) -> httpx.Response:
    return http.post(f"{env['gateway']}/api/faster-whisper-submit", headers=auth(key),
                      data={"audio_path": str(env["clip"]), **params}, timeout=30)


def task_id(reply: httpx.Response) -> str:
    assert reply.status_code == 200, reply.text
    return reply.json()["task_id"]


@contextlib.contextmanager
def keyed_gateway(tmp_path: Path, text: str, **settings: str) -> Iterator[
        tuple[procs.RedisServer, procs.Service, Callable[[], httpx.Response]]]:
    """A Redis of its own and a gateway (the "batchy" key, `settings`, no worker), and an
    upload of `text` spoken to tmp_path/clip.wav under that key."""
    server = procs.RedisServer(tmp_path / "redis-keyed").start()
    gateway = procs.gateway(server.url, tmp_path, api_keys=[digest(KEYS["batchy"])],
                            **settings).start()
    clip = tmp_path / "clip.wav"
    speak_to(clip, text)

    def upload() -> httpx.Response:
        return http.post(f"{gateway.url}/api/faster-whisper-submit", headers=auth("batchy"),
                         files={"file": ("clip.wav", clip.read_bytes())}, timeout=30)

    try:
        yield server, gateway, upload
    finally:
        gateway.stop()
        server.stop()


def cancel(env: dict[str, Any], key: str, tid: str) -> None:
    http.delete(f"{env['gateway']}/v1/tasks/{tid}", headers=auth(key), timeout=30)


def test_an_aged_backlog_gets_one_entry_per_n_interactive(tmp_path) -> None:
    """The read order itself, on a real Redis: every batch entry is long overdue."""
    server = procs.RedisServer(tmp_path / "redis").start()

    async def scenario() -> list[str]:
        redis = Redis.from_url(server.url)
        for lane in keys.LANES:
            await redis.xgroup_create(keys.queue("b", lane), keys.WORKER_GROUP, id="0",
                                      mkstream=True)
        for index in range(10):  # added at epoch 1 s: older than any promotion age
            await redis.xadd(keys.queue("b", keys.BATCH), {"task_id": f"b{index}"},
                             id=f"1000-{index + 1}")
            await redis.xadd(keys.queue("b", keys.INTERACTIVE), {"task_id": f"i{index}"})
        queue = Queue(redis, "b", "c1", promotion_seconds=5, promotion_every=4)
        order = [(await queue.read(block_ms=None))[0].lane[0] for _ in range(15)]
        await redis.aclose()
        return order

    try:
        order = asyncio.run(scenario())
    finally:
        server.stop()
    # a new worker owes batch one entry, then one in five
    assert "".join(order) == "biiiibiiiibiibb"


def test_a_task_from_a_keys_line_is_as_old_as_its_submit_for_the_promotion(tmp_path) -> None:
    """A task that waited in its key's line gets its stream entry when it comes in; its age
    for the batch lane's promotion is still its submit's (the entry carries it), so a flood's
    line does not make its tasks younger than interactive work submitted after them."""
    from common.schemas import TaskState
    from common.store import Task, TaskStore
    from common.store.worker import WorkerStore
    from tests import inprocess

    server = procs.RedisServer(tmp_path / "redis").start()
    backend = "faster-whisper"

    async def scenario() -> list[str | None]:
        redis = Redis.from_url(server.url)
        store = TaskStore(redis, 600)
        await store.ensure_queue(backend)
        for task_id, lane in (("b1", keys.BATCH), ("b2", keys.BATCH)):
            await store.submit(Task(id=task_id, backend=backend, model="tiny.en", owner="a",
                                    state=TaskState.PENDING, lane=lane), b"\0" * 64,
                               lane_share=1)
        await asyncio.sleep(0.6)  # b2 waits in line past the promotion age
        first = Queue(redis, backend, "w1", promotion_seconds=0.5)
        taken = await first.read(block_ms=None)
        worker = WorkerStore(redis, inprocess.worker_settings(server.url), "w1")
        await worker.taken(taken)  # b2 comes in now, behind an interactive task below
        await store.submit(Task(id="i1", backend=backend, model="tiny.en", owner="b",
                                state=TaskState.PENDING, lane=keys.INTERACTIVE), b"\0" * 64,
                           lane_share=1)
        second = Queue(redis, backend, "w2", promotion_seconds=0.5)
        order = [d.task_id for d in taken] + [
            (await second.read(block_ms=None))[0].task_id for _ in range(2)]
        await redis.aclose()
        return order

    try:
        order = asyncio.run(scenario())
    finally:
        server.stop()
    assert order == ["b1", "b2", "i1"]  # b2 overdue: promoted before the interactive one


def test_an_interactive_call_waits_for_the_running_task_not_an_aged_backlog(
        env: dict[str, Any]) -> None:
    batch = [task_id(submit(env, "batchy")) for _ in range(25)]
    time.sleep(1.5)  # the whole backlog is past its promotion age
    worker = procs.worker(env["redis"].url, env["workdir"], idle_unload_seconds="-1",
                          allowed_roots=[str(env["clips"])], preload="true",
                          batch_promotion_seconds="1", batch_promotion_every="4",
                          batch_window_ms="0").start()  # lanes, one task at a time
    try:
        for tid in batch[:3]:  # a rate is measured
            wait_task(env["gateway"], tid, headers=auth("batchy"), timeout=60)
        with env["clip"].open("rb") as handle:
            reply = http.post(f"{env['gateway']}/v1/audio/transcriptions",
                               headers=auth("live"), files={"file": ("a.wav", handle)},
                               data={"model": "whisper-1"}, timeout=120)
        assert reply.status_code == 200, reply.text
        assert "x-estimated-wait" in reply.headers
        call = http.get(f"{env['gateway']}/v1/tasks/{reply.headers['x-task-id']}",
                         headers=auth("live"), timeout=30).json()
        records = [http.get(f"{env['gateway']}/v1/tasks/{tid}", headers=auth("batchy"),
                             timeout=30).json() for tid in batch]
    finally:
        worker.stop()
        for tid in batch:
            cancel(env, "batchy", tid)
    assert env["client"].hget(keys.task(call["id"]), "lane") == b"interactive"
    overtaking = [r for r in records if r.get("started_at")
                  and call["created_at"] < r["started_at"] < call["started_at"]]
    # at most the one a worker took as the call arrived (was: every aged entry first)
    assert len(overtaking) <= 1, (len(overtaking), call)
    assert sum(1 for r in records if r["status"] in ("PENDING", "CANCELLED")) >= 10


def test_interactive_needs_a_key_allowed_it(env: dict[str, Any]) -> None:
    client = env["client"]
    asked = task_id(submit(env, "batchy", priority="interactive"))
    allowed = task_id(submit(env, "live", priority="interactive"))
    default = task_id(submit(env, "live"))  # a Sage submit defaults to batch
    try:
        assert client.hget(keys.task(asked), "lane") == b"batch"
        assert client.hget(keys.task(allowed), "lane") == b"interactive"
        assert client.hget(keys.task(default), "lane") == b"batch"
    finally:
        cancel(env, "batchy", asked)
        cancel(env, "live", allowed)
        cancel(env, "live", default)


def test_a_key_has_at_most_its_tasks_in_flight(env: dict[str, Any]) -> None:
    queued = [task_id(submit(env, "capped")) for _ in range(3)]
    refused = submit(env, "capped")
    assert refused.status_code == 429, refused.text
    assert refused.json()["status"] == "FAILED" and "queued or running" in refused.json()["error"]
    assert int(refused.headers["retry-after"]) >= 1
    assert task_id(submit(env, "live"))  # another key is not held up
    cancel(env, "capped", queued[0])
    queued.append(task_id(submit(env, "capped")))  # a finished task frees its place
    for tid in queued[1:]:
        cancel(env, "capped", tid)
    assert env["client"].get(keys.in_flight(digest(KEYS["capped"])[:16])) is None


def test_an_understated_container_is_charged_and_counted_near_its_length(
        env: dict[str, Any]) -> None:
    lying = lying_matroska(silence_opus(55), 1, 0.104)
    assert decoded_seconds(lying) > 54
    client = env["client"]
    before = float(client.hget(keys.backlog("faster-whisper"), "batch:seconds") or 0)

    def send() -> httpx.Response:
        return http.post(f"{env['gateway']}/api/faster-whisper-submit", headers=auth("small"),
                          files={"file": ("lie.mka", lying)}, timeout=30)

    first = task_id(send())
    try:
        record = client.hgetall(keys.task(first))
        assert float(record[b"audio_seconds"]) == pytest.approx(55, abs=1.5)
        after = float(client.hget(keys.backlog("faster-whisper"), "batch:seconds"))
        assert after - before == pytest.approx(55, abs=1.5)
        second = send()  # 2 x 55 s is past the 60 s a day: refused at submit, not settled
        assert second.status_code == 429 and "quota" in second.text, second.text
    finally:
        cancel(env, "small", first)


def test_a_keys_flood_waits_in_its_own_line_not_ahead_of_another_key(tmp_path) -> None:
    """A key's `max_queued` (else SPEECH_QUEUED_PER_KEY): its entries waiting in a lane are at
    most that many; its further tasks wait in its own line and enter the lane one by one as
    its entries are read, so another key's task starts behind a few of the flood, not all of
    it. A task cancelled in the line leaves it; when all is done nothing stays counted."""
    clips = tmp_path / "clips"
    clips.mkdir()
    clip = clips / "short.wav"
    speak_to(clip, "Hello world.")
    server = procs.RedisServer(tmp_path / "redis").start()
    entries = [{"key": "sha256:" + digest(KEYS["batchy"]), "name": "batchy", "max_queued": 2},
               {"key": "sha256:" + digest(KEYS["capped"]), "name": "capped"}]  # 8, the default
    gateway = procs.gateway(server.url, tmp_path, api_keys=entries,
                            allowed_roots=[str(clips)]).start()
    env = {"gateway": gateway.url, "clip": clip}
    worker = None
    try:
        flood = [task_id(submit(env, "batchy")) for _ in range(6)]
        other = task_id(submit(env, "capped"))
        client = server.client()
        # the lane holds two of the flood and the other key's task; four wait in line
        stream = [fields[b"task_id"].decode()
                  for _, fields in client.xrange(keys.queue("faster-whisper"))]
        assert stream == [*flood[:2], other], stream
        polled = {tid: http.get(f"{gateway.url}/api/faster-whisper-status",
                                params={"task_id": tid}, headers=auth(name), timeout=30).json()
                  for tid, name in ((other, "capped"), (flood[5], "batchy"))}
        assert polled[other].get("queue_position") == 3, polled
        assert polled[flood[5]].get("queue_position") == 3 + 3 + 1, polled  # 3 ahead in line
        assert polled[flood[5]]["status"] == "PENDING", polled
        metrics = http.get(f"{gateway.url}/metrics", headers=auth("batchy"), timeout=30).text
        assert 'speech_queue_waiting{backend="faster-whisper"} 7.0' in metrics  # lines too
        cancel(env, "batchy", flood[5])  # leaves the line
        worker = procs.worker(server.url, tmp_path, idle_unload_seconds="-1",
                              allowed_roots=[str(clips)], preload="true",
                              batch_window_ms="0").start()  # one task at a time
        done = {tid: wait_task(gateway.url, tid, headers=auth(name), timeout=120)
                for tid, name in [*((t, "batchy") for t in flood), (other, "capped")]}
    finally:
        if worker is not None:
            worker.stop()
        gateway.stop()
    try:
        assert done[flood[5]]["status"] == "CANCELLED", done[flood[5]]
        ran = sorted((done[tid]["started_at"], tid) for tid in [*flood[:5], other])
        assert all(done[tid]["status"] == "SUCCEEDED" for _, tid in ran), done
        # the other key's task started third: behind the two of the flood in the lane
        # before it, ahead of the three that waited in line (it used to start last)
        assert [tid for _, tid in ran][:3] == [*flood[:2], other], ran
        owner = digest(KEYS["batchy"])[:16]
        assert client.get(keys.lane_share("faster-whisper", "batch", owner)) is None
        # (read by the worker, started, finished: their work went with them)
        assert client.get(keys.lane_share("faster-whisper", "batch", owner) + ":work") is None
        assert client.llen(keys.held("faster-whisper", "batch", owner)) == 0
    finally:
        server.stop()


def test_a_keys_share_of_a_lane_is_bounded_in_work_too(tmp_path) -> None:
    """SPEECH_QUEUED_SECONDS_PER_KEY: a key's entries waiting in a lane hold at most that much
    audio, however few they are (eight four-hour files were "eight entries" to the key whose
    short clip waited behind them all); a task alone enters whatever its length, so a long
    file never waits for nothing; the work counted goes with the entries."""
    clips = tmp_path / "clips"
    clips.mkdir()
    short, long = clips / "short.wav", clips / "long.wav"
    speak_to(short, "Hello world.")
    speak_to(long, " ".join(["The quick brown fox jumps over the lazy dog."] * 3))
    seconds = decoded_seconds(short.read_bytes())
    server = procs.RedisServer(tmp_path / "redis").start()
    entries = [{"key": "sha256:" + digest(KEYS[name]), "name": name}
               for name in ("batchy", "capped")]
    gateway = procs.gateway(server.url, tmp_path, api_keys=entries, allowed_roots=[str(clips)],
                            queued_seconds_per_key=str(2.5 * seconds)).start()
    env = {"gateway": gateway.url, "clip": short}
    owner = digest(KEYS["batchy"])[:16]
    share = keys.lane_share("faster-whisper", "batch", owner)
    client = server.client()
    try:
        flood = [task_id(submit(env, "batchy")) for _ in range(4)]
        other = task_id(submit(env, "capped"))
        stream = [fields[b"task_id"].decode()
                  for _, fields in client.xrange(keys.queue("faster-whisper"))]
        assert stream == [*flood[:2], other], stream  # two clips' worth, then the other key
        assert float(client.get(f"{share}:work")) == pytest.approx(2 * seconds, abs=0.01)
        for tid in flood:
            cancel(env, "batchy", tid)  # the line's come in as the lane's go, then leave too
        assert client.get(share) is None and client.get(f"{share}:work") is None
        alone = task_id(submit({**env, "clip": long}, "batchy"))  # longer than the bound
        assert client.hget(keys.task(alone), "entry_id"), "a task alone enters the lane"
        cancel(env, "batchy", alone)
        assert client.get(f"{share}:work") is None
        # work an older version's scripts left (they uncount entries, not their work) goes
        # with the count: the key's next task is alone, and enters
        client.set(f"{share}:work", 1000)
        after = task_id(submit(env, "batchy"))
        assert client.hget(keys.task(after), "entry_id"), "a leftover sum held the line"
        assert float(client.get(f"{share}:work")) == pytest.approx(seconds, abs=0.01)
        cancel(env, "batchy", after)
    finally:
        gateway.stop()
        server.stop()


def test_a_keys_line_is_counted_once_through_cancel_start_and_deadline(tmp_path) -> None:
    """The store's bookkeeping of a key's share (common/store/shares.py) on a real Redis: a
    waiting entry cancelled or started lets the next of its line in, a task cancelled in the
    line leaves it, one whose deadline passed in line fails as it comes to start, nothing stays
    counted at the end, and a caller with keys off (no owner) is never held."""
    from common.schemas import TaskState
    from common.store import Task, TaskStore
    from common.store.record import QueueFull
    from common.store.worker import WorkerStore
    from tests import inprocess

    server = procs.RedisServer(tmp_path / "redis").start()
    backend, owner = "faster-whisper", "owner-a"
    share, line = keys.lane_share(backend, "batch", owner), keys.held(backend, "batch", owner)

    async def scenario() -> None:
        redis = Redis.from_url(server.url)
        store = TaskStore(redis, 600)

        async def submit(task_id: str, who: str = owner, deadline: float | None = None) -> Task:
            task = Task(id=task_id, backend=backend, model="tiny.en", owner=who,
                        state=TaskState.PENDING, deadline=deadline)
            await store.submit(task, b"\0" * 64, lane_share=1)
            return task

        async def stream() -> list[str]:
            return [fields[b"task_id"].decode()
                    for _, fields in await redis.xrange(keys.queue(backend))]

        async def held() -> list[str]:
            return [name.decode().rpartition(":")[2] for name in await redis.lrange(line, 0, -1)]

        first = await submit("t1")
        assert first.entry_id and first.queue_seq == 1
        second = await submit("t2")
        assert second.entry_id == "" and second.queue_seq == 0  # in line
        await submit("t3")
        await submit("t4", deadline=time.time() + 0.5)
        await submit("t5")
        assert await stream() == ["t1"] and await held() == ["t2", "t3", "t4", "t5"]
        everyone = keys.lines(backend)  # every key's line of the backend, for an autoscaler
        assert await redis.lrange(everyone, 0, -1) == [
            keys.task(f"t{i}").encode() for i in (2, 3, 4, 5)]
        assert await store.positions.of(second) == 2  # t1, then itself
        backlog = keys.backlog(backend)  # the work ahead of another key's task: t1's alone
        assert await redis.hget(backlog, "batch:tasks") == b"1"
        with pytest.raises(QueueFull):  # a backend's most queued counts the lines too
            await store.submit(Task(id="t6", backend=backend, model="tiny.en", owner=owner,
                                    state=TaskState.PENDING), b"\0" * 64,
                               max_queued_tasks=5, lane_share=1)
        anonymous = await submit("a1", who="")  # keys off: no share to keep
        assert anonymous.entry_id and await stream() == ["t1", "a1"]

        assert await store.cancel("t1", backend) == TaskState.CANCELLED  # t2 comes in
        assert await stream() == ["t1", "a1", "t2"] and await held() == ["t3", "t4", "t5"]
        assert await redis.hget(backlog, "batch:tasks") == b"2"  # a1 and t2
        assert await store.cancel("t3", backend) == TaskState.CANCELLED  # leaves the line
        assert await held() == ["t4", "t5"] and int(await redis.get(share)) == 1
        assert await redis.llen(everyone) == 2
        await asyncio.sleep(0.6)  # t4's deadline passes while it waits in line
        assert await store.start("t2", "w1", 1, backend) == 1  # t4 comes in, and fails there
        assert await stream() == ["t1", "a1", "t2", "t4"] and await held() == ["t5"]
        assert await store.start("t4", "w1", 1, backend) == -2  # deadline: t5 comes in
        assert await stream() == ["t1", "a1", "t2", "t4", "t5"] and await held() == []
        running = await store.get("t2")  # finished while t5 waits: t5 stays counted
        assert running is not None
        assert await store.finish(running, TaskState.SUCCEEDED, attempt=1, entry_id="",
                                  result={}, worker="w1")
        assert await redis.get(share) == b"1"
        # a worker's read takes t5 out of the count, and its owner's next (t7) comes in
        # then; t5's start counts nothing again (t7 stays counted)
        assert (await submit("t7")).entry_id == ""
        worker = WorkerStore(redis, inprocess.worker_settings(server.url), "w1")
        await store.ensure_queue(backend)  # the workers' group, from the stream's start
        read = await worker.sweep(10)  # the worker's own read: every entry so far
        # an entry says whether its task is counted (keys off: a1 is not, so no call for it)
        assert [(d.task_id, d.counted) for d in read] == [
            ("t1", True), ("a1", False), ("t2", True), ("t4", True), ("t5", True)]
        await worker.taken([d for d in read if d.task_id == "t5"])
        assert await stream() == ["t1", "a1", "t2", "t4", "t5", "t7"] and await held() == []
        assert await store.start("t5", "w1", 1, backend) == 1
        assert await redis.get(share) == b"1"
        assert await store.cancel("t7", backend) == TaskState.CANCELLED
        assert await redis.get(share) is None and not await redis.exists(line, everyone)
        assert await redis.hget(backlog, "batch:tasks") == b"1"  # a1, never started
        running = await store.get("t5")
        assert running is not None
        assert await store.finish(running, TaskState.SUCCEEDED, attempt=1, entry_id="",
                                  result={}, worker="w1")
        assert await redis.get(share) is None
        records = [await store.get(f"t{i}") for i in (1, 2, 3, 4, 5, 7)]
        assert [r.state for r in records if r] == [
            TaskState.CANCELLED, TaskState.SUCCEEDED, TaskState.CANCELLED, TaskState.FAILED,
            TaskState.SUCCEEDED, TaskState.CANCELLED]
        for record in records:
            assert record is not None
            fields = await redis.hkeys(keys.task(record.id))
            assert not {b"share", b"line", b"share_most", b"held", b"held_queue",
                        b"held_counter", b"held_all"} & set(fields), fields
        await redis.aclose()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_one_key_holds_at_most_its_share_of_a_backends_queued_tasks(tmp_path) -> None:
    """SPEECH_MAX_QUEUED_TASKS is not one key's to fill: its waiting entries and lines, in
    both lanes, count against its share (`queued_share`), and past it only its own submits
    are refused (nothing written); another key's still enter, up to the backend's limit."""
    from common.schemas import TaskState
    from common.settings import Settings
    from common.store import Task, TaskStore
    from common.store.record import QueueFull

    server = procs.RedisServer(tmp_path / "redis").start()
    backend = "faster-whisper"
    settings = Settings(api_keys=[{"key": "sha256:" + digest("k-a"), "name": "a"},
                                  {"key": "sha256:" + digest("k-b"), "name": "b"}],
                        max_queued_tasks={backend: 6})
    a, b = (entry.owner for entry in settings.api_keys)
    assert settings.queued_share(a, backend) == 3 and settings.queued_share("", backend) == 0
    assert settings.queued_share(a, "xtts") == 0  # no limit set: no share of one
    # without a lane share a key's queued tasks are not counted apart: no share applies
    assert settings.model_copy(update={"queued_per_key": 0}).queued_share(a, backend) == 0

    async def scenario() -> None:
        redis = Redis.from_url(server.url)
        store = TaskStore(redis, 600)

        async def submit(task_id: str, owner: str, lane: str = "batch") -> None:
            task = Task(id=task_id, backend=backend, model="tiny.en", owner=owner,
                        state=TaskState.PENDING, lane=lane)
            await store.submit(task, b"\0" * 64, max_queued_tasks=6, lane_share=1,
                               max_queued_own=settings.queued_share(owner, backend))

        await submit("a1", a)  # in the stream
        await submit("a2", a)  # in its line
        await submit("a3", a, lane="interactive")  # the other lane counts as well
        with pytest.raises(QueueFull) as refused:
            await submit("a4", a)
        assert refused.value.own and refused.value.queued == 3
        assert not await redis.exists(keys.task("a4"))
        for index in range(3):  # the rest of the backend's limit is another key's
            await submit(f"b{index}", b)
        with pytest.raises(QueueFull) as full:
            await submit("b3", b)
        assert not full.value.own and full.value.queued == 6
        assert await store.cancel("a1", backend) == TaskState.CANCELLED  # a2 comes in
        assert await store.cancel("b0", backend) == TaskState.CANCELLED
        await submit("a5", a)  # a's share has room again
        await redis.aclose()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()


def test_the_input_one_keys_unfinished_tasks_hold_is_bounded(tmp_path) -> None:
    """SPEECH_QUEUED_INPUT_MIB_PER_KEY: uploads queued by one key count until each task ends
    (a cancel included); past the bound its next upload is a 429 with nothing stored, a task
    alone always passes, a path-based task holds nothing, and another key is not affected."""
    from common.schemas import TaskState
    from common.store import InputsFull, Task, TaskStore

    server = procs.RedisServer(tmp_path / "redis").start()
    backend = "faster-whisper"

    async def scenario() -> None:
        redis = Redis.from_url(server.url)
        store = TaskStore(redis, 600)

        async def submit(task_id: str, size: int, owner: str = "a", most: int = 1000) -> None:
            task = Task(id=task_id, backend=backend, model="tiny.en", owner=owner,
                        state=TaskState.PENDING)
            await store.submit(task, b"\0" * size if size else None, max_input_bytes=most,
                               max_in_flight=0 if most else None)  # counted, as keys on

        held = keys.input_bytes("a")
        await submit("big", 1500)  # alone: past the bound, still taken
        with pytest.raises(InputsFull) as refused:
            await submit("more", 10)
        assert refused.value.held == 1500 and not await redis.exists(keys.task("more"))
        assert not await redis.exists(keys.input_blob("more"))
        await submit("by-path", 0)  # an allowed path: no input of its own
        await submit("other", 900, owner="b")  # another key's own count
        assert await store.cancel("big", backend) == TaskState.CANCELLED
        assert not await redis.exists(held)
        await submit("t1", 600)
        await submit("t2", 400)  # exactly the bound
        with pytest.raises(InputsFull):
            await submit("t3", 1)
        assert int(await redis.get(held)) == 1000
        assert int(await redis.get(keys.input_bytes("b"))) == 900
        for task_id in ("t1", "t2", "by-path"):
            assert await store.cancel(task_id, backend) == TaskState.CANCELLED
        assert not await redis.exists(held)
        assert not {b"input_bytes", b"input_bytes_key"} & set(
            await redis.hkeys(keys.task("t1")))
        await submit("unbounded", 5000, owner="c", most=0)  # keys off: nothing counted
        assert not await redis.exists(keys.input_bytes("c"))
        # bytes left counted with nothing in flight (an older version's close() did not
        # uncount them) start over instead of refusing the key for good
        await redis.set(keys.input_bytes("d"), 10**9)
        await submit("d1", 900, owner="d")
        assert int(await redis.get(keys.input_bytes("d"))) == 900
        await redis.aclose()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()
    # through a gateway: the 429 names it, and nothing is queued
    with keyed_gateway(tmp_path, "Hello world, this clip is longer than ten kilobytes.",
                       queued_input_mib_per_key="0.01") as (server, gateway, upload):
        clip = tmp_path / "clip.wav"
        assert clip.stat().st_size > 0.01 * 2**20
        first = upload()
        assert first.status_code == 200, first.text
        second = upload()
        assert second.status_code == 429, second.text
        assert "would take them past their most (0.01 MiB)" in second.json()["error"]
        assert "retry-after" in second.headers
        openai = http.post(f"{gateway.url}/v1/audio/transcriptions", headers=auth("batchy"),
                           files={"file": ("clip.wav", clip.read_bytes())},
                           data={"model": "whisper-1"}, timeout=30)
        assert openai.status_code == 429, openai.text
        assert openai.json()["error"]["code"] == "too_much_input_queued"
        client = server.client()
        assert client.xlen(keys.queue("faster-whisper")) == 1
        cancel({"gateway": gateway.url}, "batchy", first.json()["task_id"])
        assert upload().status_code == 200


def test_one_key_submits_at_most_its_tasks_a_minute(tmp_path) -> None:
    """SPEECH_SUBMITS_PER_MINUTE_PER_KEY: a loop of submits cancelled at once is refunded,
    and each leaves its record for the retention; past the most a minute the key's submits
    are refused (nothing written) until its minute ends, a repeat of an idempotency key is
    still answered, and another key (or keys off) is not counted."""
    from common.schemas import TaskState
    from common.store import Duplicate, Task, TaskStore, TooManySubmits

    server = procs.RedisServer(tmp_path / "redis").start()
    backend = "faster-whisper"

    async def scenario() -> None:
        redis = Redis.from_url(server.url)
        store = TaskStore(redis, 600)

        async def submit(task_id: str, owner: str = "a", key: str = "", most: int = 3) -> None:
            task = Task(id=task_id, backend=backend, model="tiny.en", owner=owner,
                        state=TaskState.PENDING)
            await store.submit(task, b"\0" * 64, idempotency_key=key, submits_per_minute=most)

        for index in range(3):
            await submit(f"t{index}", key="once" if index == 0 else "")
            assert await store.cancel(f"t{index}", backend) == TaskState.CANCELLED
        with pytest.raises(TooManySubmits) as refused:
            await submit("t3")
        assert 0 < refused.value.retry_after <= 60
        assert not await redis.exists(keys.task("t3"))
        with pytest.raises(Duplicate):  # a repeat names the task it made
            await submit("again", key="once")
        await submit("b0", owner="b")
        for index in range(5):
            await submit(f"open{index}", owner="", most=0)
        await redis.pexpire(keys.submits("a"), 1)  # its minute ends
        await asyncio.sleep(0.05)
        await submit("t4")
        await redis.aclose()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()
    with keyed_gateway(tmp_path, "Hello world.", submits_per_minute_per_key="2") as (
            _, _, upload):
        assert [upload().status_code for _ in range(2)] == [200, 200]
        refused = upload()
        assert refused.status_code == 429 and "this minute" in refused.json()["error"]
        assert 1 <= int(refused.headers["retry-after"]) <= 60


def test_a_changed_share_applies_to_a_line_that_exists(tmp_path) -> None:
    """SPEECH_QUEUED_PER_KEY raised while a key has a line: its next submit lets the line in
    up to the new limit; set to 0 while a line exists: new tasks still go behind it (a key's
    own tasks keep their order), and the line comes in by the limit its entries were
    counted under."""
    from common.schemas import TaskState
    from common.store import Task, TaskStore

    server = procs.RedisServer(tmp_path / "redis").start()
    backend, owner = "faster-whisper", "owner-b"

    async def scenario() -> None:
        redis = Redis.from_url(server.url)
        store = TaskStore(redis, 600)

        async def submit(task_id: str, most: int) -> Task:
            task = Task(id=task_id, backend=backend, model="tiny.en", owner=owner,
                        state=TaskState.PENDING)
            await store.submit(task, b"\0" * 64, lane_share=most)
            return task

        async def stream() -> list[str]:
            return [fields[b"task_id"].decode()
                    for _, fields in await redis.xrange(keys.queue(backend))]

        await submit("b1", 1)
        await submit("b2", 1)  # in line
        raised = await submit("b3", 3)  # behind b2, and both come in: 3 may wait now
        assert raised.entry_id and raised.queue_seq == 3
        assert await stream() == ["b1", "b2", "b3"]
        assert await redis.hget(keys.backlog(backend), "batch:tasks") == b"3"
        await submit("b4", 1)  # in line
        assert (await submit("b5", 0)).entry_id == ""  # no limit, yet behind b4
        # b2 (counted under 3) leaves: one more of 3 may wait, b4 comes in
        assert await store.cancel("b2", backend) == TaskState.CANCELLED
        assert await stream() == ["b1", "b2", "b3", "b4"]
        assert await store.cancel("b3", backend) == TaskState.CANCELLED  # and b5
        assert await stream() == ["b1", "b2", "b3", "b4", "b5"]
        assert not await redis.exists(keys.held(backend, "batch", owner), keys.lines(backend))
        assert (await submit("b6", 0)).entry_id  # no line, no limit: straight in
        await redis.aclose()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()
