"""The worker runtime: every lifecycle rule, written once, for every engine.

The loop reads like the protocol it implements: claim an entry, open an attempt, run
the engine off the event loop, store the terminal state (fenced by attempt), ack.
Around it: lease extension, a janitor for abandoned entries, idle unload, the memory
cap, exit on load failure with a breaker, heartbeat, and a graceful stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import signal
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.exceptions import RedisError, ResponseError

from common import keys, logs
from common.audio import AudioError, AudioTooLong
from common.backends import BACKENDS
from common.paths import AllowedFile
from common.schemas import ErrorCode, Segment, TaskState
from common.settings import Settings
from common.store import Admission, BreakerPolicy, Task, TaskStore, metrics, write_heartbeat
from common.store.queue import Delivery, Queue
from workers import memory
from workers.engines.base import Engine
from workers.execute import Outcome, run_engine
from workers.models import LoadFailed, ModelSlot, SourceUnusable

log = logging.getLogger("worker")
T = TypeVar("T")
JANITOR_INTERVAL_SECONDS = 5.0
MEMORY_LIMIT_ERROR = "GPU memory limit reached for this file"


class TaskError(Exception):
    """The task cannot succeed (bad audio, engine error, out of memory); no retry."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.ENGINE_ERROR) -> None:
        super().__init__(message)
        self.code = code


class Worker:
    def __init__(self, settings: Settings, engine: Engine) -> None:
        self.settings = settings
        self.backend = settings.backend
        self.engine = engine
        self.device = _resolve_device(settings.device, engine)
        self.consumer = settings.consumer_name()
        self.slot = ModelSlot(engine, self.device, settings.backend_models(self.backend))
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.engine_lock = asyncio.Lock()  # one engine call at a time: queue and direct HTTP
        self.stopping = asyncio.Event()
        self.current_task: str | None = None
        self.running_calls = 0  # engine calls in progress (queue or direct HTTP): "busy"
        self.tasks_done = 0
        self.started_at = time.time()
        self.url = ""
        redis = Redis.from_url(settings.redis_url, socket_connect_timeout=2, socket_timeout=10)
        self.store = TaskStore.for_settings(redis, settings)
        self.queue = Queue(redis, self.backend, self.consumer)
        self.breaker_policy = BreakerPolicy.of(settings)
        self.probing: str | None = None  # the model whose half-open breaker this worker probes

    # --- lifecycle ---------------------------------------------------------------------

    async def run(self, serve_http: Callable[[Worker], Any] | None = None) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        if self.device == "cuda" and self.engine.uses_torch and self.settings.memory_cap_mib > 0:
            await self._call(memory.apply_torch_cap, self.settings.memory_cap_mib)
        background = []
        if serve_http is not None:
            background.append(asyncio.create_task(serve_http(self)))
            await asyncio.sleep(0)  # let it bind, so the first heartbeat carries its URL
        background.append(asyncio.create_task(self._heartbeat_loop()))
        if self.settings.idle_unload_seconds > 0:
            background.append(asyncio.create_task(self._idle_unload_loop()))
        with contextlib.suppress(RedisError):
            await metrics.record(self.store.redis, self.backend, ("worker_starts",))
        if self.settings.preload:
            await self._preload_default()
        consumer = asyncio.create_task(self._consume_loop())
        stop_requested = asyncio.create_task(self.stopping.wait())
        await asyncio.wait({consumer, stop_requested, *background},
                           return_when=asyncio.FIRST_COMPLETED)
        if not self.stopping.is_set():
            # A loop died (a bug, a port in use …): a worker that no longer consumes, beats or
            # unloads must not look alive. Exit, and let supervisord start a whole one.
            ended = next(t for t in (consumer, *background) if t.done())
            log.critical("%s ended: %r; exiting", ended.get_coro().__name__, ended.exception())
            os._exit(1)
        done: set[asyncio.Task] = set()
        if self.current_task is None and not self.engine_lock.locked():
            consumer.cancel()  # idle: nothing to finish (a task it just took stays pending)
        else:
            log.info("stopping: finishing task %s (up to %.0f s)", self.current_task,
                     self.settings.stop_grace_seconds)
            done, _ = await asyncio.wait({consumer}, timeout=self.settings.stop_grace_seconds)
        if self.current_task is not None and not done:
            log.warning("task %s did not finish in time; it stays pending for redelivery",
                        self.current_task)
        with contextlib.suppress(RedisError):
            await self.store.redis.delete(self._heartbeat_key())
        # The engine thread may still run; os._exit skips waiting for it.
        os._exit(0)

    async def _preload_default(self) -> None:
        model = self.settings.default_model(self.backend)
        if not model:
            return
        try:
            breaker_error = await self._breaker_error(model)
        except RedisError:
            breaker_error = None  # Redis is not up yet: try the load
        if breaker_error:
            log.warning("not preloading: %s", breaker_error)
            return
        async with self.engine_lock:
            with contextlib.suppress(TaskError):  # logged and counted by _acquire
                await self._acquire(model, task=None)

    # --- the consumer loop ---------------------------------------------------------------

    async def _consume_loop(self) -> None:
        await self._retrying(lambda: self.store.ensure_queue(self.backend))
        pending_cursor: str | None = "0"  # our own unacked entries first (after a restart)
        next_janitor = 0.0
        while not self.stopping.is_set():
            try:
                if pending_cursor is not None:
                    deliveries = await self.queue.read(after=pending_cursor)
                    if not deliveries:
                        pending_cursor = None
                        continue
                    pending_cursor = deliveries[-1].entry_id
                else:
                    deliveries = []
                    if time.monotonic() >= next_janitor:
                        next_janitor = time.monotonic() + JANITOR_INTERVAL_SECONDS
                        deliveries = await self.queue.claim_abandoned(
                            self.settings.visibility_timeout_seconds)
                    if not deliveries:
                        deliveries = await self.queue.read(block_ms=1000)
                for delivery in deliveries:
                    await self._handle(delivery)
            except ResponseError as exc:
                if not str(exc).startswith(("NOGROUP", "UNBLOCKED")):
                    raise
                # Redis came back without our stream (no AOF, or flushed): make it again.
                log.warning("the queue's consumer group is gone; recreating it")
                await self._retrying(lambda: self.store.ensure_queue(self.backend))
            except RedisError as exc:
                log.warning("redis unavailable (%s); retrying", exc)
                await asyncio.sleep(1.0)

    async def _handle(self, delivery: Delivery) -> None:
        task = await self.store.get(delivery.task_id) if delivery.task_id else None
        if task is None or task.state.terminal:
            await self.queue.ack(delivery.entry_id)  # cancelled, finished or expired
            return
        with logs.task_context(task.id):
            await self._handle_task(task, delivery.entry_id)

    async def _handle_task(self, task: Task, entry_id: str) -> None:
        deliveries = await self.queue.deliveries(entry_id)
        if deliveries > self.settings.max_deliveries:
            await self._give_up(task, entry_id, deliveries)
            return
        attempt = await self.store.start(task.id, self.consumer, deliveries)
        if attempt <= 0:
            await self.queue.ack(entry_id)
            return
        started = time.time()
        log.info("attempt %d (delivery %d), model %s", attempt, deliveries, task.model)
        self.current_task = task.id
        lease = asyncio.create_task(self._keep_lease(entry_id))
        loads_before = self.slot.loads
        try:
            outcome: Outcome | None = None
            error, code = "", ""
            try:
                outcome = await self._run_task(task)
            except TaskError as exc:
                error, code = str(exc), exc.code.value
        finally:
            lease.cancel()
            self.current_task = None
        state = TaskState.SUCCEEDED if outcome else TaskState.FAILED
        stored = await self._retrying(lambda: self.store.finish(
            task, state, attempt=attempt, entry_id=entry_id,
            result=outcome.result if outcome else None, error=error, error_code=code,
            output=outcome.output if outcome else None))
        log.info("%s%s", state.value if stored else "stale attempt, dropped",
                 f" ({error})" if error else "")
        self.tasks_done += 1
        if stored:
            load = self.slot.last_load_seconds if self.slot.loads > loads_before else None
            await self._record(task, state, started, load)

    async def _record(self, task: Task, state: TaskState, started: float,
                      load_seconds: float | None) -> None:
        """Metrics for one finished task; never allowed to fail the task."""
        finished = time.time()
        inference = finished - started - (load_seconds or 0.0)
        observations = {"queue_wait_seconds": started - task.created_at,
                        "end_to_end_seconds": finished - task.created_at,
                        "inference_seconds": inference}
        if load_seconds is not None:
            observations["model_load_seconds"] = load_seconds
        if state == TaskState.SUCCEEDED and task.audio_seconds:
            observations["realtime_factor"] = inference / task.audio_seconds
        with contextlib.suppress(RedisError):
            await metrics.record(self.store.redis, self.backend, (f"tasks_{state.value}",),
                                 {name: max(0.0, value) for name, value in observations.items()})

    async def _run_task(self, task: Task) -> Outcome:
        breaker_error = await self._breaker_error(task.model)
        if breaker_error:
            raise TaskError(breaker_error, ErrorCode.MODEL_UNAVAILABLE)
        source: bytes | AllowedFile | None
        roots = tuple(self.settings.allowed_roots)
        if task.input_path:  # checked again as it is opened: it may be a symlink by now
            source = AllowedFile(task.input_path, roots)
        else:
            source = await self.store.input_blob(task.id)
            if source is None and self.engine_kind() == "asr":
                raise TaskError("the task's input audio has expired", ErrorCode.INVALID_AUDIO)
        if self.engine_kind() == "tts" and task.params.get("speaker_wav"):
            source = AllowedFile(task.params["speaker_wav"], roots)
        loop = asyncio.get_running_loop()

        def on_segment(segment: Segment) -> None:
            # Runs on the engine thread. Waiting for each publish keeps segments in order;
            # streaming is best effort, so a slow or absent Redis only skips the event.
            event = {"type": "segment", "id": segment.id, "start": segment.start,
                     "end": segment.end, "text": segment.text}
            future = asyncio.run_coroutine_threadsafe(self.store.publish(task.id, event), loop)
            with contextlib.suppress(Exception):
                future.result(timeout=1.0)

        return await self.execute(task.model, task.params, source, on_segment, task=task)

    async def _give_up(self, task: Task, entry_id: str, deliveries: int) -> None:
        reason = f"gave up after {deliveries - 1} deliveries: the worker died running this task"
        if task.last_error:
            reason = f"{task.last_error} (gave up after {deliveries - 1} deliveries)"
        log.error("%s", reason)
        await self.queue.dead_letter(task.id, reason, deliveries)
        await self.store.finish(task, TaskState.FAILED, attempt=None, entry_id=entry_id,
                                error=reason, error_code=ErrorCode.DELIVERY_LIMIT.value)
        with contextlib.suppress(RedisError):
            await metrics.record(self.store.redis, self.backend, ("tasks_FAILED", "dead_lettered"))

    async def _keep_lease(self, entry_id: str) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_seconds)
            try:
                if not await self.queue.extend_lease(entry_id):
                    log.warning("lost the lease on %s to another worker", entry_id)
                    return
            except RedisError:
                pass  # the janitor's visibility timeout is many heartbeats long

    # --- running the engine ----------------------------------------------------------------

    def engine_kind(self) -> str:
        return BACKENDS[self.backend].kind

    async def execute(self, model: str, params: dict[str, Any], source: bytes | Path | None,
                      on_segment: Callable[[Segment], None], task: Task | None = None) -> Outcome:
        """Load `model` if needed and run one engine call, serialised with every other."""
        async with self.engine_lock:
            self.running_calls += 1
            outcome: Outcome | None = None
            failure: TaskError | None = None
            try:
                handle = await self._acquire(model, task)
                await self._call(self._refuse_over_cap)
                outcome = await self._call(
                    run_engine, self.engine, handle, backend=self.backend, model=model,
                    params=params, source=source, on_segment=on_segment,
                    max_audio_seconds=self.settings.max_audio_seconds,
                    allowed_roots=tuple(self.settings.allowed_roots))
            except Exception as exc:
                failure = _task_error(exc)
            # Past the except block the engine's exception is gone, and with its traceback
            # the tensors its frames held: only now can releasing memory return them.
            handle = None
            try:
                await self._call(self._after_engine_call)
            finally:
                self.running_calls -= 1
            if failure is not None:
                raise failure
            assert outcome is not None
            return outcome

    def _memory_over_cap(self) -> float | None:
        """MiB in use if over `memory_cap_mib` (GPU memory on cuda, RSS on cpu), else None."""
        cap = self.settings.memory_cap_mib
        if cap <= 0:
            return None
        used = memory.used_mib(memory.snapshot(self.engine.uses_torch, self.device), self.device)
        return used if used > cap else None

    def _refuse_over_cap(self) -> None:
        """With its model loaded the worker is already over its cap: running would only grow
        it, so the task is refused (and the model dropped) rather than the cap broken."""
        used = self._memory_over_cap()
        if used is not None:
            self.slot.unload()
            raise TaskError(f"this worker's memory cap is {self.settings.memory_cap_mib} MiB and "
                            f"it uses {used:.0f} MiB with the model loaded: raise "
                            "SPEECH_MEMORY_CAP_MIB or use a smaller model",
                            ErrorCode.OUT_OF_MEMORY)

    async def _acquire(self, model: str, task: Task | None) -> Any:
        loads_before = self.slot.loads
        probing = self.probing == model
        if probing:
            self.probing = None
        try:
            handle = await self._call(self.slot.acquire, model)
        except KeyError as exc:
            raise TaskError(str(exc.args[0]), ErrorCode.INVALID_REQUEST) from None
        except SourceUnusable as exc:
            # Found before anything was allocated: fail this task only, and keep serving.
            log.error("%s", exc)
            await self._count_load_failure(model, str(exc))
            raise TaskError(str(exc), ErrorCode.MODEL_LOAD_FAILED) from None
        except LoadFailed as exc:
            error = str(exc)
        else:
            if self.slot.loads > loads_before or probing:
                # A load that works ends the run of failures, and closes an open breaker.
                with contextlib.suppress(RedisError):
                    await self.store.clear_breaker(self.backend, model)
            return handle
        await self._exit_after_load_failure(model, error, task)

    async def _exit_after_load_failure(self, model: str, error: str, task: Task | None) -> None:
        """Fail the task, count the failure, then end the process: only an exit returns what
        a half-built model may hold on the GPU. supervisord starts a fresh worker."""
        log.error("%s; exiting", error)
        if task is not None:
            with contextlib.suppress(RedisError):
                await self._fail_loading_task(task, error)
        await self._count_load_failure(model, error)
        # A process that ends before supervisord's startsecs is a failed start, and after
        # startretries of those supervisord gives up on the program (FATAL) and with it on
        # every other model of this worker. Lived longer, the exit is a plain restart.
        wait = self.settings.min_uptime_seconds - (time.time() - self.started_at)
        if wait > 0:
            log.info("exiting in %.1f s (SPEECH_MIN_UPTIME_SECONDS)", wait)
            await asyncio.sleep(wait)
        with contextlib.suppress(RedisError):
            await self.store.redis.delete(self._heartbeat_key())
        logging.shutdown()
        os._exit(1)

    async def _fail_loading_task(self, task: Task, error: str) -> None:
        """Store the task FAILED before the exit, so it is not redelivered to crash the next
        worker too; fenced by the attempt this worker opened for it."""
        current = await self.store.get(task.id)
        if (current is None or current.state != TaskState.RUNNING
                or current.worker != self.consumer):
            return
        if await self.store.finish(current, TaskState.FAILED, attempt=current.attempt,
                                   entry_id=current.entry_id, error=error,
                                   error_code=ErrorCode.MODEL_LOAD_FAILED.value):
            await metrics.record(self.store.redis, self.backend, ("tasks_FAILED",))

    async def _count_load_failure(self, model: str, error: str) -> None:
        with contextlib.suppress(RedisError):
            await metrics.record(self.store.redis, self.backend, ("load_failures",))
            if await self.store.record_load_failure(self.backend, model,
                                                    self.slot.sources.get(model, ""), error,
                                                    self.breaker_policy):
                log.error("breaker open for %s/%s: its tasks fail fast until a probe loads it",
                          self.backend, model)

    def _after_engine_call(self) -> None:
        memory.release(self.engine.uses_torch)
        if self.settings.idle_unload_seconds == 0:
            self.slot.unload()
        elif (used := self._memory_over_cap()) is not None:
            log.warning("memory %.0f MiB over the %d MiB cap: unloading", used,
                        self.settings.memory_cap_mib)
            self.slot.unload()

    async def _breaker_error(self, model: str) -> str | None:
        """None when `model` may be loaded now (its breaker is closed, or this worker just
        became the probe of its half-open breaker), else why its tasks fail fast."""
        admission = await self.store.admit(self.backend, model, self.slot.sources.get(model, ""),
                                           self.consumer, self.breaker_policy)
        if admission.verdict == "open":
            return _unavailable(model, admission)
        if admission.verdict == "probe":
            log.info("breaker of %s is half-open: this load is its probe", model)
            self.probing = model
        return None

    async def open_breakers(self) -> dict[str, str]:
        """Models of this backend whose breaker is open or half-open, with their load errors."""
        breakers = await self.store.breakers(self.backend, self.slot.sources,
                                             self.breaker_policy)
        return {model: b.error for model, b in breakers.items() if b.state != "closed"}

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run on the engine thread, carrying the task id into its log lines."""
        context = contextvars.copy_context()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor,
                                          lambda: context.run(fn, *args, **kwargs))

    async def _retrying(self, action: Callable[[], Any]) -> Any:
        """Retry a Redis write until it lands: a computed result is not thrown away."""
        delay = 0.2
        while True:
            try:
                return await action()
            except RedisError as exc:
                log.warning("redis unavailable (%s); retrying in %.1f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 5.0)

    # --- background loops ----------------------------------------------------------------

    async def _idle_unload_loop(self) -> None:
        idle_limit = self.settings.idle_unload_seconds
        while True:
            await asyncio.sleep(min(1.0, idle_limit / 4))
            if self.slot.handle is None or self.engine_lock.locked():
                continue
            if self.slot.idle_for() >= idle_limit:
                async with self.engine_lock:
                    if self.slot.idle_for() >= idle_limit:
                        log.info("idle for %.0f s: unloading", self.slot.idle_for())
                        await self._call(self.slot.unload)

    async def _heartbeat_loop(self) -> None:
        while True:
            with contextlib.suppress(RedisError):
                await write_heartbeat(self.store.redis, self.backend, self.consumer, self.health(),
                                      ttl_seconds=3 * self.settings.heartbeat_seconds)
            await asyncio.sleep(self.settings.heartbeat_seconds)

    def _heartbeat_key(self) -> str:
        return keys.heartbeat(self.backend, self.consumer)

    def health(self) -> dict[str, Any]:
        if self.slot.loading:
            state = "loading"
        elif self.running_calls:
            state = "busy"
        else:
            state = "ready" if self.slot.handle is not None else "idle"
        return {
            "backend": self.backend,
            "consumer": self.consumer,
            "pid": os.getpid(),
            "url": self.url,
            "state": state,
            "device": self.device,
            "loaded_models": self.slot.loaded_models,
            "last_used": self.slot.last_used,
            "memory": memory.snapshot(self.engine.uses_torch, self.device),
            "memory_cap_mib": self.settings.memory_cap_mib,
            "idle_unload_seconds": self.settings.idle_unload_seconds,
            "tasks_done": self.tasks_done,
            "current_task": self.current_task,
            "started_at": self.started_at,
        }


def _task_error(exc: Exception) -> TaskError:
    """A fresh, traceback-free TaskError saying why an engine call failed."""
    if isinstance(exc, TaskError):
        return TaskError(str(exc), exc.code)
    if isinstance(exc, AudioTooLong):
        return TaskError(str(exc), ErrorCode.AUDIO_TOO_LONG)
    if isinstance(exc, AudioError):
        return TaskError(str(exc), ErrorCode.INVALID_AUDIO)
    if memory.is_out_of_memory(exc):
        return TaskError(MEMORY_LIMIT_ERROR, ErrorCode.OUT_OF_MEMORY)
    if isinstance(exc, ValueError):
        return TaskError(str(exc), ErrorCode.INVALID_REQUEST)
    return TaskError(f"{type(exc).__name__}: {exc}")


def _unavailable(model: str, admission: Admission) -> str:
    if admission.reopens_at is None:
        retry = "until a load works or the breaker is reset"
    elif (wait := admission.reopens_at - time.time()) > 0:
        retry = f"next load attempt in {wait:.0f} s"
    else:
        retry = "a probe load is under way"
    error = admission.error or "it failed to load"
    return f"model {model!r} is unavailable ({retry}): {error}"


def _resolve_device(setting: str, engine: Engine) -> str:
    if setting != "auto":
        return setting
    return "cuda" if engine.cuda_available() else "cpu"
