"""The task consumer: a worker's queue loop, reading like the protocol it implements.

Claim an entry (our own pending entries first, after a restart; then an abandoned one the
janitor takes over; then a blocking read), open an attempt, ask the model's breaker, run the
engine through the engine host, store the terminal state (fenced by attempt), ack. Every
entry a read takes keeps its lease until it is acked; around each task: metrics; for TTS,
each spoken piece is stored (fenced by the same attempt) as it is done, and a redelivered
task resumes after the stored ones. What a failed load means (fail the task, count it
against the model's breaker, after a half-built load ask the process edge to exit) is in
`workers/breakers.py`, which hears of every load the consumer's tasks cause.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, cast

from redis.exceptions import RedisError, ResponseError

from common import logs
from common.paths import AllowedFile
from common.schemas import (
    BATCH,
    DIARIZER,
    INTERACTIVE,
    ErrorCode,
    Segment,
    SpeechChunk,
    TaskState,
)
from common.settings import Settings
from common.store import Task, WorkerStore
from common.store.chunks import PiecesLost
from common.store.connection import store_unreachable
from common.store.queue import Delivery, Lease
from common.store.replicas import NotReplicated
from workers import batching
from workers.breakers import ModelBreakers
from workers.cancelling import cancel_all
from workers.engine_host import EngineHost, call_limit
from workers.execute import (
    OnDecoded,
    Outcome,
    Source,
    SpeechProgress,
    TaskError,
    stream_delta,
)
from workers.models import LoadReport

log = logging.getLogger("worker")
JANITOR_INTERVAL_SECONDS = 5.0
#: how long a write is retried while Redis is unreachable (a failover takes seconds, a
#: restart a minute): past it the computed result is dropped, and the entry, still pending,
#: is redelivered once Redis is back
STORE_PATIENCE_SECONDS = 600.0
#: how long a task whose submit no replica has confirmed yet waits to start (common/store/
#: tasks.py, UNCONFIRMED): a submit waits SPEECH_REDIS_WAIT_TIMEOUT_MS (500) for its replica,
#: then confirms or withdraws it; a flag older than this outlived its gateway
UNCONFIRMED_WAIT_SECONDS = 5.0
#: how long a terminal write keeps being written again while no replica confirms it (a
#: switchover: the node that took it may be demoted and lose it; the write is idempotent):
#: past it the worker moves on, and a write the primary then loses is redelivered
REPLICA_PATIENCE_SECONDS = 5.0
#: tries of a write Redis answers with an error (a script's bug, out of memory): retrying
#: cannot fix a bug, so after these it is logged, counted (store_refusals) and given up
REFUSAL_TRIES = 3
#: a task's decoded audio is charged again (`_top_up`) when it exceeds its charge by more
#: than this, or this share of it: an honest file's probe and decode differ by a frame or
#: two (a variable-block FLAC's last block: 2.5 % of 160 s), a lying one by orders of magnitude
TOP_UP_SLACK_SECONDS = 1.0
TOP_UP_SLACK_SHARE = 0.05
#: the engine thread waits at most this long for the top-up's answer
TOP_UP_WAIT_SECONDS = 30.0


class StoreRefused(Exception):
    """Redis kept refusing a write, or stayed unreachable past STORE_PATIENCE_SECONDS."""


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
        self.current_batch = 0  # tasks in the engine call under way, when they share one
        self.taking = False  # entries read and not yet all handled (see `busy`)
        self.load_observed = False  # the current call's load is in the metrics already
        #: observations for the next task's metrics (a batch's, recorded once)
        self.observations: dict[str, float] = {}
        self.batch_engine = batching.batch_engine(host.engine, settings)
        self.gatherer = (batching.Gatherer(settings.batch_max_size, settings.batch_window_ms)
                         if self.batch_engine is not None else None)

    def stop(self) -> None:
        """Take no new task; the one running finishes (see Worker.run for how long it may)."""
        self.stopping.set()

    @property
    def busy(self) -> bool:
        """A task running, or entries taken whose attempts may be opening (cancelled when
        not busy, it leaves only pending entries, which its consumer name reads first)."""
        return self.taking or self.current_task is not None

    async def run(self) -> None:
        await self._until_stored(self.store.ensure_queue)
        # our own unacked entries of each lane first (after a restart): lane -> cursor
        pending_cursors: dict[str, str] = {lane: "0" for lane in self.store.lanes}
        next_janitor = 0.0
        while not self.stopping.is_set() and not self.host.stalled:  # (stalled: it leaves)
            try:
                if pending_cursors:
                    lane, cursor = next(iter(pending_cursors.items()))
                    deliveries = await self.store.read(after=cursor, lane=lane)
                    self.taking = bool(deliveries)
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
                        self.taking = bool(deliveries)
                        if deliveries:  # there may be more: the next turn looks again
                            next_janitor = 0.0
                    if not deliveries:
                        deliveries = await self.store.read(block_ms=None if self.burst else 1000)
                        self.taking = bool(deliveries)
                        await self._taken(deliveries)
                        if deliveries and self.gatherer is not None:
                            deliveries = await self._gather(deliveries)
                    if not deliveries and self.burst:
                        return  # drained: nothing new, nothing abandoned
                await self._handle_leased(deliveries)
            except ResponseError as exc:
                if store_unreachable(exc):  # a demoted primary's READONLY, a full Redis
                    log.warning("redis cannot take work now (%s); retrying", exc)
                    await asyncio.sleep(1.0)
                    continue
                if not str(exc).startswith(("NOGROUP", "UNBLOCKED")):
                    raise
                # Redis came back without our stream (no AOF, or flushed): make it again.
                log.warning("the queue's consumer group is gone; recreating it")
                await self._until_stored(self.store.ensure_queue)
            except RedisError as exc:
                log.warning("redis unavailable (%s); retrying", exc)
                await asyncio.sleep(1.0)
            finally:
                self.taking = False

    async def _handle_leased(self, deliveries: list[Delivery]) -> None:
        """Every entry taken is leased from here until it is settled (acked): while it waits
        behind the others, while it runs, and during its terminal write."""
        lease = asyncio.create_task(self._keep_lease(deliveries))
        left: list[Delivery] = []
        try:
            if self.gatherer is not None and len(deliveries) > 1:
                left = await self._handle_together(deliveries)
            else:
                for index, delivery in enumerate(deliveries):
                    if self.host.stalled:  # its engine thread is stuck: the rest go to others
                        left = deliveries[index:]
                        break
                    await self._handle(delivery)
        except BaseException as exc:
            # cut short (a Redis error, a stop past its grace): whatever is still pending to
            # this worker goes back now (an acked entry is not released), not after the
            # visibility timeout, and a stopping pod's entries do not wait for its name.
            # Only a stop's and Redis's are spared: another error may be the task's doing
            # (a crash counts)
            left = list(deliveries)
            # (Redis out of reach or full is no task's doing either: three blips in a row
            # dead-lettered a task as "the worker died running this task")
            spare = (isinstance(exc, asyncio.CancelledError) and self.stopping.is_set()
                     and not self.host.stalled) or store_unreachable(exc)
            raise
        else:
            spare = True  # entries never started: nothing of theirs ran
        finally:
            await cancel_all({lease})  # stopped: a last extension would undo the release
            if left:
                await self._give_back(left, spare)

    async def _give_back(self, left: list[Delivery], spare: bool) -> None:
        """Entries taken but not (or no longer) run here: any worker's claim takes them now;
        with `spare`, their next delivery is not theirs to count against
        SPEECH_MAX_DELIVERIES (only those released: not one acked, or another worker's)."""
        with contextlib.suppress(RedisError, TimeoutError):
            async with asyncio.timeout(2.0):  # (a stop's cancel waits for it: briefly)
                released = await self.store.release(
                    left, 2 * self.settings.visibility_timeout_seconds)
                log.info("%d entries not run here given back to the workers", len(released))
                if spare:
                    await self.store.spare_deliveries(
                        [d.task_id for d in released if d.task_id])

    async def _gather(self, first: list[Delivery]) -> list[Delivery]:
        """The batch window (workers/batching.Gatherer); its wait goes into the metrics.
        Entries that could share no call (speakers, options that do not parse) gather
        nothing: a burst of them would all go to this worker, one after another, while
        another worker idles."""
        assert self.gatherer is not None and self.batch_engine is not None
        for delivery in first:
            task = await self.store.get(delivery.task_id) if delivery.task_id else None
            if task is not None and batching.batch_key(
                    self.batch_engine, task.model, task.params, task.audio_seconds) is not None:
                break
        else:
            return first
        taken, waited = await self.gatherer.gather(first, self._sweep)
        self.observations = {"batch_window_wait_seconds": waited, "batch_size": 1}
        return taken

    async def _sweep(self, count: int, block_ms: int | None = None) -> list[Delivery]:
        """The batch window's reads, each taken as it comes (`_taken`): a key's next tasks
        in line come in while the window is open, and may join the call."""
        found = await self.store.sweep(count, block_ms)
        await self._taken(found)
        return found

    async def _taken(self, deliveries: list[Delivery]) -> None:
        """New entries read wait in their lane no more: their owners' next tasks in line come
        in now (common/store/shares.py). Best effort: else their starts do it."""
        if deliveries:
            with contextlib.suppress(RedisError):
                await self.store.taken(deliveries)

    async def _handle(self, delivery: Delivery) -> None:
        task = await self.store.get(delivery.task_id) if delivery.task_id else None
        if task is None or task.state.terminal:
            await self.store.ack(delivery)  # cancelled, finished or expired
            return
        with logs.task_context(task.id):
            await self._handle_task(task, delivery)

    async def _handle_task(self, task: Task, delivery: Delivery) -> None:
        attempt = await self._open(task, delivery)
        if attempt is None:
            return
        started = time.time()
        self.current_task, self.load_seconds, self.device_wait_seconds = task.id, None, None
        self.load_observed = False
        try:  # the task is current until its terminal write is done: a stop waits for it
            outcome: Outcome | TaskError
            try:
                outcome = await self._run_task(task, attempt)
            except TaskError as exc:
                outcome = exc
            await self._settle(task, attempt, delivery, outcome, started)
        finally:
            self.current_task = None

    async def _open(self, task: Task, delivery: Delivery) -> int | None:
        """Open the task's next attempt; None when it must not run (given up, finished,
        cancelled or gone meanwhile, or its deadline passed while queued)."""
        deliveries, ours = await self.store.deliveries(delivery)
        if not ours:  # claimed by another worker while it waited here: that one runs it
            log.warning("entry %s was claimed by another worker; not starting it",
                        delivery.entry_id)
            return None
        if deliveries - task.spared > self.settings.max_deliveries:
            await self._give_up(task, delivery.entry_id, deliveries)
            return None
        attempt = await self._start(task, deliveries)
        if attempt <= 0:  # finished meanwhile, gone, or (-2) its deadline passed: FAILED
            if attempt == -2:
                log.warning("deadline passed before it started: FAILED deadline_exceeded")
            await self.store.ack(delivery)
            return None
        log.info("attempt %d (delivery %d), model %s", attempt, deliveries, task.model)
        return attempt

    async def _start(self, task: Task, deliveries: int) -> int:
        """`store.start`, waiting while its submit is not confirmed by a replica (the submit
        may yet withdraw it); past UNCONFIRMED_WAIT_SECONDS the submit's gateway is gone, or
        the task outlived a failover on the node that holds it: either way it stands."""
        delay, give_up_at = 0.01, time.monotonic() + UNCONFIRMED_WAIT_SECONDS
        while (attempt := await self.store.start(task.id, deliveries)) == -3:
            if time.monotonic() >= give_up_at:
                return await self.store.start(task.id, deliveries, unconfirmed_too=True)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.2)
        return attempt

    async def _settle(self, task: Task, attempt: int, delivery: Delivery,
                      outcome: Outcome | TaskError, started: float, batch_size: int = 1,
                      observations: dict[str, float] | None = None,
                      after_load: bool = False) -> None:
        """The terminal state, fenced by `attempt`, then the task's metrics (`_record`)."""
        done = outcome if isinstance(outcome, Outcome) else None
        state = TaskState.SUCCEEDED if done else TaskState.FAILED
        error, code = ("", "") if done else (str(outcome), cast(TaskError, outcome).code.value)

        def finish(again: bool = False) -> Awaitable[bool]:
            return self.store.finish(
                task, state, attempt=attempt, entry_id=delivery.entry_id,
                result=done.result if done else None, error=error, error_code=code,
                output=done.output if done else None, again=again)

        try:
            try:
                stored = await self._until_stored(finish)
            except NotReplicated as short:
                stored = await self._until_replicated(finish, short)
        except StoreRefused:
            return  # logged and counted; the entry stays pending and is redelivered
        log.info("%s%s", state.value if stored else "stale attempt, dropped",
                 f" ({error})" if error else "")
        self.tasks_done += 1
        if stored:
            await self._record(task, state, started, batch_size,
                               done.result if done else None, observations, after_load)

    # --- tasks that share engine calls (workers/batching.py) ------------------------------

    async def _handle_together(self, deliveries: list[Delivery]) -> list[Delivery]:
        """Gathered entries: each group that can share a call runs as one batch. Those of
        the groups a stop leaves unstarted are returned."""
        engine = self.batch_engine
        assert engine is not None
        found: list[tuple[Task, Delivery]] = []
        for delivery in deliveries:
            task = await self.store.get(delivery.task_id) if delivery.task_id else None
            if task is None or task.state.terminal:
                await self.store.ack(delivery)
            else:
                found.append((task, delivery))
        groups = batching.group(
            found, lambda member: None if _crashed_before(member[0]) else batching.batch_key(
                engine, member[0].model, member[0].params, member[0].audio_seconds),
            self.settings.batch_max_size)
        ordered = batching.urgent_first(groups, lambda member: member[1].lane != BATCH)
        for index, members in enumerate(ordered):
            if self.stopping.is_set() or self.host.stalled:  # the rest go to the others
                return [delivery for group in ordered[index:] for _, delivery in group]
            # gathered batch entries that cannot share a call run one group after another:
            # interactive work that arrived meanwhile goes first, as it would had each been
            # read alone (docs/fairness.md)
            if all(delivery.lane == BATCH for _, delivery in members):  # (an interactive
                await self._interactive_first()  # member waits for no later arrival)
            if len(members) == 1:
                self.observations["batch_size"] = 1
                with logs.task_context(members[0][0].id):
                    await self._handle_task(*members[0])
            elif unstarted := await self._run_together(members):
                return unstarted + [delivery for group in ordered[index + 1:]
                                    for _, delivery in group]
        return []

    async def _interactive_first(self) -> None:
        if (run := await self._interactive_arrivals()) is not None:
            await run()

    async def _interactive_arrivals(self) -> Callable[[], Awaitable[None]] | None:
        """Interactive entries that arrived meanwhile, taken now: what runs them (first),
        or None when none came (or Redis is away: the gathered entries still run)."""
        if self.stopping.is_set():
            return None
        try:
            arrived = await self.store.take(INTERACTIVE, self.settings.batch_max_size)
        except RedisError:
            return None
        if not arrived:
            return None

        async def run() -> None:
            await self._taken(arrived)
            # their metrics are their own, and the batch they interrupt keeps its own
            saved = (self.observations, self.current_task, self.current_batch,
                     self.load_seconds, self.device_wait_seconds, self.load_observed)
            self.observations = {}
            try:
                await self._handle_leased(arrived)
            finally:
                (self.observations, self.current_task, self.current_batch,
                 self.load_seconds, self.device_wait_seconds, self.load_observed) = saved

        return run

    async def _run_together(self, members: list[tuple[Task, Delivery]]) -> list[Delivery]:
        """Tasks that may share engine calls. Each opens its own attempt only as its call
        begins (one cancelled or past its deadline before then never runs; a batch split
        to fit memory keeps its later calls' tasks queued meanwhile) and gets its own fenced
        terminal write; only the engine call is shared (the leases are the read's: `run`).
        Returns the entries left unstarted (by a stop, or a Redis error starting them): the
        caller gives them back."""
        model = members[0][0].model
        began = time.time()
        opened: dict[int, int] = {}  # index -> attempt
        unstarted: dict[int, Delivery] = {}  # left by a stop or a Redis error
        calls: dict[int, tuple[float, int]] = {}  # index -> (when its call began, its size)
        observed: dict[int, dict[str, float]] = {}  # a call's observations, with one task
        writes: dict[int, asyncio.Task[None]] = {}

        def settle(index: int, result: Outcome | TaskError) -> None:
            """Each task's terminal write as soon as its result is known (a split batch's
            first call does not wait for its last), written while the engine goes on."""
            if index in opened and index not in writes:
                task, delivery = members[index]
                started, size = calls.get(index, (began, 1))
                writes[index] = asyncio.create_task(self._settle_as(
                    task, opened[index], delivery, result, started, size,
                    observed.pop(index, {}), started > began))

        async def open_one(index: int) -> bool:
            task, delivery = members[index]
            if self.stopping.is_set():  # asked to stop: the other workers take it now
                unstarted[index] = delivery
                return False
            with logs.task_context(task.id):
                attempt = await self._open(task, delivery)
            if attempt is not None:
                opened[index] = attempt
            return attempt is not None

        async def prepare(indices: list[int]) -> list[tuple[int, batching.BatchItem]]:
            ready: list[tuple[int, batching.BatchItem]] = []
            for index in indices:
                task = members[index][0]
                try:
                    if not await open_one(index):
                        continue
                    ready.append((index, batching.BatchItem(
                        task.params, *await self._input(task, opened[index]),
                        self._top_up(task, opened[index]))))
                except TaskError as exc:
                    settle(index, exc)
                except RedisError as exc:  # given back to be taken again (by any worker)
                    log.warning("redis unavailable starting %s (%s); given back",
                                task.id, exc)
                    opened.pop(index, None)
                    unstarted[index] = members[index][1]
            if ready:
                log.info("batch of %d (%s), model %s", len(ready),
                         ", ".join(members[index][0].id for index, _ in ready), model)
                self.current_task, self.current_batch = members[ready[0][0]][0].id, len(ready)
                start = began if not calls else time.time()
                calls.update((index, (start, len(ready))) for index, _ in ready)
                observed[ready[0][0]] = {**self.observations, "batch_size": len(ready)}
                self.observations = {}
            return ready

        async def loaded(report: LoadReport) -> None:
            """A half-built load ends the process: every task of the batch is stored FAILED
            first (opened for it), so none is redelivered to crash the next worker."""
            try:
                if not report.ok and report.allocated:
                    for index in range(len(members)):
                        with contextlib.suppress(RedisError):  # (the exit comes regardless)
                            if index not in opened and await open_one(index):
                                await self.breakers.fail_loading_task(members[index][0],
                                                                      report.error)
            finally:
                await self._loaded(members[0][0], report)

        def call_done(indices: list[int], outcomes: list[Outcome | TaskError]) -> None:
            for index, outcome in zip(indices, outcomes, strict=True):
                settle(index, outcome)

        self.current_task, self.load_seconds, self.device_wait_seconds = (
            members[0][0].id, None, None)
        self.load_observed = False
        try:  # current until the last terminal write is done, as in _handle_task
            try:
                await self._admit(model)
                await self.host.execute_batch(
                    model, len(members), prepare, on_load=loaded,
                    audio_seconds=max((task.audio_seconds or 0.0 for task, _ in members),
                                      default=0.0),
                    on_call=call_done,
                    limit_seconds=call_limit(self.settings, self.host.kind,
                                             sum(task.work_units for task, _ in members)),
                    # before each later call of a batch-lane group: interactive work first
                    between=self._interactive_arrivals
                    if all(delivery.lane == BATCH for _, delivery in members) else None)
            except TaskError as exc:  # the breaker, the load or the cap: every task's
                for index in range(len(members)):  # (opened for it, as alone)
                    if index in unstarted:
                        continue
                    if self.host.stalled and index not in opened:  # a later call's: it never
                        unstarted[index] = members[index][1]  # ran, so another worker runs it
                        continue
                    try:
                        if index in opened or await open_one(index):
                            settle(index, exc)
                    except RedisError:  # pending still: taken again after the lease
                        unstarted[index] = members[index][1]
            for index in opened:
                settle(index, TaskError("no result"))
            await asyncio.gather(*writes.values(), return_exceptions=True)
            for written in writes.values():  # (what was settled is written, whatever broke)
                if (error := written.exception()) is not None:
                    raise error
        finally:
            self.current_task, self.current_batch = None, 0
        return list(unstarted.values())

    async def _settle_as(self, task: Task, attempt: int, delivery: Delivery,
                         result: Outcome | TaskError, started: float, batch_size: int,
                         observations: dict[str, float], after_load: bool) -> None:
        with logs.task_context(task.id):
            await self._settle(task, attempt, delivery, result, started, batch_size,
                               observations, after_load)

    # --- one task's parts -----------------------------------------------------------------

    async def _record(self, task: Task, state: TaskState, started: float,
                      batch_size: int = 1, result: dict[str, Any] | None = None,
                      call: dict[str, float] | None = None, after_load: bool = False) -> None:
        """Metrics for one finished task, with `call`'s (a batch call's; None: those kept
        for the next task) once; never allowed to fail the task. `after_load`: it started
        after its model's load (a later call of a batch). Its processing rate counts its
        share of a shared call's time, and the audio it decoded, not what its submit
        measured (a file can misstate its length to the probe, either way: the rate every
        predicted wait divides by must not)."""
        finished = time.time()
        inference = finished - started - (0.0 if after_load else (
            (self.load_seconds or 0.0) + (self.device_wait_seconds or 0.0)))
        if call is None:
            call, self.observations = self.observations, {}
        observations = {"queue_wait_seconds": started - task.created_at,
                        "end_to_end_seconds": finished - task.created_at,
                        "inference_seconds": inference, **call}
        if not self.load_observed:  # a load a batch shared is observed once
            self.load_observed = True
            if self.load_seconds is not None:
                observations["model_load_seconds"] = self.load_seconds
            if self.device_wait_seconds is not None:
                observations["device_wait_seconds"] = self.device_wait_seconds
        work = task.work_units
        decoded = ((result or {}).get("usage") or {}).get("audio_seconds")
        if self.host.kind != "tts" and isinstance(decoded, int | float) and decoded > 0:
            # audio-seconds: what was decoded, not what the file claimed to the probe (a
            # file can overstate its length as well as understate it)
            work = float(decoded)
        if state == TaskState.SUCCEEDED and self.host.kind != "tts" and work:
            observations["realtime_factor"] = inference / work
        with contextlib.suppress(RedisError):
            await self.store.record((f"tasks_{state.value}",),
                                    {name: max(0.0, value) for name, value in observations.items()})
            if state == TaskState.SUCCEEDED and work:
                # the processing rate a predicted wait divides by: work (audio-seconds, or
                # characters) per second of wall time, less a load
                await self.store.record_rate(task.model, work, inference / batch_size)

    async def _run_task(self, task: Task, attempt: int) -> Outcome:
        if task.params.get("diarization") is not None:
            await self._admit(DIARIZER)  # first: refused, it leaves the model's probe alone
        await self._admit(task.model)
        if (voice := task.params.get("custom_voice")) and not await self._voice_stands(task):
            raise TaskError(f"the custom voice {voice} was deleted, or its consent withdrawn, "
                            "before this task spoke", ErrorCode.INVALID_REQUEST)
        source, on_segment = await self._input(task, attempt)
        speech = await self._speech(task, attempt) if self.host.kind == "tts" else None
        return await self.host.execute(task.model, task.params, source, on_segment,
                                       on_load=functools.partial(self._loaded, task),
                                       speech=speech, audio_seconds=task.audio_seconds,
                                       on_decoded=self._top_up(task, attempt),
                                       limit_seconds=call_limit(self.settings, self.host.kind,
                                                                task.work_units))

    async def _admit(self, model: str) -> None:
        breaker_error = await self.breakers.admit(model)
        if breaker_error:
            raise TaskError(breaker_error, ErrorCode.MODEL_UNAVAILABLE)

    async def _input(self, task: Task,
                     attempt: int) -> tuple[Source | None, Callable[[Segment], None]]:
        """The task's input (TaskError when it has expired) and where its segments go."""
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
        # a segment counts as delivered (kept charged if the task fails later) only where a
        # stream sends it out: a whole reply's client gets nothing of a task that fails
        streamed = bool(task.params.get("streamed"))
        separator = getattr(self.host.engine, "segment_separator", "")
        texts_sent = 0

        def on_segment(segment: Segment) -> None:
            nonlocal texts_sent
            # Runs on the engine thread. Waiting for each publish keeps segments in order;
            # streaming is best effort, so a slow or absent Redis only skips the event.
            if loop.is_closed():  # a call that outlived its worker's loop (it was stuck)
                return
            event = {"type": "segment", "id": segment.id, "start": segment.start,
                     "end": segment.end, "text": segment.text,
                     "delta": stream_delta(segment.text, texts_sent, separator)}
            texts_sent += bool(segment.text)
            future = asyncio.run_coroutine_threadsafe(self.store.publish_segment(
                task.id, attempt, segment.end if streamed else 0.0, event), loop)
            with contextlib.suppress(Exception):
                future.result(timeout=1.0)

        return source, on_segment

    def _top_up(self, task: Task, attempt: int) -> OnDecoded | None:
        """Charge what a task's decoded audio holds past its charge (its file understated
        its length to the submit's probe), against the quotas its submit recorded: past one,
        the task FAILS quota_exceeded before its engine runs (and is charged nothing)."""
        charge = task.charge
        if not charge or charge.get("unit") != "audio_seconds":
            return None
        charged = float(charge.get("amount") or 0.0)
        loop = asyncio.get_running_loop()

        def decoded(seconds: float) -> None:  # on the engine thread
            if seconds <= charged + max(TOP_UP_SLACK_SECONDS, TOP_UP_SLACK_SHARE * charged):
                return
            asked = asyncio.run_coroutine_threadsafe(
                self.store.top_up(task.id, attempt, seconds), loop)
            try:
                refused = asked.result(timeout=TOP_UP_WAIT_SECONDS)
            except (RedisError, TimeoutError, concurrent.futures.CancelledError):
                asked.cancel()  # (a loop that stopped: the process is leaving)
                return  # settled to the decoded length at the finish, as before
            if refused is not None:
                raise TaskError(
                    f"the audio decodes to {seconds:.1f} s where its file declared "
                    f"{charged:.1f} s; the other {seconds - charged:.1f} s would take this key "
                    f"past its audio-seconds quota {refused.quota} ({refused.used:.1f} of "
                    f"{refused.limit:.1f} used)", ErrorCode.QUOTA_EXCEEDED)

        return decoded

    async def _voice_stands(self, task: Task) -> bool:
        """The task's custom voice and its consent still exist (checked before each piece is
        kept: a withdrawn consent speaks no more sentences); a Redis blip is no withdrawal."""
        try:
            return await self.store.voice_stands(task.owner, str(task.params["custom_voice"]),
                                                 str(task.params.get("consent")))
        except RedisError:
            return True

    async def _speech(self, task: Task, attempt: int) -> SpeechProgress:
        """Where a TTS task's pieces go as they are spoken, after those an earlier attempt
        stored (read after this attempt started: no stale one can append any more)."""
        done = await self._until_stored(lambda: self.store.speech_chunks(task.id))
        if done:
            log.info("resuming after %d stored pieces", len(done))
        loop = asyncio.get_running_loop()

        streamed = bool(task.params.get("streamed"))
        voice = task.params.get("custom_voice")
        spoken = list(done)  # every piece stored so far, by index: what a failover may lose

        def store(chunk: SpeechChunk) -> None:
            # Runs on the engine thread: each piece is durable before the next is spoken.
            # A lost Redis is waited out (as the terminal write would be); StaleAttempt
            # (another attempt owns the task now) ends this one. A piece counts as delivered
            # (kept charged if the task fails later) only where a stream sends it out.
            if voice and not asyncio.run_coroutine_threadsafe(
                    self._voice_stands(task), loop).result():
                raise TaskError(f"the custom voice {voice} was deleted, or its consent "
                                "withdrawn, while this task spoke", ErrorCode.INVALID_REQUEST)
            piece = chunk if streamed else dataclasses.replace(chunk, characters=0)
            try:
                asyncio.run_coroutine_threadsafe(self._until_stored(
                    lambda: self._append(task.id, attempt, spoken, piece)), loop).result()
            except StoreRefused as gave_up:  # an outage past its patience is no engine
                cause = gave_up.__cause__  # error: the entry goes back, to run again
                if isinstance(cause, RedisError) and store_unreachable(cause):
                    raise cause from None
                raise
            spoken.append(piece)

        return SpeechProgress(done, store)

    async def _append(self, task_id: str, attempt: int, spoken: list[SpeechChunk],
                      piece: SpeechChunk) -> None:
        """Store `piece` after `spoken`; the pieces a failover's new primary lacks (acked
        by the old one, never replicated) are stored again first, as this attempt's."""
        try:
            await self.store.append_chunk(task_id, attempt, piece)
        except PiecesLost as lost:
            log.warning("%d stored pieces were lost (a failover?); storing them again",
                        piece.index - lost.stored)
            for earlier in spoken[lost.stored:piece.index]:
                await self.store.append_chunk(task_id, attempt, earlier)
            await self.store.append_chunk(task_id, attempt, piece)

    async def _give_up(self, task: Task, entry_id: str, deliveries: int) -> None:
        crashed = deliveries - 1 - task.spared  # (graceful stops' deliveries not counted)
        reason = f"gave up after {crashed} deliveries: the worker died running this task"
        log.error("%s", reason)
        await self.store.dead_letter(task.id, reason, deliveries)
        with contextlib.suppress(NotReplicated):  # stored on the primary: not to be redone
            await self.store.finish(task, TaskState.FAILED, attempt=None, entry_id=entry_id,
                                    error=reason, error_code=ErrorCode.DELIVERY_LIMIT.value)
        with contextlib.suppress(RedisError):
            await self.store.record(("tasks_FAILED", "dead_lettered"))

    async def _keep_lease(self, deliveries: list[Delivery]) -> None:
        """Extend each entry's lease every heartbeat until it is acked (or taken)."""
        held = list(deliveries)
        while held:
            await asyncio.sleep(self.settings.heartbeat_seconds)
            for delivery in list(held):
                try:
                    lease = await self.store.extend_lease(delivery)
                except RedisError:
                    continue  # the janitor's visibility timeout is many heartbeats long
                if lease is Lease.TAKEN:
                    log.warning("lost the lease on %s to another worker", delivery.entry_id)
                if lease is not Lease.HELD:
                    held.remove(delivery)

    async def _until_stored(self, action: Callable[[], Awaitable[Any]]) -> Any:
        """`action`'s result, retried while Redis is unreachable (up to
        STORE_PATIENCE_SECONDS: a computed result is not thrown away lightly), and at most
        REFUSAL_TRIES times when Redis answers with an error. Giving up is logged and
        counted, and raises StoreRefused. NotReplicated passes through: the write is done."""
        delay, refusals = 0.2, 0
        give_up_at = time.monotonic() + STORE_PATIENCE_SECONDS
        while True:
            try:
                return await action()
            except NotReplicated:
                raise
            except RedisError as exc:
                # full (noeviction), or refusing while its disk fails: a wait, as an outage
                # is; a result dropped for it would be run again as if the worker had died
                if store_unreachable(exc) and time.monotonic() < give_up_at:
                    log.warning("redis unavailable (%s); retrying in %.1f s", exc, delay)
                elif not store_unreachable(exc) and (refusals := refusals + 1) < REFUSAL_TRIES:
                    log.warning("redis refused a write (%s); retrying in %.1f s", exc, delay)
                else:
                    log.error("giving up on a redis write after %s: %s",
                              "repeated refusals" if refusals else "the outage lasted "
                              f"{STORE_PATIENCE_SECONDS:.0f} s", exc)
                    await self._count("store_refusals")
                    raise StoreRefused(str(exc)) from exc
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    async def _until_replicated(self, finish: Callable[[bool], Awaitable[bool]],
                                short: NotReplicated) -> bool:
        """Whether the terminal write `finish` (which no replica confirmed: `short`) is
        stored. It is written again until a replica confirms it, for up to
        REPLICA_PATIENCE_SECONDS: in a switchover the node that took it may be demoted and
        lose it, and the new primary takes it again (the write is idempotent for its own
        attempt). Past that it stays on the primary, lost only if that dies before a replica
        catches up (then the entry is redelivered)."""
        stored = bool(short.result)
        give_up_at = time.monotonic() + REPLICA_PATIENCE_SECONDS
        while time.monotonic() < give_up_at:
            await asyncio.sleep(1.0)
            try:
                return bool(await self._until_stored(lambda: finish(True)))
            except NotReplicated as again:
                stored = stored or bool(again.result)
        log.warning("terminal write not confirmed by a replica: %s", short)
        await self._count("unreplicated_writes")
        return stored

    async def _count(self, counter: str) -> None:
        """One more of a worker-side counter on /metrics; Redis may well refuse it too."""
        with contextlib.suppress(RedisError):
            await self.store.record((counter,))

    async def _loaded(self, task: Task, report: LoadReport) -> None:
        """The host's report of the model `task` asked for: a load's time goes into the
        task's metrics, and the breaker rules decide the rest."""
        if report.ok and report.loaded and report.model == task.model:
            self.load_seconds = report.seconds  # for this task's metrics
            self.device_wait_seconds = report.device_wait_seconds
        await self.breakers.load_reported(task, report)


def _crashed_before(task: Task) -> bool:
    """Whether an attempt of `task` ended without a result and was not spared (a graceful
    stop's is): such a task runs alone, so that if its input kills the worker it does not
    take other keys' tasks with it each time, until SPEECH_MAX_DELIVERIES fails them all."""
    return task.attempt > task.spared
