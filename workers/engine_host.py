"""The engine side of a worker: one resident model, one engine thread, one engine call at a
time, the memory cap and idle unload, for every engine.

It knows nothing of Redis, tasks or breakers. Whoever calls it (the queue consumer, the
direct HTTP server) hears of every model acquisition through an `on_load` callback, a
`LoadReport`, and decides what a failed load means for the process.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import contextvars
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from redis.exceptions import RedisError

from common.catalog import BACKENDS
from common.schemas import DIARIZER, ErrorCode, Segment
from common.settings import Settings
from common.store.connection import store_unreachable
from workers import batching, memory
from workers.device_budget import NO_BUDGET, DeviceBudget, PeakClass
from workers.device_holding import DeviceHolding
from workers.diarize import Diarizer
from workers.engines.base import Engine
from workers.execute import (
    OnDecoded,
    Outcome,
    Source,
    SpeechProgress,
    TaskError,
    run_engine,
    task_error,
)
from workers.models import (
    DiarizerLoadFailed,
    LoadFailed,
    LoadReport,
    ModelSlot,
    OnLoad,
    SourceUnusable,
)

log = logging.getLogger("worker")
T = TypeVar("T")
#: makes the tasks of these indices ready to run (opens their attempts): the items of those
#: that are (one cancelled, past its deadline, or failed on its input is left out)
Prepare = Callable[[list[int]], Awaitable[list[tuple[int, batching.BatchItem]]]]
#: what must run before a batch's next call (taken already), or None: nothing
Between = Callable[[], Awaitable[Callable[[], Awaitable[None]] | None]]


async def _no_report(report: LoadReport) -> None:
    del report


#: an engine call's bound when SPEECH_MAX_ENGINE_CALL_SECONDS is 0: this much, plus
#: CALL_SECONDS_PER_WORK_SECOND for each second of the call's audio (TTS: of speech, at
#: SPOKEN_CHARACTERS_PER_SECOND), far past any engine's real time on a CPU
CALL_FLOOR_SECONDS, CALL_SECONDS_PER_WORK_SECOND = 600.0, 20.0
SPOKEN_CHARACTERS_PER_SECOND = 10.0
STALLED = "this worker's engine is stuck in an earlier call; the worker is restarting"


def call_limit(settings: Settings, kind: str, work: float) -> float | None:
    """The longest an engine call of `work` (audio-seconds; TTS: characters) may run; None:
    no bound (SPEECH_MAX_ENGINE_CALL_SECONDS below 0)."""
    if settings.max_engine_call_seconds < 0:
        return None
    if settings.max_engine_call_seconds > 0:
        return settings.max_engine_call_seconds
    seconds = work / SPOKEN_CHARACTERS_PER_SECOND if kind == "tts" else work
    return CALL_FLOOR_SECONDS + CALL_SECONDS_PER_WORK_SECOND * seconds


class CallBound:
    """An engine call's running bound: `call_limit` of the work the task declared, raised
    when its audio decodes longer (a file can claim a fraction of its length to the probe;
    the bound follows what it holds, as its charge does)."""

    def __init__(self, settings: Settings, seconds: float) -> None:
        self.settings, self.seconds = settings, seconds

    def decoded(self, audio_seconds: float) -> None:
        """Called on the engine thread with one clip's decoded length."""
        if (limit := call_limit(self.settings, "asr", audio_seconds)) is not None:
            self.seconds = max(self.seconds, limit)


class EngineHost:
    def __init__(self, settings: Settings, engine: Engine, on_load: OnLoad = _no_report,
                 budget: DeviceBudget = NO_BUDGET) -> None:
        self.settings = settings
        self.backend = settings.backend
        self.kind = BACKENDS[self.backend].kind  # "asr", "tts" or "analysis"
        self.engine = engine
        self.device = _resolve_device(settings.device, engine)
        row = BACKENDS[self.backend]
        diarizer = (Diarizer(settings.diarization_model, settings.diarization_name_threshold)
                    if row.diarization and not row.speakers else None)
        self.slot = ModelSlot(engine, self.device, settings.backend_models(self.backend),
                              diarizer)
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="engine")
        self.lock = asyncio.Lock()  # one engine call at a time: queue and direct HTTP
        self.running_calls = 0  # engine calls in progress (queue or direct HTTP): "busy"
        self.on_load = on_load  # for calls that bring none (direct HTTP, preload)
        #: length class -> the most MiB a clip of it added to a batch call (measured)
        self.learned_item_mib: dict[int, float] = {}
        self.last_batch_calls: list[int] = []  # the sizes of the last batch's engine calls
        # the device memory broker: a reservation before every load, back after every unload
        self.holding = DeviceHolding(budget, self.slot, self._call, engine.uses_torch,
                                     self.device)
        #: an engine call ran past its bound (`call_limit`) and never returned: its thread is
        #: stuck (a driver call), so nothing may run on it again; the worker leaves
        self.stalled = False

    @property
    def busy(self) -> bool:
        return self.lock.locked()

    @property
    def sources(self) -> dict[str, str]:
        """The configured models: name -> source."""
        return self.slot.sources

    async def start(self) -> None:
        """Before any model: bound torch's share of the GPU; make the device's budget seen."""
        if self.device == "cuda" and self.torch_here and self.settings.memory_cap_mib > 0:
            await self._call(memory.apply_torch_cap, self.settings.memory_cap_mib)
        with contextlib.suppress(Exception):  # Redis not up yet: the first reserve registers
            await self.holding.budget.register()
            # A fresh image holds nothing: an entry under this worker's name is one an image
            # before a re-exec could not release (Redis away), which no neighbour purges (the
            # pid lives on): the card's budget stayed short of it until this worker loaded.
            await self.holding.budget.release()

    async def preload(self, model: str, on_load: OnLoad | None = None) -> None:
        async with self.lock:
            with contextlib.suppress(TaskError):  # already reported through on_load
                await self.holding.reserve(model)
                await self._acquire(model, on_load or self.on_load)
                await self.holding.check_peak(model, after_task=False)
            await self.holding.settle()

    async def execute(self, model: str, params: dict[str, Any], source: Source | None,
                      on_segment: Callable[[Segment], None],
                      on_load: OnLoad | None = None,
                      speech: SpeechProgress | None = None,
                      audio_seconds: float | None = None,
                      on_decoded: OnDecoded | None = None,
                      limit_seconds: float | None = None) -> Outcome:
        """Load `model` if needed and run one engine call, serialised with every other;
        a TaskError says why it failed. `speech`: see workers.execute.SpeechProgress;
        `audio_seconds`: the task's length as known before decoding (its memory class);
        `on_decoded`: told the decoded length (see workers.execute.OnDecoded);
        `limit_seconds`: the longest the call may run (`call_limit`; None: no bound)."""
        diarize = params.get("diarization") is not None
        bound = self._bound(limit_seconds)
        decoded = self._on_decoded(model, diarize, on_decoded, bound)

        async def run(handle: Any) -> Outcome:
            return await self._bounded(
                bound, run_engine, self.engine, handle, backend=self.backend, model=model,
                params=params, source=source, on_segment=on_segment,
                max_audio_seconds=self.settings.max_audio_seconds,
                allowed_roots=tuple(self.settings.allowed_roots),
                diarizer=self.slot.diarization(), speech=speech, on_decoded=decoded,
                max_speech_seconds=self.settings.tts_max_output_seconds)

        return await self._engine_call(model, on_load, run,
                                       self._peak_class(diarize, audio_seconds))

    async def execute_batch(self, model: str, count: int, prepare: Prepare,
                            on_load: OnLoad | None = None,
                            audio_seconds: float | None = None,
                            on_call: Callable[[list[int], list[Outcome | TaskError]], object]
                            | None = None, limit_seconds: float | None = None,
                            between: Between | None = None) -> None:
        """`execute` for `count` tasks that share calls (workers/batching.py). The batch is
        split into calls that fit the memory cap and the device reservation, and each
        call's tasks are `prepare`d (their attempts opened) only as that call begins: one
        that waits for a later call is still queued (a cancel or its deadline still stops
        it). A clip that leaves its call (`batching.Longer`), or whose shared call failed for
        it (`batching.Again`), runs alone after it. `on_call` gets each call's outcomes (with
        their indices) as soon as it returns. Before each call after the first, `between`
        takes the work that must run first (the consumer's interactive arrivals: a split
        batch, or a lying clip's run alone, puts no serial work ahead of it); when there is
        some, the batch lets go of the engine, that work runs, and the batch takes the
        engine again. Without any it keeps the engine (and its model: no idle unload or
        yield between its calls). A TaskError raised here (a load, the cap) is every task's
        whose call had not returned. `audio_seconds`: the longest clip's length (the calls'
        memory class)."""
        engine = batching.batch_engine(self.engine, self.settings)
        assert engine is not None
        left, sizes = list(range(count)), []
        alone: list[tuple[int, batching.BatchItem]] = []  # left their call: one by one

        def told(item: batching.BatchItem, bound: CallBound | None) -> batching.BatchItem:
            return dataclasses.replace(
                item, on_decoded=self._on_decoded(model, False, item.on_decoded, bound))

        first_work: list[Callable[[], Awaitable[None]]] = []  # taken by `between`: run next

        async def calls(handle: Any) -> bool:  # (what _engine_call returns: not None)
            """The calls left, in one hold of the engine, until `between` finds work that
            must go first."""
            ran = False
            while left or alone:
                if ran and between is not None and (work := await between()) is not None:
                    first_work.append(work)
                    break
                await next_call(handle)
                ran = True
            return True

        async def next_call(handle: Any) -> None:
            if alone:
                index, item = alone.pop(0)
                bound = self._bound(limit_seconds)
                results = await self._bounded(bound, self._run_batch, engine, handle, model,
                                              [told(item, bound)], None)
                if on_call is not None:
                    on_call([index], [result for result in results
                                      if not isinstance(result, batching.Longer)])
                return
            chosen: list[tuple[int, batching.BatchItem]] = []
            while left and not chosen:  # each call sized by what the last one measured
                size = batching.next_call(len(left), self.batch_item_mib(audio_seconds),
                                          await self._call(self._batch_headroom))
                while left and len(chosen) < size:  # (a task cancelled meanwhile: the next)
                    taken, left[:] = left[:size - len(chosen)], left[size - len(chosen):]
                    chosen += await prepare(taken)
            if not chosen:
                return
            sizes.append(len(chosen))
            bound = self._bound(limit_seconds, len(chosen))
            outcomes = await self._bounded(bound, self._run_batch, engine, handle, model,
                                           [told(item, bound) for _, item in chosen],
                                           audio_seconds)
            done = [(index, outcome) for (index, _), outcome in zip(chosen, outcomes,
                                                                    strict=True)
                    if not isinstance(outcome, batching.Longer)]
            if on_call is not None:
                on_call([index for index, _ in done], [outcome for _, outcome in done])
            alone.extend(member for member, outcome in zip(chosen, outcomes, strict=True)
                         if isinstance(outcome, batching.Longer))

        peak_class = self._peak_class(False, audio_seconds)
        await self._engine_call(model, on_load, calls, peak_class)
        while first_work:
            await first_work.pop()()
            await self._engine_call(model, on_load, calls, peak_class)
        if len(sizes) > 1:
            log.info("a batch of %d split to fit memory: calls of %s", sum(sizes), sizes)
        self.last_batch_calls = sizes

    def _bound(self, limit_seconds: float | None, clips: int = 1) -> CallBound | None:
        """The running bound of a call of `clips` tasks' clips. A fixed
        SPEECH_MAX_ENGINE_CALL_SECONDS bounds one task's call, so a batched call gets it
        once per clip (the default bound already follows the call's whole work)."""
        if limit_seconds is None:
            return None
        if self.settings.max_engine_call_seconds > 0:
            limit_seconds *= max(1, clips)
        return CallBound(self.settings, limit_seconds)

    def _on_decoded(self, model: str, diarize: bool, told: OnDecoded | None,
                    bound: CallBound | None = None) -> OnDecoded:
        """What the engine thread calls with a task's decoded length: `told` (the caller's:
        its charge), then the call's bound and the reservation grow if the length is past
        what they were made for."""
        loop = asyncio.get_running_loop()

        def decoded(seconds: float) -> None:
            if told is not None:
                told(seconds)
            if bound is not None:
                bound.decoded(seconds)
            if not self.holding.budget.enabled:
                return
            growing = asyncio.run_coroutine_threadsafe(
                self.holding.grow(model, self._peak_class(diarize, seconds)), loop)
            try:  # a reservation may wait its turn: device_wait_seconds, then device_busy
                growing.result(timeout=self.settings.device_wait_seconds + 60)
            except (TimeoutError, concurrent.futures.CancelledError):
                growing.cancel()  # (a loop that stopped: the process is leaving)
                raise TaskError("the device reservation could not grow to this audio's "
                                "length in time", ErrorCode.DEVICE_BUSY) from None

        return decoded

    def _peak_class(self, diarize: bool, audio_seconds: float | None) -> PeakClass:
        diarizer = self.slot.diarizer
        which = ("pyannote" if diarizer.is_pyannote else "diarized") if diarize and diarizer else ""
        return PeakClass.of(which, audio_seconds)

    async def _engine_call(self, model: str, on_load: OnLoad | None,
                           run: Callable[[Any], Awaitable[T]], peak_class: PeakClass) -> T:
        """`peak_class` names the diarizer the call loads, if any (and sizes its memory)."""
        if self.stalled:  # (a direct HTTP call, while the worker leaves)
            raise TaskError(STALLED, ErrorCode.ENGINE_ERROR)
        async with self.lock:
            self.running_calls += 1
            outcome: T | None = None
            failure: TaskError | RedisError | None = None
            try:
                await self.holding.reserve(model, peak_class)
                handle = await self._acquire(model, on_load or self.on_load,
                                             diarize=bool(peak_class.diarizer))
                await self.holding.check_peak(model, after_task=False)
                await self._call(self._refuse_over_cap)
                outcome = await run(handle)
            except Exception as exc:
                # Redis out of reach (a failover) or full, for the device broker, is no fault
                # of the task's: not failed (a full Redis's read as "GPU memory limit"), its
                # entry is given back by the consumer, to run again
                failure = exc if store_unreachable(exc) else task_error(exc)
            if self.stalled:  # the engine thread is taken for good: nothing more runs on it
                self.running_calls -= 1
                assert failure is not None
                raise failure
            # Past the except block the engine's exception is gone, and with its traceback
            # the tensors its frames held: only now can releasing memory return them.
            handle = None
            self.slot.touch()  # idle from the call's end: a long task's model stays for the next
            try:
                # the peak first, while the model is still loaded: an unload after each task
                # (idle unload 0) or past the cap (below) would leave it never recorded, and
                # a model of no known size reserving 0 MiB for ever
                with contextlib.suppress(TaskError):  # the task's outcome stands
                    await self.holding.check_peak(model, after_task=True)
                await self._call(self._after_engine_call)
                await self.holding.settle()
            finally:
                self.running_calls -= 1
            if failure is not None:
                raise failure
            assert outcome is not None
            return outcome

    def _batch_headroom(self) -> float | None:
        """MiB a batch may add: what the memory cap and the device reservation leave."""
        used = memory.used_mib(memory.snapshot(self.engine.uses_torch, self.device),
                               self.device)
        room = [self.settings.memory_cap_mib - used] if self.settings.memory_cap_mib > 0 else []
        if (reserved := self.holding.headroom_mib(used)) is not None:
            room.append(reserved)
        return min(room) if room else None

    def _run_batch(self, engine: Any, handle: Any, model: str, items: list[batching.BatchItem],
                   probed_seconds: float | None) -> list[Outcome | TaskError | batching.Longer]:
        """One call of a batch (engine thread); its peak teaches `batch_item_mib`, except
        on a new load's first call, whose peak the device holding is measuring."""
        learn = len(items) > 1 and not self.holding.measuring
        before = memory.reset_peak(self.engine.uses_torch, self.device) if learn else 0.0
        results = batching.run_batch(
            engine, handle, backend=self.backend, model=model, items=items,
            max_audio_seconds=self.settings.max_audio_seconds,
            allowed_roots=tuple(self.settings.allowed_roots), probed_seconds=probed_seconds)
        if learn:
            grown = memory.peak_mib(self.engine.uses_torch, self.device) - before
            # the most measured: a call that fitted in memory already held (the CUDA
            # cache, what glibc kept) measures ~0, which says nothing of the next one
            ran = sum(isinstance(result, batching.Again)  # (it was in the call)
                      or not isinstance(result, batching.Longer) for result in results)
            # per length class: one batch of long clips would else shrink every later call
            # of short ones, for as long as the process lives
            length_class = batching.length_class(probed_seconds)
            self.learned_item_mib[length_class] = max(
                self.learned_item_mib.get(length_class, 0.0), max(0.0, grown) / max(1, ran))
        return results

    def batch_item_mib(self, audio_seconds: float | None) -> float | None:
        """MiB a clip of `audio_seconds`'s length class adds to a batch call: the setting,
        or the most a batch call of that class measured; None while neither is known."""
        learned = self.learned_item_mib.get(batching.length_class(audio_seconds))
        if self.settings.batch_item_mib > 0:
            return max(self.settings.batch_item_mib, learned or 0.0)
        return learned

    async def _acquire(self, model: str, on_load: OnLoad, diarize: bool = False) -> Any:
        loads_before, diarizer_loads_before = self.slot.loads, self.slot.diarizer_loads
        source = self.slot.sources.get(model, "")
        try:
            handle = await self._call(self.slot.acquire, model, diarize)
        except KeyError as exc:
            raise TaskError(str(exc.args[0]), ErrorCode.INVALID_REQUEST) from None
        except SourceUnusable as exc:  # found before anything was allocated
            report = LoadReport(model, source, ok=False, error=str(exc))
        except DiarizerLoadFailed as exc:  # the diarizer's breaker, not the model's
            report = LoadReport(DIARIZER, self.settings.diarization_model, ok=False,
                                allocated=True, error=str(exc))
        except LoadFailed as exc:
            report = LoadReport(model, source, ok=False, allocated=True, error=str(exc))
        else:
            loaded = self.slot.loads > loads_before
            waited = self.holding.take_wait() if loaded else None
            await on_load(LoadReport(model, source, ok=True, loaded=loaded,
                                     seconds=self.slot.last_load_seconds if loaded else 0.0,
                                     device_wait_seconds=waited))
            if diarize:  # loaded now or before: either closes a half-open breaker it probes
                await on_load(LoadReport(
                    DIARIZER, self.settings.diarization_model, ok=True,
                    loaded=self.slot.diarizer_loads > diarizer_loads_before))
            return handle
        # Reported outside the except block: a caller that ends the process after a failed
        # load waits there, and must not hold the exception (or its frames) meanwhile.
        await on_load(report)
        raise TaskError(report.error, ErrorCode.MODEL_LOAD_FAILED)

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

    @property
    def torch_here(self) -> bool:
        """torch runs in this process: the engine's, or a pyannote diarizer beside an engine
        without it (faster-whisper's CTranslate2), whose cache must be emptied as well."""
        diarizer = self.slot.diarizer
        return self.engine.uses_torch or bool(diarizer and diarizer.is_pyannote)

    def _after_engine_call(self) -> None:
        memory.release(self.torch_here)
        if self.settings.idle_unload_seconds == 0:
            self.slot.unload()
        elif (used := self._memory_over_cap()) is not None:
            log.warning("memory %.0f MiB over the %d MiB cap: unloading", used,
                        self.settings.memory_cap_mib)
            self.slot.unload()

    async def keep_reservation(self) -> None:
        """Runs for ever (broker on): see DeviceHolding.keep."""
        await self.holding.keep(self.lock)

    async def unload_when_idle(self) -> None:
        """Return once the model, unused for `idle_unload_seconds` (> 0), is unloaded (what
        follows an idle unload is the runtime's: workers/runtime.py)."""
        idle_limit = self.settings.idle_unload_seconds
        while True:
            await asyncio.sleep(min(1.0, idle_limit / 4))
            if self.slot.handle is None or self.lock.locked():
                continue
            if self.slot.idle_for() >= idle_limit:
                async with self.lock:
                    if self.slot.idle_for() >= idle_limit:
                        log.info("idle for %.0f s: unloading", self.slot.idle_for())
                        await self._call(self.slot.unload)
                        await self.holding.settle()
                        return

    async def _bounded(self, bound: CallBound | None, fn: Callable[..., T], *args: Any,
                       **kwargs: Any) -> T:
        """`_call` for an engine call: past its `bound` (None: none) the call is taken for
        stuck (nothing can stop a thread inside a driver call), the host `stalled`, and a
        TaskError fails its tasks."""
        if bound is None:
            return await self._call(fn, *args, **kwargs)
        loop = asyncio.get_running_loop()
        started = loop.time()
        call = asyncio.ensure_future(self._call(fn, *args, **kwargs))
        try:
            while (left := started + bound.seconds - loop.time()) > 0:  # (it may grow)
                done, _ = await asyncio.wait({call}, timeout=left)
                if call in done:
                    return call.result()
        except asyncio.CancelledError:  # as an awaited call would be, with its caller
            call.cancel()
            raise
        if call.done():
            return call.result()
        limit_seconds = bound.seconds
        self.stalled = True
        log.critical("the engine call has run %.0f s, past its bound, and not returned: "
                     "the worker leaves so that a fresh process takes the work", limit_seconds)
        raise TaskError(f"the engine call ran past {limit_seconds:.0f} s "
                        "(SPEECH_MAX_ENGINE_CALL_SECONDS) without returning; its worker "
                        "restarted", ErrorCode.ENGINE_ERROR)

    async def _call(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Run on the engine thread, carrying the task id into its log lines."""
        context = contextvars.copy_context()
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.executor,
                                          lambda: context.run(fn, *args, **kwargs))

    def health(self) -> dict[str, Any]:
        """The engine side of the worker's /health snapshot."""
        if self.slot.loading:
            state = "loading"
        elif self.running_calls:
            state = "busy"
        else:
            state = "ready" if self.slot.handle is not None else "idle"
        return {
            "state": state,
            "device": self.device,
            "loaded_models": self.slot.loaded_models,
            "diarizer_loaded": self.slot.diarizer_handle is not None,
            "last_used": self.slot.last_used,
            "memory": memory.snapshot(self.engine.uses_torch, self.device),
            "memory_cap_mib": self.settings.memory_cap_mib,
            "idle_unload_seconds": self.settings.idle_unload_seconds,
            "device_id": self.holding.budget.device_id,
            "device_reserved_mib": self.holding.reserved_mib,
            "batch": batching.describe(self.engine, self.settings),
        }


class NoCuda(RuntimeError):
    """SPEECH_DEVICE=cuda where the engine sees no CUDA device: the worker does not start
    (a GPU pod whose driver, device plugin or torch build is wrong would else hold its GPU
    and run every model on the CPU, slowly, past its memory limit)."""


def _resolve_device(setting: str, engine: Engine) -> str:
    if setting == "auto":
        return "cuda" if engine.cuda_available() else "cpu"
    if setting == "cuda" and not engine.cuda_available():
        raise NoCuda("SPEECH_DEVICE=cuda, but this worker's engine sees no CUDA device (a "
                     "driver, device plugin or CPU-only torch build?); SPEECH_DEVICE=auto "
                     "falls back to the CPU")
    return setting
