"""Client-side helpers for tests: submit, poll, count what is queued, score transcripts."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import redis

from common import keys
from common.words import normalise, wer  # noqa: F401  (the tests' scoring, re-exported)
from harness.procs import TEST_AUDIO, wait_until

JFK = TEST_AUDIO / "jfk.flac"
JFK_TEXT = ("And so my fellow Americans, ask not what your country can do for you, "
            "ask what you can do for your country.")
TERMINAL = {"SUCCEEDED", "FAILED"}


def submit_file(base: str, path: Path, backend: str = "faster-whisper",
                **params: Any) -> httpx.Response:
    with path.open("rb") as handle:
        return httpx.post(f"{base}/api/{backend}-submit", files={"file": (path.name, handle)},
                          data={k: str(v) for k, v in params.items()}, timeout=60)


def status(base: str, task_id: str, **params: Any) -> dict[str, Any]:
    reply = httpx.get(f"{base}/api/status", params={"taskid": task_id, **params}, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()


def wait_done(base: str, task_id: str, timeout: float = 120,
              seen: list[str] | None = None) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = status(base, task_id)
        if seen is not None and (not seen or seen[-1] != reply["status"]):
            seen.append(reply["status"])
        if reply["status"] in TERMINAL:
            return reply
        assert "result" not in reply, reply
        time.sleep(0.05)
    raise TimeoutError(f"task {task_id} not finished after {timeout} s")


def wait_task(base: str, task_id: str, headers: dict[str, str] | None = None,
              timeout: float = 120) -> dict[str, Any]:
    """The task's REST view (`/v1/tasks/{id}`) once it is terminal."""
    def view() -> dict[str, Any] | None:
        task = httpx.get(f"{base}/v1/tasks/{task_id}", headers=headers, timeout=30).json()
        return task if task["status"] not in ("PENDING", "RUNNING") else None
    return wait_until(view, timeout, f"task {task_id}", 0.1)


def queue_counts(client: redis.Redis, backend: str = "faster-whisper") -> tuple[int, int]:
    """(stream length, number of task records): unchanged by any refused submit."""
    stream_length = sum(client.xlen(keys.queue(backend, lane)) for lane in keys.LANES
                        if client.exists(keys.queue(backend, lane)))
    return stream_length, sum(1 for _ in client.scan_iter(match=keys.task_pattern(), count=500))


def pending_count(client: redis.Redis, backend: str = "faster-whisper") -> int:
    return sum(int(client.xpending(keys.queue(backend, lane), keys.WORKER_GROUP)["pending"])
               for lane in keys.LANES if client.exists(keys.queue(backend, lane)))
