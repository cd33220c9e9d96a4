"""A real worker in the test process, for tests that are not about a process's death: the
`Worker` of workers/runtime.py composed as `python -m workers` composes it (engine host,
consumer, WorkerStore, heartbeat, optionally the direct HTTP server), run on an event loop of
its own in a thread until stopped. No interpreter to start and no imports to repeat: a start
costs the model's load. It has no signal handling, and an exit it asks for is recorded in
`exits` (its loops then wind down and the thread ends) instead of ending the process."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import redis

from common import keys
from common.settings import Settings
from common.store.connection import worker_client
from harness.procs import TEST_AUDIO, wait_until
from workers.engines import create_engine
from workers.http import serve_http
from workers.runtime import Worker

BACKEND = "faster-whisper"


def worker_settings(redis_url: str, **overrides: Any) -> Settings:
    """A faster-whisper worker's settings as the tests' subprocesses get them (the bundled
    tiny.en, a 0.5 s heartbeat, the test audio allowed, no idle unload), with `overrides`."""
    values: dict[str, Any] = {
        "redis_url": redis_url, "backend": BACKEND, "consumer": "in-process",
        "models": {BACKEND: {"tiny.en": "bundled"}}, "heartbeat_seconds": 0.5,
        "idle_unload_seconds": -1, "min_uptime_seconds": 0,
        "allowed_roots": [str(TEST_AUDIO)], **overrides}
    return Settings(**values)


class InProcessWorker:
    def __init__(self, settings: Settings, http: bool = False) -> None:
        """`http`: serve the direct HTTP API too (on a free port, at `url` once started)."""
        self.settings = settings
        self.http = http
        self.exits: list[int] = []  # every exit asked for, over every start
        self.worker: Worker | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        assert self.worker is not None
        return self.worker.url

    def start(self, timeout: float = 60) -> InProcessWorker:
        """Start it and wait until it is live: its heartbeat is in Redis (and it serves
        HTTP, with `http`)."""
        assert self._thread is None, "already started"
        built = threading.Event()
        self._error = None
        self._thread = threading.Thread(target=self._main, args=(built,), daemon=True,
                                        name=f"worker-{self.settings.consumer}")
        self._thread.start()
        built.wait(timeout)
        client = redis.Redis.from_url(self.settings.redis_url, socket_timeout=5)
        beat = keys.heartbeat(self.settings.backend, self.settings.consumer_name())
        wait_until(lambda: self._running() and client.exists(beat)
                   and (not self.http or self.url), timeout, "the in-process worker", 0.02)
        client.close()
        return self

    def stop(self, timeout: float = 60) -> None:
        """A graceful stop (the running task is finished), then the thread is joined; raises
        what the worker raised."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        if thread.is_alive() and self._loop is not None and self.worker is not None:
            self._loop.call_soon_threadsafe(self.worker.stop)
        thread.join(timeout)
        assert not thread.is_alive(), "the in-process worker did not stop"
        if self._error is not None:
            raise RuntimeError("the in-process worker failed") from self._error

    def _running(self) -> bool:
        if self._error is not None:
            raise RuntimeError("the in-process worker failed to start") from self._error
        assert self._thread is not None and self._thread.is_alive(), "it ended at once"
        return True

    def _main(self, built: threading.Event) -> None:
        async def run() -> None:
            client = worker_client(self.settings, f"worker-{self.settings.consumer_name()}")
            self._loop = asyncio.get_running_loop()
            self.worker = Worker(self.settings, create_engine(self.settings.backend,
                                                              self.settings),
                                 client, handle_signals=False, exit=self.exits.append)
            built.set()
            try:
                await self.worker.run(serve_http if self.http else None)
            finally:
                await client.aclose()

        try:
            asyncio.run(run())
        except BaseException as exc:  # kept for start() and stop() to raise
            self._error = exc
        finally:
            built.set()
