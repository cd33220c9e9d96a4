"""The worker runtime: every lifecycle rule, written once, for every engine.

A worker is three parts, composed here: the engine host (`workers/engine_host.py`: one
resident model, the engine thread, the memory cap, idle unload), the task consumer
(`workers/consumer.py`: claim an entry, open an attempt, run the engine off the event loop,
store the terminal state fenced by attempt, ack; with lease extension, a janitor for
abandoned entries, and the breakers of `workers/breakers.py`), and the worker's side of
Redis (`common.store.WorkerStore`). Here: heartbeat, the health snapshot, a graceful stop,
and leaving through the exit policy it is handed. The process edge (`workers/__main__.py`)
hands it a real exit, a re-exec and signal handling; a test hands it neither, and may run it
in burst mode, draining the queue in-process.

After an idle unload the runtime may re-exec the process (`SPEECH_REEXEC_RSS_RATIO`): an
unload gives the model back, but not what its load left behind (the allocator's arenas, the
code pages and caches of what it imported, a CUDA context), and only a fresh image sheds
those. It leaves as a clean stop does (no task running, nothing taken; the device
reservation given back), keeps what others know it by (its pid, consumer name and pending
entries, its listening socket, its heartbeat, handed over with a TTL that covers the start),
and the new image (`Handover`) carries on: no preload, the counters kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from typing import Any

import psutil
from redis.asyncio import Redis
from redis.exceptions import RedisError

from common.catalog import guarded
from common.settings import Settings
from common.store import WorkerStore
from workers import device_budget, memory
from workers.breakers import ModelBreakers
from workers.cancelling import cancel_all
from workers.consumer import Consumer
from workers.engine_host import EngineHost
from workers.engines.base import Engine

log = logging.getLogger("worker")

#: the direct HTTP server (workers.http.serve_http): the host it serves, the /health
#: snapshot to answer with, where to say the URL it bound (and a duplicate of its listening
#: socket's fd, to hand over on a re-exec), the fd of the socket handed over, if any, and
#: the models' breakers
HttpServer = Callable[[EngineHost, Callable[[], Awaitable[dict[str, Any]]],
                       Callable[[str, int], None], int | None,
                       Callable[[str], Awaitable[str | None]]], Awaitable[None]]
#: where a re-exec'd worker finds its Handover (popped at start: no child process sees it)
HANDOVER_ENV = "SPEECH_WORKER_HANDOVER"
SIGNALS = {signal.SIGTERM, signal.SIGINT}
#: how often a wait before a load failure's exit looks for a stop asked meanwhile
STOP_POLL_SECONDS = 0.1


@dataclasses.dataclass(frozen=True, slots=True)
class Handover:
    """What a worker's image hands the next one when it re-execs itself."""

    started_at: float  # the process's start (its uptime goes on)
    tasks_done: int
    reexecs: int  # re-execs so far, this one included
    exec_at: float  # when the exec was asked for: the new image times its start from it
    listen_fd: int | None  # the direct HTTP server's listening socket, kept open

    def encode(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def take(cls) -> Handover | None:
        """This image's handover, removed from the environment; None on a fresh start."""
        text = os.environ.pop(HANDOVER_ENV, "")
        return cls(**json.loads(text)) if text else None


class Worker:
    def __init__(self, settings: Settings, engine: Engine, redis: Redis, *,
                 handle_signals: bool, exit: Callable[[int], None], burst: bool = False,
                 reexec: Callable[[dict[str, str]], None] | None = None,
                 handover: Handover | None = None) -> None:
        """`exit(code)` ends the process (a test's may only record it); `handle_signals`:
        SIGTERM and SIGINT stop the worker gracefully; `burst`: return once the queue is
        drained; `reexec(environment)` replaces the process's image with a fresh one of
        the same command line, with `environment` added (None: never re-exec);
        `handover`: what the image before this one handed over."""
        self.settings = settings
        self.backend = settings.backend
        self.handle_signals = handle_signals
        self.exit = exit
        self.burst = burst
        self.reexec = reexec
        self.handover = handover
        self.exit_code: int | None = None  # the exit asked for, once
        self.stop_asked = False  # a stop from outside (a signal): never re-exec then
        self.reexec_wanted = False
        self.started_at = handover.started_at if handover else time.time()
        # when this image began: the exec, or the process's start
        self.image_started = handover.exec_at if handover else psutil.Process().create_time()
        self.start_seconds = 0.0  # how long this image took to start (to its first beat)
        self.fresh_rss_mib = 0.0  # this image's RSS once started, before any model
        self.url = ""
        self.listen_fd: int | None = None  # a duplicate of the HTTP server's socket
        self.store = WorkerStore(redis, settings, settings.consumer_name())
        self.host = EngineHost(settings, engine)
        self.host.holding.budget = device_budget.for_worker(
            settings, self.store, self.host.device,
            memory.device_total_mib(self.host.device, engine.uses_torch))
        self.breakers = ModelBreakers(self.store, guarded(settings, settings.backend),
                                      self._exit_after_load_failure)
        # Loads no task asked for (a direct HTTP call's) count against breakers too.
        self.host.on_load = functools.partial(self.breakers.load_reported, None)
        self.consumer = Consumer(settings, self.store, self.host, self.breakers, burst=burst)
        if handover is not None:
            self.consumer.tasks_done = handover.tasks_done

    def stop(self) -> None:
        """Take no new task, finish the running one, then leave."""
        self.stop_asked = True
        self.consumer.stop()

    async def run(self, serve_http: HttpServer | None = None) -> None:
        if self.handle_signals:
            loop = asyncio.get_running_loop()
            for sig in SIGNALS:
                loop.add_signal_handler(sig, self.stop)
            # a stop that came during a re-exec waited, blocked (see _reexec): take it now
            signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
        await self.host.start()
        background = []
        if serve_http is not None:
            inherited = self.handover.listen_fd if self.handover else None
            background.append(asyncio.create_task(serve_http(self.host, self.report,
                                                             self._bound, inherited,
                                                             self.breakers.admit)))
            await asyncio.sleep(0)  # let it bind, so the first heartbeat carries its URL
        self.fresh_rss_mib = memory.rss_mib()
        self.start_seconds = max(0.0, time.time() - self.image_started)
        if self.handover is not None:
            log.info("re-exec'd image %d up in %.1f s, RSS %.0f MiB", self.handover.reexecs,
                     self.start_seconds, self.fresh_rss_mib)
        background.append(asyncio.create_task(self._heartbeat_loop()))
        if self.settings.idle_unload_seconds > 0:
            background.append(asyncio.create_task(self._unload_when_idle()))
        if self.host.holding.budget.enabled:
            background.append(asyncio.create_task(self.host.keep_reservation()))
        with contextlib.suppress(RedisError):
            await self.store.record(("worker_reexecs" if self.handover else "worker_starts",))
        if self.settings.preload and self.handover is None:  # re-exec'd to hold no model
            await self._preload_default()
        consumer = asyncio.create_task(self.consumer.run())
        stop_requested = asyncio.create_task(self.consumer.stopping.wait())
        await asyncio.wait({consumer, stop_requested, *background},
                           return_when=asyncio.FIRST_COMPLETED)
        if self.host.stalled:  # an engine call never returned (its tasks are FAILED): the
            # thread cannot be stopped or joined, and what it holds goes only with the process
            await cancel_all({consumer, stop_requested, *background})
            await self._leave(1)
            return
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
        await cancel_all({consumer, stop_requested, *background})
        # The engine thread may still run; a real exit (os._exit) skips waiting for it.
        await self._leave(None if drained else 0)

    async def _unload_when_idle(self) -> None:
        """Runs for ever: each idle unload, then (with a re-exec policy) a re-exec when the
        unload left RSS above `reexec_rss_ratio` times the fresh image's: the worker stops as on
        SIGTERM (see run), and _leave execs instead of exiting."""
        ratio = self.settings.reexec_rss_ratio
        while True:
            await self.host.unload_when_idle()
            if self.reexec is None or ratio <= 0 or self.host.slot.handle is not None:
                continue  # (a task loaded a model again since: the next unload decides)
            if self.consumer.busy or self.host.busy:
                # entries were taken (attempts may be opening) while the unload held the
                # engine: a re-exec now would cut them off and run them again; the next idle
                # unload decides
                continue
            rss = memory.rss_mib()
            if rss <= ratio * self.fresh_rss_mib:
                continue
            log.info("after the idle unload RSS is %.0f MiB, %.2f x the fresh %.0f MiB: "
                     "re-exec (pid %d stays)", rss, rss / self.fresh_rss_mib,
                     self.fresh_rss_mib, os.getpid())
            self.reexec_wanted = True
            self.consumer.stop()
            return

    async def _finish_current_task(self, consumer: asyncio.Task) -> None:
        if not self.consumer.busy and not self.host.busy:
            # idle: nothing to finish (an entry it just took stays pending for its consumer
            # name, which a restart, or a re-exec, reads first)
            consumer.cancel()
            return
        # A re-exec is the worker's own choice: a task that opened its attempt just before
        # it (an await away) runs to its end; a stop that was asked for has its grace.
        grace = None if self.reexec_wanted and not self.stop_asked \
            else self.settings.stop_grace_seconds
        log.info("stopping: finishing task %s (%s)", self.consumer.current_task,
                 "to its end" if grace is None else f"up to {grace:.0f} s")
        done, _ = await asyncio.wait({consumer}, timeout=grace)
        if self.consumer.current_task is not None and not done:
            # cancelled, the consumer gives its entry back (Consumer._give_back): another
            # worker takes it at once, and a stop is no crash, so that delivery is spared
            log.warning("task %s did not finish in time; given back for redelivery",
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
            leave_at = time.monotonic() + wait
            # a stop asked meanwhile (SIGTERM) is not held up: it would wait for its SIGKILL
            while not self.stop_asked and (left := leave_at - time.monotonic()) > 0:
                await asyncio.sleep(min(left, STOP_POLL_SECONDS))
        # (SPEECH_LOAD_FAILURE=reexec) a fresh image returns what the half-built model
        # holds as an exit does, without the container restart's back-off
        if self.settings.load_failure == "reexec" and await self._reexec():
            return  # the policy returned (a test's)
        await self._leave(1)

    async def _leave(self, code: int | None) -> None:
        """No longer live (the heartbeat goes at once, not at its TTL), then exit with `code`
        (None: only return, as a drained burst does); or, after an idle unload that asked
        for it, re-exec instead (_reexec)."""
        if code == 0 and self.reexec_wanted and await self._reexec():
            return  # the policy returned (a test's)
        with contextlib.suppress(RedisError):
            await self.store.forget_heartbeat()
        with contextlib.suppress(RedisError):  # and its device memory goes with it
            await self.host.holding.budget.release()
        if code is not None:
            self._request_exit(code)

    async def _reexec(self) -> bool:
        """Replace this image with a fresh one (same pid); False when a stop came meanwhile
        (then the worker exits as asked). The device reservation is given back; the
        heartbeat is renewed for as long as this image took to start, twice, so the worker
        never looks gone (same consumer, same URL) while the next one starts."""
        caught: list[int] = []
        if self.handle_signals:  # one that came before is asyncio's, run during the awaits
            for sig in SIGNALS:
                signal.signal(sig, lambda signum, _frame: caught.append(signum))
        with contextlib.suppress(Exception):
            await self.host.holding.budget.release()
        with contextlib.suppress(RedisError):
            await self.store.beat(self.health(), self.store.heartbeat_ttl
                                  + 2 * self.start_seconds)
        if self.handle_signals:  # from now on a stop stays pending into the next image
            signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
            caught += signal.sigpending() & SIGNALS
        if self.stop_asked or caught or self.reexec is None:
            return False
        if self.listen_fd is not None:
            os.set_inheritable(self.listen_fd, True)
        handover = Handover(self.started_at, self.consumer.tasks_done,
                            (self.handover.reexecs if self.handover else 0) + 1, time.time(),
                            self.listen_fd)
        self.exit_code = 0
        log.info("re-exec %d: %s", handover.reexecs, " ".join(sys.orig_argv))
        self.reexec({HANDOVER_ENV: handover.encode()})
        return True

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

    def _bound(self, url: str, listen_fd: int) -> None:
        self.url, self.listen_fd = url, listen_fd

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
            "fresh_rss_mib": self.fresh_rss_mib,
            "reexecs": self.handover.reexecs if self.handover else 0,
        }

    async def report(self) -> dict[str, Any]:
        """/health: the snapshot, with the models whose breaker is open or half-open."""
        snapshot = self.health()
        try:
            snapshot["breakers"] = await self.breakers.open_ones()
        except RedisError:
            snapshot["breakers"] = None  # unknown while Redis is unreachable
        return snapshot
