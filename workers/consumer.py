"""The task consumer: a worker's queue loop, reading like the protocol it implements.

Claim an entry (our own pending entries first, after a restart; then an abandoned one the
janitor takes over; then a blocking read), open an attempt, ask the model's breaker, run the
engine through the engine host, store the terminal state (fenced by attempt), ack. Around
each task: lease extension and metrics; for TTS, each spoken piece is stored (fenced by the
same attempt) as it is done, and a redelivered task resumes after the stored ones. What a
failed load means (fail the task, count it against the model's breaker, after a half-built
load ask the process edge to exit) is in `workers/breakers.py`, which hears of every load
the consumer's tasks cause.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError, ResponseError

from common import logs
from common.paths import AllowedFile
from common.schemas import ErrorCode, Segment, SpeechChunk, TaskState
from common.settings import Settings
from common.store import Task, WorkerStore
from common.store.queue import Delivery
from workers.breakers import ModelBreakers
from workers.engine_host import EngineHost
from workers.execute import Outcome, SpeechProgress, TaskError
from workers.models import LoadReport

log = logging.getLogger("worker")
JANITOR_INTERVAL_SECONDS = 5.0


class Consumer:
    def __init__(self, settings: Settings, store: WorkerStore, host: EngineHost,
                 breakers: ModelBreakers, *, burst: bool = False) -> None:
        self.settings = settings
        self.store = store
        self.host = host
        self.breakers = breakers
        self.burst = burst  # drain the queue, then return (a worker run inside a test)
        self.stopping = asyncio.Event()
        self.current_task: str | None = None
        self.tasks_done = 0
        self.load_seconds: float | None = None  # of the load the current task caused
        self.device_wait_seconds: float | None = None  # that load's wait for device memory

    def stop(self) -> None:
        """Take no new task; the one running finishes (see Worker.run for how long it may)."""
        self.stopping.set()

    async def run(self) -> None:
        await _until_stored(self.store.ensure_queue)
        # our own unacked entries of each lane first (after a restart): lane -> cursor
        pending_cursors: dict[str, str] = {lane: "0" for lane in self.store.lanes}
        next_janitor = 0.0
        while not self.stopping.is_set():
            try:
                if pending_cursors:
                    lane, cursor = next(iter(pending_cursors.items()))
                    deliveries = await self.store.read(after=cursor, lane=lane)
                    if not deliveries:
                        del pending_cursors[lane]
                        continue
                    pending_cursors[lane] = deliveries[-1].entry_id
                else:
                    deliveries = []
                    if self.burst or time.monotonic() >= next_janitor:
                        next_janitor = time.monotonic() + JANITOR_INTERVAL_SECONDS
                        deliveries = await self.store.claim_abandoned(
                            self.settings.visibility_timeout_seconds)
                    if not deliveries:
                        deliveries = await self.store.read(block_ms=None if self.burst else 1000)
                    if not deliveries and self.burst:
                        return  # drained: nothing new, nothing abandoned
                for delivery in deliveries:
                    await self._handle(delivery)
            except ResponseError as exc:
                if not str(exc).startswith(("NOGROUP", "UNBLOCKED")):
                    raise
                # Redis came back without our stream (no AOF, or flushed): make it again.
                log.warning("the queue's consumer group is gone; recreating it")
                await _until_stored(self.store.ensure_queue)
            except RedisError as exc:
                log.warning("redis unavailable (%s); retrying", exc)
                await asyncio.sleep(1.0)

    async def _handle(self, delivery: Delivery) -> None:
        task = await self.store.get(delivery.task_id) if delivery.task_id else None
        if task is None or task.state.terminal:
            await self.store.ack(delivery)  # cancelled, finished or expired
            return
        with logs.task_context(task.id):
            await self._handle_task(task, delivery)

    async def _handle_task(self, task: Task, delivery: Delivery) -> None:
        entry_id = delivery.entry_id
        deliveries = await self.store.deliveries(delivery)
        if deliveries > self.settings.max_deliveries:
            await self._give_up(task, entry_id, deliveries)
            return
        attempt = await self.store.start(task.id, deliveries)
        if attempt <= 0:  # finished meanwhile, gone, or (-2) its deadline passed: FAILED
            if attempt == -2:
                log.warning("deadline passed before it started: FAILED deadline_exceeded")
            await self.store.ack(delivery)
            return
        started = time.time()
        log.info("attempt %d (delivery %d), model %s", attempt, deliveries, task.model)
        self.current_task, self.load_seconds, self.device_wait_seconds = task.id, None, None
        lease = asyncio.create_task(self._keep_lease(delivery))
        try:
            outcome: Outcome | None = None
            error, code = "", ""
            try:
                outcome = await self._run_task(task, attempt)
            except TaskError as exc:
                error, code = str(exc), exc.code.value
        finally:
            lease.cancel()
            self.current_task = None
        state = TaskState.SUCCEEDED if outcome else TaskState.FAILED
        stored = await _until_stored(lambda: self.store.finish(
            task, state, attempt=attempt, entry_id=entry_id,
            result=outcome.result if outcome else None, error=error, error_code=code,
            output=outcome.output if outcome else None))
        log.info("%s%s", state.value if stored else "stale attempt, dropped",
                 f" ({error})" if error else "")
        self.tasks_done += 1
        if stored:
            await self._record(task, state, started)

    async def _record(self, task: Task, state: TaskState, started: float) -> None:
        """Metrics for one finished task; never allowed to fail the task."""
        finished = time.time()
        inference = (finished - started - (self.load_seconds or 0.0)
                     - (self.device_wait_seconds or 0.0))
        observations = {"queue_wait_seconds": started - task.created_at,
                        "end_to_end_seconds": finished - task.created_at,
                        "inference_seconds": inference}
        if self.load_seconds is not None:
            observations["model_load_seconds"] = self.load_seconds
        if self.device_wait_seconds is not None:
            observations["device_wait_seconds"] = self.device_wait_seconds
        if state == TaskState.SUCCEEDED and task.audio_seconds:
            observations["realtime_factor"] = inference / task.audio_seconds
        with contextlib.suppress(RedisError):
            await self.store.record((f"tasks_{state.value}",),
                                    {name: max(0.0, value) for name, value in observations.items()})
            if state == TaskState.SUCCEEDED and task.work_units:
                # the processing rate a predicted wait divides by: work (audio-seconds, or
                # characters) per second of wall time, less a load
                await self.store.record_rate(task.model, task.work_units, inference)

    async def _run_task(self, task: Task, attempt: int) -> Outcome:
        breaker_error = await self.breakers.admit(task.model)
        if breaker_error:
            raise TaskError(breaker_error, ErrorCode.MODEL_UNAVAILABLE)
        source: bytes | AllowedFile | None
        roots = tuple(self.settings.allowed_roots)
        if task.input_path:  # checked again as it is opened: it may be a symlink by now
            source = AllowedFile(task.input_path, roots)
        else:
            source = await self.store.input_blob(task.id)
            if source is None and self.host.kind == "asr":
                raise TaskError("the task's input audio has expired", ErrorCode.INVALID_AUDIO)
        if self.host.kind == "tts" and task.params.get("speaker_wav"):
            source = AllowedFile(task.params["speaker_wav"], roots)
        loop = asyncio.get_running_loop()

        def on_segment(segment: Segment) -> None:
            # Runs on the engine thread. Waiting for each publish keeps segments in order;
            # streaming is best effort, so a slow or absent Redis only skips the event.
            event = {"type": "segment", "id": segment.id, "start": segment.start,
                     "end": segment.end, "text": segment.text}
            future = asyncio.run_coroutine_threadsafe(
                self.store.publish_segment(task.id, attempt, segment.end, event), loop)
            with contextlib.suppress(Exception):
                future.result(timeout=1.0)

        speech = await self._speech(task, attempt) if self.host.kind == "tts" else None
        return await self.host.execute(task.model, task.params, source, on_segment,
                                       on_load=functools.partial(self._loaded, task),
                                       speech=speech)

    async def _speech(self, task: Task, attempt: int) -> SpeechProgress:
        """Where a TTS task's pieces go as they are spoken, after those an earlier attempt
        stored (read after this attempt started: no stale one can append any more)."""
        done = await _until_stored(lambda: self.store.speech_chunks(task.id))
        if done:
            log.info("resuming after %d stored pieces", len(done))
        loop = asyncio.get_running_loop()

        def store(chunk: SpeechChunk) -> None:
            # Runs on the engine thread: each piece is durable before the next is spoken.
            # A lost Redis is waited out (as the terminal write would be); StaleAttempt
            # (another attempt owns the task now) ends this one.
            asyncio.run_coroutine_threadsafe(_until_stored(
                lambda: self.store.append_chunk(task.id, attempt, chunk)), loop).result()

        return SpeechProgress(done, store)

    async def _give_up(self, task: Task, entry_id: str, deliveries: int) -> None:
        reason = f"gave up after {deliveries - 1} deliveries: the worker died running this task"
        if task.last_error:
            reason = f"{task.last_error} (gave up after {deliveries - 1} deliveries)"
        log.error("%s", reason)
        await self.store.dead_letter(task.id, reason, deliveries)
        await self.store.finish(task, TaskState.FAILED, attempt=None, entry_id=entry_id,
                                error=reason, error_code=ErrorCode.DELIVERY_LIMIT.value)
        with contextlib.suppress(RedisError):
            await self.store.record(("tasks_FAILED", "dead_lettered"))

    async def _keep_lease(self, delivery: Delivery) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_seconds)
            try:
                if not await self.store.extend_lease(delivery):
                    log.warning("lost the lease on %s to another worker", delivery.entry_id)
                    return
            except RedisError:
                pass  # the janitor's visibility timeout is many heartbeats long

    async def _loaded(self, task: Task, report: LoadReport) -> None:
        """The host's report of the model `task` asked for: a load's time goes into the
        task's metrics, and the breaker rules decide the rest."""
        if report.ok and report.loaded:
            self.load_seconds = report.seconds  # for this task's metrics
            self.device_wait_seconds = report.device_wait_seconds
        await self.breakers.load_reported(task, report)


async def _until_stored(action: Callable[[], Awaitable[Any]]) -> Any:
    """Retry a Redis write until it lands: a computed result is not thrown away."""
    delay = 0.2
    while True:
        try:
            return await action()
        except RedisError as exc:
            log.warning("redis unavailable (%s); retrying in %.1f s", exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
