"""Worker lifecycle and delivery guarantees under a real supervisord (issue 3).

Every fault here is real: SIGKILL and SIGTERM by pid, a model whose files are broken,
Redis stopped and restarted with AOF on. Each test counts what ends where.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from common import keys
from harness import procs
from harness.http_client import http
from harness.procs import TEST_AUDIO, wait_until
from tests.helpers import (
    JFK,
    TERMINAL,
    openmp_policies,
    pending_count,
    status,
    submit_file,
    wait_done,
)

PROGRAM = "faster-whisper:faster-whisper_00"
LONG = TEST_AUDIO / "multilingual.mp3"  # ~5 s of work with tiny.en on 2 cores


class Stack:
    def __init__(self, workdir: Path, redis: procs.RedisServer, replicas: int = 1) -> None:
        from workers.engines.faster_whisper import bundled_model_dir

        bundled = bundled_model_dir()
        broken = workdir / "broken-model"
        broken.mkdir(exist_ok=True)
        for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
            shutil.copy(bundled / name, broken / name)
        (broken / "model.bin").write_bytes(os.urandom(4096))
        self.port = procs.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.redis = redis
        env = procs.stack_env(
            SPEECH_RUN_DIR=str(workdir), SPEECH_PORT=str(self.port), SPEECH_LOCAL_REDIS="false",
            SPEECH_REDIS_URL=redis.url, SPEECH_HEARTBEAT_SECONDS="0.5",
            SPEECH_VISIBILITY_TIMEOUT_SECONDS="15", SPEECH_STOP_GRACE_SECONDS="20",
            SPEECH_ALLOWED_ROOTS=[str(TEST_AUDIO)], FW_IDLE_UNLOAD_SECONDS="2",
            FW_REPLICAS=str(replicas),
            SPEECH_MODELS={"faster-whisper": {"tiny.en": "bundled", "tiny-copy": str(bundled),
                                              "broken": str(broken)}})
        self.supervisor = procs.Supervisor(workdir, env)

    def start(self) -> Stack:
        self.supervisor.start()
        try:
            wait_until(lambda: len(self.live()) == self.replicas(), 60, "workers live", 0.2)
        except BaseException:
            self.supervisor.stop()  # a stack that failed to come up still goes away
            raise
        return self

    def replicas(self) -> int:
        return int(self.supervisor.env["FW_REPLICAS"])

    def live(self) -> list[dict]:
        try:
            reply = http.get(f"{self.url}/ready", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return []
        return reply.get("backends", {}).get("faster-whisper", {}).get("live", [])

    def worker_pid(self, program: str = PROGRAM) -> int:
        return self.supervisor.pid(program)

    def worker_health(self) -> dict:
        (worker,) = self.live()
        return http.get(f"{worker['url']}/health", timeout=5).json()

    def task(self, task_id: str) -> dict:
        return http.get(f"{self.url}/v1/tasks/{task_id}", timeout=10).json()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    workdir = tmp_path_factory.mktemp("lifecycle")
    redis = procs.RedisServer(workdir / "redis").start()
    stack = Stack(workdir, redis).start()
    yield stack
    stack.supervisor.stop()
    redis.stop()


def wait_running(stack: Stack, task_id: str, attempt: int = 1) -> dict:
    """Wait until attempt number `attempt` of the task runs (a dead attempt stays RUNNING)."""
    return wait_until(lambda: ((t := stack.task(task_id))["status"] == "RUNNING"
                               and t["attempts"] == attempt and t), 60, "task RUNNING", 0.02)


def respawned(stack: Stack, old_pid: int) -> int:
    return wait_until(lambda: (p := stack.worker_pid()) not in (0, old_pid) and p, 60,
                      "supervisord respawn", 0.1)


def test_a_worker_alone_on_its_host_keeps_openmps_own_wait_policy(stack: Stack) -> None:
    """scripts/run_stack.sh counts the stack's one worker (SPEECH_HOST_WORKERS=1), so its
    engine threads spin as the library's default does; several on one host are PASSIVE
    (test_full_stack)."""
    chosen = openmp_policies(stack.supervisor.workdir / "logs" / "faster-whisper_00.log")
    assert chosen == {"library"}, chosen


def test_sigkill_mid_task_is_redelivered_and_succeeds_once(stack: Stack) -> None:
    pid = stack.worker_pid()  # first: supervisorctl's start-up could outlast the task
    task_id = submit_file(stack.url, LONG).json()["taskid"]
    wait_running(stack, task_id)
    os.kill(pid, signal.SIGKILL)
    respawned(stack, pid)
    final = wait_done(stack.url, task_id, timeout=120)
    assert final["status"] == "SUCCEEDED"
    view = stack.task(task_id)
    assert view["deliveries"] == 2 and view["attempts"] == 2
    assert pending_count(stack.redis.client()) == 0


def test_sigterm_mid_task_finishes_it_exactly_once(stack: Stack) -> None:
    task_id = submit_file(stack.url, LONG).json()["taskid"]
    wait_running(stack, task_id)
    pid = stack.worker_pid()
    os.kill(pid, signal.SIGTERM)
    final = wait_done(stack.url, task_id, timeout=120)
    assert final["status"] == "SUCCEEDED"
    assert stack.task(task_id)["attempts"] == 1  # finished within the grace period
    respawned(stack, pid)
    assert pending_count(stack.redis.client()) == 0


def test_idle_unload_returns_memory_and_reloads(stack: Stack) -> None:
    wait_done(stack.url, submit_file(stack.url, JFK).json()["taskid"])
    loaded = stack.worker_health()
    # (it may already have unloaded again: the model's last use is what proves it ran)
    assert loaded["last_used"] is not None and loaded["tasks_done"] >= 1, loaded
    unloaded = wait_until(lambda: (h := stack.worker_health())["loaded_models"] == [] and h,
                          20, "idle unload", 0.2)
    assert unloaded["state"] == "idle"
    # load again; the loaded RSS is the highest seen from the submit until the unload (right
    # after the load it is lower than after the first inference), read from /proc, so a
    # loaded machine's slow HTTP round trips cannot miss the model's resident window; then
    # the RSS after the unload
    worker = psutil.Process(stack.worker_pid())
    task_id = submit_file(stack.url, JFK).json()["taskid"]
    samples: list[float] = []

    def sampled(check: Callable[[], Any]) -> Any:
        samples.append(worker.memory_info().rss / 2**20)
        return check()

    wait_until(lambda: sampled(lambda: status(stack.url, task_id)["status"] in TERMINAL), 60,
               "the reloaded task", 0.02)
    unloaded = wait_until(lambda: sampled(lambda: (h := stack.worker_health())["loaded_models"]
                                          == [] and h), 20, "idle unload", 0.05)
    assert unloaded["memory"]["rss_mib"] < max(samples) - 20, (max(samples), unloaded["memory"])


def test_model_switch_keeps_one_resident(stack: Stack) -> None:
    first = submit_file(stack.url, JFK, model="tiny-copy").json()["taskid"]
    wait_until(lambda: stack.worker_health()["loaded_models"] == ["tiny-copy"], 30, "load", 0.05)
    wait_done(stack.url, first)
    second = submit_file(stack.url, JFK, model="tiny.en").json()["taskid"]
    wait_until(lambda: stack.worker_health()["loaded_models"] == ["tiny.en"], 30, "switch", 0.05)
    assert wait_done(stack.url, second)["status"] == "SUCCEEDED"


def test_poison_task_is_dead_lettered_and_the_queue_moves_on(stack: Stack,
                                                            speech_clip: Path) -> None:
    poison = submit_file(stack.url, LONG).json()["taskid"]
    behind = [submit_file(stack.url, speech_clip).json()["taskid"] for _ in range(3)]
    pid = stack.worker_pid()  # read before it runs: supervisorctl's start-up can outlast a run
    for attempt in (1, 2, 3):  # kill the worker every time it runs the poison task
        wait_running(stack, poison, attempt)
        os.kill(pid, signal.SIGKILL)
        pid = respawned(stack, pid)
    final = wait_done(stack.url, poison, timeout=120)
    assert final["status"] == "FAILED" and "deliveries" in final["error"]
    dead = stack.redis.client().xrange(keys.dead_letter("faster-whisper"))
    assert [e[1][b"task_id"].decode() for e in dead] == [poison]
    assert all(wait_done(stack.url, t, timeout=120)["status"] == "SUCCEEDED" for t in behind)
    assert pending_count(stack.redis.client()) == 0


def test_broken_model_exits_worker_trips_breaker_and_default_still_serves(
        stack: Stack) -> None:
    # each task loads the broken files: it FAILS at once (never redelivered to crash the next
    # worker), then the worker exits 1, past supervisord's startsecs, and is respawned
    for _ in range(3):
        pid = stack.worker_pid()
        task_id = submit_file(stack.url, JFK, model="broken").json()["taskid"]
        final = wait_done(stack.url, task_id, timeout=60)
        assert final["status"] == "FAILED" and "failed to load" in final["error"], final
        assert stack.task(task_id)["attempts"] == 1
        respawned(stack, pid)
    log = (Path(stack.supervisor.workdir) / "logs" / "supervisord.log").read_text()
    assert log.count("exit status 1") >= 3 and "FATAL" not in log
    # the respawned worker serves the default model on its direct endpoint
    worker = wait_until(lambda: [w for w in stack.live() if w["pid"] == stack.worker_pid()],
                        30, "a live worker")[0]
    with JFK.open("rb") as handle:
        reply = http.post(f"{worker['url']}/transcribe", files={"file": handle}, timeout=60)
    assert reply.status_code == 200 and "country" in reply.json()["text"]
    # the breaker is open: new submits for the broken model are refused up front
    refused = submit_file(stack.url, JFK, model="broken")
    assert refused.status_code == 503 and "unavailable" in refused.json()["error"]
    breakers = http.get(f"{worker['url']}/health", timeout=5).json()["breakers"]
    assert list(breakers) == ["broken"] and "failed to load" in breakers["broken"]
    ok = submit_file(stack.url, JFK).json()["taskid"]
    assert wait_done(stack.url, ok)["status"] == "SUCCEEDED"
    assert pending_count(stack.redis.client()) == 0


def test_redis_restart_mid_run_loses_no_task(stack: Stack, speech_clip: Path) -> None:
    task_ids = [submit_file(stack.url, speech_clip).json()["taskid"] for _ in range(8)]
    time.sleep(1.5)  # some done, one running, the rest queued; AOF fsyncs every second
    stack.redis.restart(down_seconds=1.0)
    finals = [wait_done(stack.url, t, timeout=180) for t in task_ids]
    assert [f["status"] for f in finals] == ["SUCCEEDED"] * 8
    assert pending_count(stack.redis.client()) == 0


def test_two_gateways_and_two_replicas_share_forty_tasks_each_once(
        tmp_path_factory: pytest.TempPathFactory, speech_clip: Path) -> None:
    workdir = tmp_path_factory.mktemp("replicas")
    redis = procs.RedisServer(workdir / "redis").start()
    stack = Stack(workdir, redis, replicas=2).start()
    second = procs.gateway(redis.url, workdir).start()  # a second, stateless gateway
    try:
        gateways = [stack.url, second.url]
        task_ids = [submit_file(gateways[i % 2], speech_clip).json()["taskid"] for i in range(40)]
        finals = [wait_done(gateways[(i + 1) % 2], t, timeout=300) for i, t in enumerate(task_ids)]
        assert all(f["status"] == "SUCCEEDED" for f in finals)
        views = [stack.task(t) for t in task_ids]
        assert all(v["attempts"] == 1 for v in views)
        live = stack.live()
        assert {v["worker"] for v in views} == {w["consumer"] for w in live}  # both worked
        assert sum(http.get(f"{w['url']}/health").json()["tasks_done"] for w in live) == 40
        assert pending_count(redis.client()) == 0
    finally:
        second.stop()
        stack.supervisor.stop()
        redis.stop()
