"""The worker runtime: every lifecycle rule, written once, for every engine.

A worker is three parts, composed here: the engine host (`workers/engine_host.py`: one
resident model, the engine thread, the memory cap, idle unload), the task consumer
(`workers/consumer.py`: claim an entry, open an attempt, run the engine off the event loop,
store the terminal state fenced by attempt, ack; with lease extension, a janitor for
abandoned entries, and the breakers of `workers/breakers.py`), and the worker's side of
Redis (`common.store.WorkerStore`). Here: heartbeat, the health snapshot, a graceful stop,
and leaving through the exit policy it is handed. The process edge (`workers/__main__.py`)
hands it a real exit and signal handling; a test hands it neither, and may run it in burst
mode, draining the queue in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from common.settings import Settings
from common.store import WorkerStore
from workers import device_budget, memory
from workers.breakers import ModelBreakers
from workers.consumer import Consumer
from workers.engine_host import EngineHost
from workers.engines.base import Engine

log = logging.getLogger("worker")

#: the direct HTTP server (workers.http.serve_http): the host it serves, the /health
#: snapshot to answer with, and where to say the URL it bound
HttpServer = Callable[[EngineHost, Callable[[], Awaitable[dict[str, Any]]],
                       Callable[[str], None]], Awaitable[None]]


class Worker:
    def __init__(self, settings: Settings, engine: Engine, redis: Redis, *,
                 handle_signals: bool, exit: Callable[[int], None], burst: bool = False) -> None:
        """`exit(code)` ends the process (a test's may only record it); `handle_signals`:
        SIGTERM and SIGINT stop the worker gracefully; `burst`: return once the queue is
        drained."""
        self.settings = settings
        self.backend = settings.backend
        self.handle_signals = handle_signals
        self.exit = exit
        self.burst = burst
        self.exit_code: int | None = None  # the exit asked for, once
        self.started_at = time.time()
        self.url = ""
        self.store = WorkerStore(redis, settings, settings.consumer_name())
        self.host = EngineHost(settings, engine)
        self.host.holding.budget = device_budget.for_worker(
            settings, self.store, self.host.device,
            memory.device_total_mib(self.host.device, engine.uses_torch))
        self.breakers = ModelBreakers(self.store, self.host.sources,
                                      self._exit_after_load_failure)
        # Loads no task asked for (a direct HTTP call's) count against breakers too.
        self.host.on_load = functools.partial(self.breakers.load_reported, None)
        self.consumer = Consumer(settings, self.store, self.host, self.breakers, burst=burst)

    def stop(self) -> None:
        """Take no new task, finish the running one, then leave."""
        self.consumer.stop()

    async def run(self, serve_http: HttpServer | None = None) -> None:
        if self.handle_signals:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self.stop)
        await self.host.start()
        background = []
        if serve_http is not None:
            background.append(asyncio.create_task(serve_http(self.host, self.report,
                                                             self._bound)))
            await asyncio.sleep(0)  # let it bind, so the first heartbeat carries its URL
        background.append(asyncio.create_task(self._heartbeat_loop()))
        if self.settings.idle_unload_seconds > 0:
            background.append(asyncio.create_task(self.host.unload_when_idle()))
        if self.host.holding.budget.enabled:
            background.append(asyncio.create_task(self.host.keep_reservation()))
        with contextlib.suppress(RedisError):
            await self.store.record(("worker_starts",))
        if self.settings.preload:
            await self._preload_default()
        consumer = asyncio.create_task(self.consumer.run())
        stop_requested = asyncio.create_task(self.consumer.stopping.wait())
        await asyncio.wait({consumer, stop_requested, *background},
                           return_when=asyncio.FIRST_COMPLETED)
        drained = (self.burst and consumer.done() and not consumer.cancelled()
                   and consumer.exception() is None)
        if not drained and not self.consumer.stopping.is_set():
            # A loop died (a bug, a port in use …): a worker that no longer consumes, beats or
            # unloads must not look alive. Exit, and let supervisord start a whole one.
            ended = next(t for t in (consumer, *background) if t.done())
            log.critical("%s ended: %r; exiting", ended.get_coro().__name__, ended.exception())
            self._request_exit(1)
        elif not drained:
            await self._finish_current_task(consumer)
        for running in (consumer, stop_requested, *background):
            running.cancel()
        await asyncio.gather(consumer, stop_requested, *background, return_exceptions=True)
        # The engine thread may still run; a real exit (os._exit) skips waiting for it.
        await self._leave(None if drained else 0)

    async def _finish_current_task(self, consumer: asyncio.Task) -> None:
        if self.consumer.current_task is None and not self.host.busy:
            consumer.cancel()  # idle: nothing to finish (a task it just took stays pending)
            return
        log.info("stopping: finishing task %s (up to %.0f s)", self.consumer.current_task,
                 self.settings.stop_grace_seconds)
        done, _ = await asyncio.wait({consumer}, timeout=self.settings.stop_grace_seconds)
        if self.consumer.current_task is not None and not done:
            log.warning("task %s did not finish in time; it stays pending for redelivery",
                        self.consumer.current_task)

    async def _preload_default(self) -> None:
        model = self.settings.default_model(self.backend)
        if not model:
            return
        try:
            breaker_error = await self.breakers.admit(model)
        except RedisError:
            breaker_error = None  # Redis is not up yet: try the load
        if breaker_error:
            log.warning("not preloading: %s", breaker_error)
            return
        await self.host.preload(model)  # its load is reported like a direct HTTP call's

    async def _exit_after_load_failure(self) -> None:
        # A process that ends before supervisord's startsecs is a failed start, and after
        # startretries of those supervisord gives up on the program (FATAL) and with it on
        # every other model of this worker. Lived longer, the exit is a plain restart.
        wait = self.settings.min_uptime_seconds - (time.time() - self.started_at)
        if wait > 0:
            log.info("exiting in %.1f s (SPEECH_MIN_UPTIME_SECONDS)", wait)
            await asyncio.sleep(wait)
        await self._leave(1)

    async def _leave(self, code: int | None) -> None:
        """No longer live (the heartbeat goes at once, not at its TTL), then exit with `code`
        (None: only return, as a drained burst does)."""
        with contextlib.suppress(RedisError):
            await self.store.forget_heartbeat()
        with contextlib.suppress(RedisError):  # and its device memory goes with it
            await self.host.holding.budget.release()
        if code is not None:
            self._request_exit(code)

    def _request_exit(self, code: int) -> None:
        """Ask the exit policy once; a policy that returns (a test's) lets the loops wind down."""
        if self.exit_code is not None:
            return
        self.exit_code = code
        self.consumer.stop()
        self.exit(code)

    # --- heartbeat and health ------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while True:
            with contextlib.suppress(RedisError):
                await self.store.beat(self.health())
            await asyncio.sleep(self.settings.heartbeat_seconds)

    def _bound(self, url: str) -> None:
        self.url = url

    def health(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "consumer": self.store.consumer,
            "pid": os.getpid(),
            "url": self.url,
            **self.host.health(),
            "tasks_done": self.consumer.tasks_done,
            "current_task": self.consumer.current_task,
            "current_batch": self.consumer.current_batch,
            "started_at": self.started_at,
        }

    async def report(self) -> dict[str, Any]:
        """/health: the snapshot, with the models whose breaker is open or half-open."""
        snapshot = self.health()
        try:
            snapshot["breakers"] = await self.breakers.open_ones()
        except RedisError:
            snapshot["breakers"] = None  # unknown while Redis is unreachable
        return snapshot
