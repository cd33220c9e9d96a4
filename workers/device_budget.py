"""A worker's share of its device's memory, through the broker in Redis
(`common/store/devices.py`): the engine host reserves before every load, marks each engine
call's start and end, gives the reservation back after every unload, and renews its lease.

The host sees only this interface (`DeviceBudget`), never Redis. `NO_BUDGET` is the broker
switched off (no budget set on cpu, or none known on cuda): every call is free.
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import os
import socket
import time
from dataclasses import dataclass

from common.schemas import ErrorCode
from common.settings import Settings
from common.store import WorkerStore
from workers import processes
from workers.execute import TaskError

log = logging.getLogger("worker.device")

#: a measured peak this much over its reservation (and at least PEAK_SLACK_MIB) is refused;
#: on cpu the peak is the whole process's RSS high-water mark, which moves by ~10 % between
#: runs of one model (allocator arenas, other threads), so it gets more room
PEAK_SLACK_RATIO = {"cuda": 0.10, "cpu": 0.25}
PEAK_SLACK_MIB = 8.0
#: the head of the line asks busy holders to yield (each after its call) once it has waited
#: this share of SPEECH_DEVICE_WAIT_SECONDS (idle ones at once): a holder with a steady queue
#: is busy call after call, and another backend's task would wait out its bound and fail
BUSY_YIELD_SHARE = 0.25
#: audio seconds that bound a peak's length classes: a task up to the first is plain; the
#: decoded audio (64 KB a second), a window's activations and the diarizer's embeddings grow
#: with length, so longer tasks are measured, and reserved for, apart
LENGTH_CLASSES = (120.0, 600.0, 1800.0)


@dataclass(frozen=True, slots=True)
class PeakClass:
    """What a task's memory peak depends on besides its model: the diarizer it loads ("" none)
    and its audio's length class (0 plain, else an index past `LENGTH_CLASSES`' bounds)."""

    diarizer: str = ""
    length: int = 0

    @classmethod
    def of(cls, diarizer: str = "", audio_seconds: float | None = None) -> PeakClass:
        length = bisect.bisect_left(LENGTH_CLASSES, audio_seconds or 0.0)
        return cls(diarizer, length)

    @property
    def name(self) -> str:
        """The peak's field suffix: "" plain, "diarized", "len2", "diarized+len1" …"""
        return "+".join(part for part in
                        (self.diarizer, f"len{self.length}" if self.length else "") if part)

    @property
    def lighter(self) -> PeakClass:
        """What a class not measured yet starts from: the same diarizer at plain length, or
        (for that) the plain class."""
        return PeakClass(self.diarizer, 0) if self.length else PLAIN

    def join(self, other: PeakClass) -> PeakClass:
        """The class a reservation needs to serve tasks of both."""
        return PeakClass(self.diarizer or other.diarizer, max(self.length, other.length))


PLAIN = PeakClass()  # no diarizer, up to the first length bound


class DeviceBudget:
    """The broker switched off: nothing is reserved, nothing waits, nothing is asked."""

    enabled = False
    device_id = ""
    budget_mib = 0
    last_wait_seconds = 0.0  # how long the last reserve waited in line
    poll_seconds = 1.0  # how often the holder renews its lease and checks for a yield request

    async def register(self) -> None:
        return None

    last_measured = True  # the last reservation knew its class's peak (else it measures one)

    async def reserve(self, model: str, peak_class: PeakClass = PLAIN) -> float:
        """Wait for `model`'s need (for tasks of `peak_class`) to fit;
        its MiB. TaskError: device_busy after waiting `device_wait_seconds`, out_of_memory
        when it can never fit."""
        del model, peak_class
        return 0.0

    async def mark(self, busy: bool) -> int:
        """An engine call starts (busy) or ends: 1; 2 when the broker asks this holder to
        yield; 0 when no reservation is held any more."""
        del busy
        return 1

    async def release(self) -> None:
        return None

    async def renew(self) -> int:
        """2: holding and asked to yield; 1: holding; 0: holding nothing."""
        return 1

    async def record_peak(self, model: str, mib: float, peak_class: PeakClass = PLAIN) -> None:
        del model, mib, peak_class


NO_BUDGET = DeviceBudget()


class BrokeredBudget(DeviceBudget):
    enabled = True

    def __init__(self, settings: Settings, store: WorkerStore, device_id: str,
                 budget_mib: int) -> None:
        self.settings = settings
        self.backend = settings.backend
        self.device_id = device_id
        self.budget_mib = budget_mib
        self.poll_seconds = settings.device_poll_seconds
        self.ledger = store.device_ledger(device_id)
        self.process = processes.identity()

    async def register(self) -> None:
        await self.ledger.register(self.budget_mib)

    async def reserve(self, model: str, peak_class: PeakClass = PLAIN) -> float:
        settings = self.settings
        need = settings.model_memory(self.backend, model)
        deadline = time.monotonic() + settings.device_wait_seconds
        started, place = time.monotonic(), 0.0
        reserved = False
        try:
            while True:
                answer = await self.ledger.reserve(self.backend, model, need, self.budget_mib,
                                                   settings.device_lease_seconds,
                                                   peak_class.name,
                                                   settings.device_peak_max_age_seconds,
                                                   self.process, await self._alive_holders(),
                                                   peak_class.lighter.name,
                                                   settings.device_wait_seconds
                                                   * BUSY_YIELD_SHARE)
                self.last_measured = answer.measured
                if answer.reserved:
                    reserved = True
                    waited = self.last_wait_seconds = time.monotonic() - started
                    if waited > settings.device_poll_seconds:
                        log.info("reserved %.0f MiB of %s for %s after waiting %.1f s",
                                 answer.need, self.device_id, model, waited)
                    return answer.need
                if answer.never_fits:
                    raise TaskError(
                        f"model {model!r} needs {answer.need:.0f} MiB, more than the whole "
                        f"{answer.value:.0f} MiB budget of device {self.device_id}: raise "
                        "SPEECH_DEVICE_MEMORY_MIB or lower its SPEECH_MODEL_MEMORY_MIB (a "
                        "measured peak past the budget is measured again after "
                        "SPEECH_DEVICE_LEASE_SECONDS)", ErrorCode.OUT_OF_MEMORY)
                if answer.value != place:
                    place = answer.value
                    log.info("waiting for %.0f MiB of %s for %s (place %d in line)",
                             answer.need, self.device_id, model, place)
                if time.monotonic() >= deadline:
                    raise TaskError(
                        f"model {model!r} waited {settings.device_wait_seconds:.0f} s for "
                        f"{answer.need:.0f} MiB of device {self.device_id} (budget "
                        f"{self.budget_mib} MiB) and none came free: every holder was busy "
                        "(SPEECH_DEVICE_WAIT_SECONDS)", ErrorCode.DEVICE_BUSY)
                await asyncio.sleep(settings.device_poll_seconds)
        finally:
            if not reserved:  # failed, timed out or cancelled: out of the line
                await asyncio.shield(self.ledger.leave_line())

    async def _alive_holders(self) -> list[str]:
        """Holders whose processes still exist here: their reservations stand, renewed or not."""
        holders = await self.ledger.holder_processes()
        return [name for name, process in holders.items()
                if name != self.ledger.consumer and process and processes.alive(process)]

    async def mark(self, busy: bool) -> int:
        return await self.ledger.mark(busy, self.settings.device_lease_seconds)

    async def release(self) -> None:
        await self.ledger.release()

    async def renew(self) -> int:
        return await self.ledger.renew(self.settings.device_lease_seconds)

    async def record_peak(self, model: str, mib: float, peak_class: PeakClass = PLAIN) -> None:
        await self.ledger.record_peak(self.backend, model, mib, peak_class.name,
                                      self.settings.device_peak_max_age_seconds)


def device_label(device: str) -> str:
    """The key of `device_memory_mib` and of the card's budget: "cpu", or "cuda:" and the
    card this process sees first (one card per worker process): CUDA_VISIBLE_DEVICES's first
    entry (an index or a GPU UUID) where it is set, so that workers pinned to different
    cards of one host keep apart budgets; else 0."""
    if device != "cuda":
        return device
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return f"cuda:{visible or 0}"


def for_worker(settings: Settings, store: WorkerStore, device: str,
               total_mib: int) -> DeviceBudget:
    """The broker for this worker's device, or NO_BUDGET when it has no budget: none set
    and (cpu) none to read, or (cuda) no driver answered."""
    label = device_label(device)
    budget = settings.device_memory_mib.get(label, total_mib)
    if budget <= 0:
        return NO_BUDGET
    # a card is shared by the workers of one host: the id carries the host's name
    return BrokeredBudget(settings, store, f"{socket.gethostname()}/{label}", budget)


def slack_ratio(device: str) -> float:
    """How far over its reservation a peak on `device` may go (PEAK_SLACK_RATIO)."""
    return PEAK_SLACK_RATIO["cuda" if device == "cuda" else "cpu"]


def peak_over(peak_mib: float, reserved_mib: float, device: str) -> bool:
    """A measured peak too far over its reservation to go on serving."""
    return peak_mib > reserved_mib + max(PEAK_SLACK_MIB, slack_ratio(device) * reserved_mib)
