"""Load failures per model, breakers that heal (issue 12, items 2 and 3). Real processes: a
real supervisord, redis-server (the module's, emptied for each test), gateway and
faster-whisper worker with the real tiny.en; where no worker exits, the worker runs
in-process (tests/inprocess.py)."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from pathlib import Path
from typing import Any

from redis.asyncio import Redis

from common import keys
from common.store import BreakerPolicy, TaskStore
from common.store.breakers import BreakerStore
from gateway.auth import digest
from harness import procs
from harness.http_client import http
from harness.procs import wait_until
from tests.helpers import JFK, submit_file, wait_done
from tests.inprocess import InProcessWorker, worker_settings
from workers.engines.faster_whisper import bundled_model_dir

BACKEND = "faster-whisper"
PROGRAM = "faster-whisper:faster-whisper_00"
COOLDOWN = 2.0


def task_view(url: str, task_id: str, **headers: str) -> dict[str, Any]:
    return http.get(f"{url}/v1/tasks/{task_id}", headers=headers, timeout=10).json()


def breakers(url: str) -> dict[str, Any]:
    return http.get(f"{url}/ready", timeout=10).json()["backends"][BACKEND]["breakers"]


def corrupt_model(directory: Path) -> Path:
    """The tiny.en files with random bytes for weights: passes every pre-check, and fails
    inside CTranslate2's load."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "vocabulary.txt"):
        shutil.copy(bundled_model_dir() / name, directory / name)
    (directory / "model.bin").write_bytes(os.urandom(4096))
    return directory


def test_broken_models_fail_their_own_tasks_and_never_take_the_worker_down(
        redis: procs.RedisServer, tmp_path: Path) -> None:
    """Two missing directories and a corrupt model next to tiny.en on one worker under
    supervisord, a task to each, twice."""
    port = procs.free_port()
    url = f"http://127.0.0.1:{port}"
    models = {"tiny.en": "bundled", "gone": str(tmp_path / "no-such-dir"),
              "gone-relative": "models/no/such/dir", "corrupt": str(corrupt_model(tmp_path / "c"))}
    env = procs.stack_env(
        SPEECH_RUN_DIR=str(tmp_path), SPEECH_PORT=str(port), SPEECH_LOCAL_REDIS="false",
        SPEECH_REDIS_URL=redis.url, SPEECH_HEARTBEAT_SECONDS="0.5",
        # one load per task, as counted below: batching would let the two corrupt tasks
        # share one load (and one exit; tests/test_batching.py covers that)
        SPEECH_MODELS={BACKEND: models}, SPEECH_BATCH_WINDOW_MS="0")
    supervisor = procs.Supervisor(tmp_path, env).start()
    try:
        wait_until(lambda: supervisor.state(PROGRAM) == "RUNNING", 60, "worker up", 0.2)
        started = time.monotonic()
        rounds = [{model: submit_file(url, JFK, model=model).json()["taskid"] for model in models}
                  for _ in range(2)]
        finals = [{model: wait_done(url, task_id, timeout=120) for model, task_id in tasks.items()}
                  for tasks in rounds]
        elapsed = time.monotonic() - started
        for final in finals:
            assert final["tiny.en"]["status"] == "SUCCEEDED", final["tiny.en"]
            for model in ("gone", "gone-relative"):
                assert final[model]["status"] == "FAILED"
                assert "does not exist" in final[model]["error"], final[model]
                assert "HFValidationError" not in final[model]["error"]
            assert final["corrupt"]["status"] == "FAILED"
            assert "failed to load" in final["corrupt"]["error"]
        for tasks in rounds:
            for model, task_id in tasks.items():
                view = task_view(url, task_id)
                assert view["attempts"] == 1, view  # a load failure is never redelivered
                if model != "tiny.en":
                    assert view["error_code"] == "model_load_failed", view
                    assert view["finished_at"] - view["started_at"] < 5, view  # at once
        assert f"directory {tmp_path / 'no-such-dir'} does not exist" in finals[0]["gone"]["error"]
        assert elapsed < 90, elapsed
        # each corrupt load exited the worker (after the task was stored FAILED, and once
        # the worker had lived its minimum uptime): two restarts, never a failed start
        log_path = tmp_path / "logs" / "supervisord.log"
        wait_until(lambda: log_path.read_text().count("exit status 1") == 2, 30, "2nd exit")
        wait_until(lambda: supervisor.state(PROGRAM) == "RUNNING", 30, "RUNNING", 0.2)
        time.sleep(1)
        log = log_path.read_text()
        assert log.count("exit status 1") == 2, log
        assert "FATAL" not in log and "gave up" not in log and "too quickly" not in log, log
        state = breakers(url)
        assert state["gone"]["failures"] == 2 and state["corrupt"]["failures"] == 2, state
        assert state["tiny.en"] == {"state": "closed", "failures": 0, "error": None,
                                    "reopens_at": None, "trips": 0}
        ok = submit_file(url, JFK).json()["taskid"]
        assert wait_done(url, ok)["status"] == "SUCCEEDED"
    finally:
        supervisor.stop()


def test_a_repaired_model_heals_by_itself(tmp_path: Path, redis: procs.RedisServer) -> None:
    fixable = tmp_path / "fixable"
    fixable.mkdir()  # empty: fails the pre-check, so the worker never exits
    models = {BACKEND: {"tiny.en": "bundled", "fixable": str(fixable)}}
    settings = {"models": models, "breaker_cooldown_seconds": str(COOLDOWN)}
    gateway = procs.gateway(redis.url, tmp_path, **settings).start()
    worker = InProcessWorker(worker_settings(redis.url, **settings)).start()
    try:
        # three failures open the breaker
        first = ""
        for attempt in range(3):
            task_id = submit_file(gateway.url, JFK, model="fixable",
                                  idempotency_key=f"try-{attempt}").json()["taskid"]
            first = first or task_id
            final = wait_done(gateway.url, task_id)
            assert final["status"] == "FAILED" and "model.bin" in final["error"], final
        opened = breakers(gateway.url)["fixable"]
        assert opened["state"] == "open" and opened["trips"] == 1, opened
        refused = submit_file(gateway.url, JFK, model="fixable")
        assert refused.status_code == 503 and "unavailable" in refused.json()["error"]
        # a retried submit (its reply lost) still gets its own task, not the breaker's 503
        again = submit_file(gateway.url, JFK, model="fixable", idempotency_key="try-0")
        assert again.status_code == 200 and again.json()["taskid"] == first, again.text
        # a task already queued fails fast: no load attempt, no exit
        queued = asyncio.run(_submit_directly(redis.url, "fixable"))
        final = wait_done(gateway.url, queued)
        assert final["status"] == "FAILED" and "unavailable" in final["error"]
        assert task_view(gateway.url, queued)["error_code"] == "model_unavailable"
        # after the cool-down one task goes through as the probe; still broken: open again,
        # with the cool-down doubled
        wait_until(lambda: breakers(gateway.url)["fixable"]["state"] == "half-open",
                   COOLDOWN + 5, "half-open", 0.1)
        probed = time.time()
        probe = submit_file(gateway.url, JFK, model="fixable").json()["taskid"]
        assert wait_done(gateway.url, probe)["status"] == "FAILED"
        reopened = breakers(gateway.url)["fixable"]
        assert reopened["state"] == "open" and reopened["trips"] == 2, reopened
        # reopens 2 x COOLDOWN after the probe failed, which was between `probed` and now
        # (bounds that hold however slowly the machine runs the probe)
        assert probed + 2 * COOLDOWN <= reopened["reopens_at"] <= time.time() + 2 * COOLDOWN
        # repaired: with no manual step, a task succeeds within the cool-down plus one task
        for name in ("config.json", "tokenizer.json", "vocabulary.txt", "model.bin"):
            shutil.copy(bundled_model_dir() / name, fixable / name)
        repaired = time.monotonic()
        while (reply := submit_file(gateway.url, JFK, model="fixable")).status_code == 503:
            assert time.monotonic() - repaired < 2 * COOLDOWN + 5
            time.sleep(0.1)
        final = wait_done(gateway.url, reply.json()["taskid"])
        assert final["status"] == "SUCCEEDED", final
        assert time.monotonic() - repaired < 2 * COOLDOWN + 15
        assert breakers(gateway.url)["fixable"]["state"] == "closed"
        assert worker.exits == []  # it never asked to exit
    finally:
        worker.stop()
        gateway.stop()


def test_a_changed_source_resets_the_breaker(tmp_path: Path, redis: procs.RedisServer) -> None:
    asyncio.run(_trip(redis.url, "tiny.en", source="/models/old-tiny-en"))
    models = {BACKEND: {"tiny.en": "bundled"}}
    old = procs.gateway(redis.url, tmp_path,
                        models={BACKEND: {"tiny.en": "/models/old-tiny-en"}}).start()
    new = procs.gateway(redis.url, tmp_path, models=models).start()
    worker = InProcessWorker(worker_settings(redis.url, models=models)).start()
    try:
        assert submit_file(old.url, JFK).status_code == 503  # the source it broke with
        assert breakers(new.url)["tiny.en"]["state"] == "closed"
        final = wait_done(new.url, submit_file(new.url, JFK).json()["taskid"])
        assert final["status"] == "SUCCEEDED", final
        assert not redis.client().exists(keys.breaker(BACKEND, "tiny.en"))
        assert submit_file(old.url, JFK).status_code == 200
    finally:
        worker.stop()
        new.stop()
        old.stop()


def test_the_reset_call_closes_a_breaker_and_needs_an_admin_key(
        tmp_path: Path, redis: procs.RedisServer) -> None:
    key, tenant = "breaker-test-key-0123456789", "breaker-test-tenant-key-42"
    gateway = procs.gateway(redis.url, tmp_path, api_keys=[
        {"key": f"sha256:{digest(key)}", "name": "ops", "admin": True},
        f"sha256:{digest(tenant)}"]).start()
    auth = {"authorization": f"Bearer {key}"}
    reset = f"{gateway.url}/v1/breakers/{BACKEND}/tiny.en"
    try:
        asyncio.run(_trip(redis.url, "tiny.en", source="bundled"))
        assert breakers(gateway.url)["tiny.en"]["state"] == "open"
        assert http.delete(reset, timeout=10).status_code == 401
        assert http.delete(reset, headers={"authorization": "Bearer wrong"},
                            timeout=10).status_code == 401
        not_admin = http.delete(reset, headers={"authorization": f"Bearer {tenant}"},
                                timeout=10)  # a tenant's key is not an operator's
        assert not_admin.status_code == 403, not_admin.text
        assert not_admin.json()["error"]["code"] == "admin_key_required"
        assert breakers(gateway.url)["tiny.en"]["state"] == "open"
        assert redis.client().exists(keys.breaker(BACKEND, "tiny.en"))
        reply = http.delete(reset, headers=auth, timeout=10)
        assert reply.status_code == 200, reply.text
        assert reply.json()["previous"]["state"] == "open"
        assert reply.json()["state"] == "closed"
        assert breakers(gateway.url)["tiny.en"]["state"] == "closed"
        assert not redis.client().exists(keys.breaker(BACKEND, "tiny.en"))
        missing = http.delete(f"{gateway.url}/v1/breakers/{BACKEND}/nope", headers=auth,
                               timeout=10)
        assert missing.status_code == 404
    finally:
        gateway.stop()


async def _trip(redis_url: str, model: str, source: str) -> None:
    client = Redis.from_url(redis_url)
    store = BreakerStore(client)
    for _ in range(3):
        await store.record_load_failure(BACKEND, model, source, f"model {model!r} failed to "
                                        "load: RuntimeError: broken", BreakerPolicy())
    await client.aclose()


async def _submit_directly(redis_url: str, model: str) -> str:
    """A task queued past the gateway's breaker check (it was queued before the breaker
    opened, or by another gateway)."""
    from common.schemas import TaskState
    from common.store import Task, new_task_id

    client = Redis.from_url(redis_url)
    store = TaskStore(client, 60)
    task = Task(id=new_task_id(), backend=BACKEND, model=model, state=TaskState.PENDING,
                input_path=str(JFK), audio_seconds=11.0)
    await store.submit(task, None)
    await client.aclose()
    return task.id

