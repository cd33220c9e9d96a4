"""This worker's reservation on its device's memory budget (the broker's worker side, see
common/store/devices.py): taken before a load, marked busy during a call, given back after
every unload, renewed, and yielded when the broker asks while the worker is idle."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from common.schemas import ErrorCode
from workers import memory
from workers.device_budget import PLAIN, DeviceBudget, PeakClass, peak_over, slack_ratio
from workers.execute import TaskError
from workers.models import ModelSlot

log = logging.getLogger("worker")
#: runs a function on the engine thread (EngineHost._call)
OnEngineThread = Callable[..., Awaitable[Any]]


class DeviceHolding:
    def __init__(self, budget: DeviceBudget, slot: ModelSlot, call: OnEngineThread,
                 uses_torch: bool, device: str) -> None:
        self.budget = budget
        self.slot = slot
        self.call = call
        self.uses_torch = uses_torch
        self.device = device
        self.held: str | None = None  # the model whose reservation this worker holds
        self.held_class = PLAIN  # … sized for tasks of this class (diarizer, length)
        self.reserved_mib = 0.0
        self._measuring = False  # the reservation knew no peak of its class: it measures
        self._short = False  # a task since measured a peak past the reservation
        self._peak_from: float | None = None  # MiB in use before the load being measured
        self.baseline_mib: float | None = None  # MiB in use before the held model loaded
        self._waited: float | None = None  # the last reservation's wait, for its LoadReport
        #: a release the broker did not take (Redis away): retried until it does, or the
        #: entry, marked busy and this process alive, would count against the device for ever
        self.release_owed = False

    def take_wait(self) -> float | None:
        """How long the last reservation waited in line (once; None without a broker)."""
        waited, self._waited = self._waited, None
        return waited

    async def reserve(self, model: str, peak_class: PeakClass = PLAIN) -> None:
        """Before `model` may load: hold a reservation for it on the device (waiting in line
        if need be), sized for tasks of `peak_class` (a diarized task also loads the
        diarizer; a long one holds more audio). A resident model only marks its reservation
        busy, or resizes it in place: for the task's class (a long task's audio is gone once
        it ends, so a reservation never stays at the longest class seen; a diarizer that is
        loaded stays counted), or for a peak a task measured past it."""
        if not self.budget.enabled or model not in self.slot.sources:
            return
        if self.held == model and self.slot.name == model and self.slot.handle is not None:
            # marked first, also before a resize in place: a resize rewrites the entry, and
            # would drop a waiting load's request that this one yield (it then waited out
            # this whole task, or failed device_busy)
            marked = await self.budget.mark(True)
            if marked == 1:
                loaded = self.held_class.diarizer if self.slot.diarizer_handle is not None else ""
                wanted = PeakClass(loaded or peak_class.diarizer, peak_class.length)
                if wanted != self.held_class or self._short:
                    await self._reserve_in_place(model, wanted)
                    await self.call(memory.reset_peak, self.uses_torch, self.device)
                return
            if marked == 2:  # a load waits for this memory: it goes first, this task after
                log.info("asked to yield device memory: unloading %s, then waiting in line",
                         model)
            else:  # the lease lapsed (a long stall, Redis lost it): no longer counted
                log.warning("the reservation for %s lapsed: unloading to reserve again", model)
        if self.slot.handle is not None:  # another model: out before waiting in line
            if self.slot.name != model and await self.call(self.slot.fails_precheck, model):
                return  # its load fails before allocating: the resident model stays
            await self.call(self.slot.unload)
        if self.held is not None or self.release_owed:  # (an owed one: its stale entry
            await self.budget.release()                 # would pass for a holding's growth)
            self.held, self.reserved_mib, self.release_owed = None, 0.0, False
        self.reserved_mib = await self.budget.reserve(model, peak_class)
        self.held, self.held_class, self._short = model, peak_class, False
        self._measuring = peak_class != PLAIN and not self.budget.last_measured
        self._waited = self.budget.last_wait_seconds
        self._peak_from = await self.call(memory.reset_peak, self.uses_torch,
                                           self.device)
        self.baseline_mib = self._peak_from

    async def grow(self, model: str, peak_class: PeakClass) -> None:
        """During an engine call (its engine thread waits on this): the task's decoded audio
        is of a heavier class than the declared length the reservation was made for (a
        container can understate it), so the reservation grows to cover it before the
        engine runs, and its peak is measured from the model's own load (as after a class
        change between calls)."""
        if not self.budget.enabled or self.held != model:
            return
        if (wanted := self.held_class.join(peak_class)) != self.held_class:
            await self._reserve_in_place(model, wanted)

    async def _reserve_in_place(self, model: str, wanted: PeakClass) -> None:
        """The resident model for another class: our own reservation is replaced; for a
        heavier one (or one not measured yet) its peak is measured from the model's own load.
        A lighter one measures nothing: memory a long task freed and the allocator kept
        would read as this light task's, and fail it for a peak it never had."""
        base, lighter = self.baseline_mib, wanted.join(self.held_class) == self.held_class
        self.reserved_mib = await self.budget.reserve(model, wanted)
        if lighter and self.budget.last_measured:  # (sized by its class's recorded peak)
            self.held_class, self._short = wanted, False
            return
        self.held_class, self._measuring = wanted, not self.budget.last_measured
        self._peak_from, self._short = base, False

    @property
    def measuring(self) -> bool:
        """A new load's peak is being measured (until its first call ends)."""
        return self._peak_from is not None

    def headroom_mib(self, used_mib: float) -> float | None:
        """What the reservation leaves with `used_mib` in use (None: no reservation)."""
        if self.held is None or self.reserved_mib <= 0 or self.baseline_mib is None:
            return None
        return self.reserved_mib - (used_mib - self.baseline_mib)

    async def check_peak(self, model: str, after_task: bool) -> None:
        """Measure the new load's peak (after the load, then after its first task): recorded,
        so the next reservation is right; one past its reservation is refused further work."""
        if self._peak_from is None or self.held != model or self.slot.name != model:
            return
        peak = await self.call(memory.peak_mib, self.uses_torch, self.device)
        peak -= self._peak_from
        if after_task:
            self._peak_from = None
            log.info("model %s peaked at %.0f MiB (reserved %.0f)", model, peak,
                     self.reserved_mib)
        # a reservation of 0 (no size known yet), or one for a class not measured yet, is a
        # measuring load: recorded, not refused
        over = (self.reserved_mib > 0 and not self._measuring
                and peak_over(peak, self.reserved_mib, self.device))
        if after_task or over:
            # refused after the load alone, the peak lacks a task's own memory (tiny.en on
            # cpu: 106 MiB loaded, 152 after jfk.flac), so the next reservation adds the slack
            # the check allows, or it is refused again after its first task
            recorded = peak if after_task else peak * (1 + slack_ratio(self.device))
            try:
                await self.budget.record_peak(model, recorded, self.held_class)
            except Exception as exc:
                log.warning("could not record the peak of %s: %s", model, exc)
            # a measuring reservation (a class not measured yet, a configured size) that the
            # peak outgrew: the model's next task reserves again, for what was measured
            self._short = recorded > self.reserved_mib
        if over:
            self._peak_from, reserved = None, self.reserved_mib
            await self.call(self.slot.unload)
            await self.settle()
            raise TaskError(f"model {model!r} uses {peak:.0f} MiB of {self.device}, more than "
                            f"its {reserved:.0f} MiB reservation: refused, and the "
                            "peak recorded so its next load reserves enough (or set "
                            "SPEECH_MODEL_MEMORY_MIB)", ErrorCode.OUT_OF_MEMORY)

    async def settle(self) -> None:
        """After an engine call or an unload: give back a reservation whose model is gone,
        else mark it idle (a candidate to yield). Never fails the call."""
        if self.held is None:
            return
        try:
            if self.slot.handle is None:
                self.held, self.reserved_mib, self._peak_from = None, 0.0, None
                self.baseline_mib = None
                self.release_owed = True
                await self.budget.release()
                self.release_owed = False
            elif not await self.budget.mark(False):
                log.warning("the reservation for %s lapsed", self.held)
        except Exception as exc:
            log.warning("device broker unavailable (%s)%s", exc,
                        "; the release is retried" if self.release_owed else "")

    async def keep(self, lock: asyncio.Lock) -> None:
        """Runs for ever (broker on): renew the lease, and yield the model when asked while
        idle (`lock` is the engine's: held, a call is running); a reservation that lapsed
        while idle is no longer counted, so the model goes."""
        while True:
            await asyncio.sleep(self.budget.poll_seconds)
            if self.release_owed and self.held is None and not lock.locked():
                async with lock:  # (no call may reserve meanwhile: its entry would go)
                    if self.release_owed and self.held is None:
                        with contextlib.suppress(Exception):
                            await self.budget.release()
                            self.release_owed = False
                            log.info("the owed release of device memory is done")
            if self.held is None or lock.locked():
                if self.held is not None:
                    with contextlib.suppress(Exception):
                        await self.budget.renew()
                continue
            try:
                answer = await self.budget.renew()
            except Exception:
                continue
            if answer == 1 or lock.locked():
                continue
            async with lock:
                if self.held is None or (answer == 2 and await self.budget.renew() != 2):
                    continue
                log.info("%s: unloading %s", "asked to yield device memory" if answer == 2
                         else "reservation lapsed", self.held)
                await self.call(self.slot.unload)
                await self.settle()
