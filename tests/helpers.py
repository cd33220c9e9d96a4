"""Client-side helpers for tests: submit, poll, count what is queued, score transcripts."""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import redis

from common import keys
from common.words import normalise, wer  # noqa: F401  (the tests' scoring, re-exported)
from harness.http_client import http
from harness.procs import TEST_AUDIO, wait_until

JFK = TEST_AUDIO / "jfk.flac"
JFK_TEXT = ("And so my fellow Americans, ask not what your country can do for you, "
            "ask what you can do for your country.")
TERMINAL = {"SUCCEEDED", "FAILED"}


def submit_file(base: str, path: Path, backend: str = "faster-whisper",
                **params: Any) -> httpx.Response:
    with path.open("rb") as handle:
        return http.post(f"{base}/api/{backend}-submit", files={"file": (path.name, handle)},
                          data={k: str(v) for k, v in params.items()}, timeout=60)


def status(base: str, task_id: str, headers: dict[str, str] | None = None,
           **params: Any) -> dict[str, Any]:
    reply = http.get(f"{base}/api/status", params={"taskid": task_id, **params},
                     headers=headers, timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()


def wait_done(base: str, task_id: str, timeout: float = 120,
              seen: list[str] | None = None,
              headers: dict[str, str] | None = None) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        reply = status(base, task_id, headers)
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
        task = http.get(f"{base}/v1/tasks/{task_id}", headers=headers, timeout=30).json()
        return task if task["status"] not in ("PENDING", "RUNNING") else None
    return wait_until(view, timeout, f"task {task_id}", 0.1)


def wait_sampling_loaded(base: str, worker_health: str, task_id: str,
                         timeout: float = 300) -> tuple[dict[str, Any], list[float]]:
    """A diarized task's final status, and the worker's RSS (MiB) sampled while the task ran
    with its model and diarizer both loaded (once the task is done the idle unload may come
    before any look, on a busy machine)."""
    samples: list[float] = []

    def done_with_both_seen() -> dict[str, Any] | None:
        # (a load that imports torch can hold the worker's event loop for seconds)
        health = http.get(worker_health, timeout=60).json()
        if health["diarizer_loaded"] and health["loaded_models"]:
            samples.append(health["memory"]["rss_mib"])
        state = status(base, task_id)
        return state if state["status"] in TERMINAL and samples else None

    return wait_until(done_with_both_seen, timeout, f"task {task_id}", 0.05), samples


def settled_idle(worker_health: str, reexec_ratio: float, timeout: float = 60) -> dict[str, Any]:
    """The worker's /health once its idle unload has settled: nothing loaded, and RSS within
    `reexec_ratio` of its fresh image's (the unload's own trim got it there, or the re-exec
    the unload asked for did: SPEECH_REEXEC_RSS_RATIO). During a re-exec the request waits in
    the kept socket's backlog."""
    def settled() -> dict[str, Any] | None:
        health = http.get(worker_health, timeout=60).json()
        if health["loaded_models"] or health["diarizer_loaded"]:
            return None
        # (+5 MiB: RSS moves a little between the worker's own look and this one)
        within = health["memory"]["rss_mib"] <= reexec_ratio * health["fresh_rss_mib"] + 5
        return health if within else None
    return wait_until(settled, timeout, "the idle unload, back to the fresh RSS", 0.2)


def queue_counts(client: redis.Redis, backend: str = "faster-whisper") -> tuple[int, int]:
    """(stream length, number of task records): unchanged by any refused submit."""
    stream_length = sum(client.xlen(keys.queue(backend, lane)) for lane in keys.LANES
                        if client.exists(keys.queue(backend, lane)))
    return stream_length, sum(1 for _ in client.scan_iter(match=keys.task_pattern(), count=500))


def pending_count(client: redis.Redis, backend: str = "faster-whisper") -> int:
    return sum(int(client.xpending(keys.queue(backend, lane), keys.WORKER_GROUP)["pending"])
               for lane in keys.LANES if client.exists(keys.queue(backend, lane)))


def openmp_policies(worker_log: Path) -> set[str]:
    """The OpenMP wait policies a worker's JSON log says it started with (workers/openmp.py),
    one per start (a respawn, a re-exec)."""
    prefix = "OpenMP wait policy: "
    return {json.loads(line)["msg"].removeprefix(prefix)
            for line in worker_log.read_text().splitlines() if prefix in line}


#: TCP_INFO's state of an open connection (linux/tcp.h)
TCP_ESTABLISHED = 1


def tcp_state(sock: socket.socket) -> int:
    """The kernel's TCP state of `sock` (TCP_ESTABLISHED while the peer holds it open; a
    peer's abort makes it TCP_CLOSE, 7), without reading from it."""
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
