"""One resident model per worker: loaded on demand, unloaded on idle, switch or over cap.

The speaches idea (`SelfDisposingModel`) widened to the whole lifetime. All methods run
on the worker's single engine thread, so loads, inference and unloads never overlap.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from workers import memory
from workers.diarize import Diarizer
from workers.engines.base import Engine, ModelRef, check_source

log = logging.getLogger("worker.models")


class LoadFailed(Exception):
    """A model failed to load. Carries only the message: no traceback, no frames, no tensors."""


class DiarizerLoadFailed(LoadFailed):
    """The diarizer failed to load (beside a model that did): its breaker's failure."""


class SourceUnusable(Exception):
    """A model's source failed the pre-check: nothing was allocated, nothing was unloaded."""


@dataclass(frozen=True, slots=True)
class LoadReport:
    """What became of acquiring `model` for one engine call."""

    model: str
    source: str
    ok: bool
    #: a load ran (False when ok: the model was already resident)
    loaded: bool = False
    #: a failed load got as far as allocating: only an exit returns what it may hold.
    #: False for a source that failed its pre-check (the resident model stays).
    allocated: bool = False
    error: str = ""
    seconds: float = 0.0  # of a successful load
    #: how long the load waited in line for device memory (None: no broker, or no load)
    device_wait_seconds: float | None = None


OnLoad = Callable[[LoadReport], Awaitable[None]]


class ModelSlot:
    """The model, and beside it the diarizer (workers/diarize.py) once a task asks for
    speakers: loaded then, under the same rules (a failed load is the model's), unloaded with
    the model, and in the process's memory like it."""

    def __init__(self, engine: Engine, device: str, sources: dict[str, str],
                 diarizer: Diarizer | None = None) -> None:
        self.engine = engine
        self.diarizer = diarizer
        self.diarizer_handle: Any = None
        self.device = device
        self.sources = sources
        self.name: str | None = None
        self.handle: Any = None
        self.last_used: float | None = None
        self.loading: str | None = None
        self.loads = 0  # successful loads so far (the diarizer's too)
        self.diarizer_loads = 0
        self.last_load_seconds = 0.0

    def fails_precheck(self, name: str) -> bool:
        """Whether model `name`'s source fails the check made before any load (a missing
        directory …): loading it would allocate nothing, so the resident model need not go."""
        if name not in self.sources:
            return False  # (refused as not configured, by acquire)
        try:
            check_source(self.engine, ModelRef(name, self.sources[name]))
        except Exception:
            return True
        return False

    def acquire(self, name: str, diarize: bool = False) -> Any:
        """The handle of model `name`, loading it (after unloading any other) if needed; with
        `diarize`, the diarizer too."""
        handle = self._acquire_model(name)
        if diarize and self.diarizer_handle is None:
            self._load_diarizer(name)
        return handle

    def diarization(self) -> tuple[Diarizer, Any] | None:
        """The diarizer and its handle, when loaded."""
        if self.diarizer is None or self.diarizer_handle is None:
            return None
        return self.diarizer, self.diarizer_handle

    def _load_diarizer(self, name: str) -> None:
        # A diarizer this worker cannot have fails the task that asks (KeyError: the host's
        # "not configured here"), never the model's breaker: tasks without it still run.
        if self.diarizer is None:
            raise KeyError(f"model {name!r} has no diarizer on this worker")
        try:
            self.diarizer.check_source()
        except Exception as exc:
            raise KeyError(str(exc)) from None
        self.loading = name
        started = time.perf_counter()
        error = None
        try:
            handle = self.diarizer.load(self.device)
        except Exception as exc:  # any load error: the process will exit, as for a model
            error = f"{type(exc).__name__}: {exc}"
        self.loading = None
        if error is not None:
            raise DiarizerLoadFailed(f"the diarizer of model {name!r} failed to load: {error}")
        self.last_load_seconds = time.perf_counter() - started
        self.loads += 1
        self.diarizer_loads += 1
        memory.keep_resident()
        log.info("loaded the diarizer in %.2f s", self.last_load_seconds)
        self.diarizer_handle = handle

    def _acquire_model(self, name: str) -> Any:
        if self.name == name and self.handle is not None:
            self.last_used = time.time()
            return self.handle
        if name not in self.sources:
            raise KeyError(f"model {name!r} is not configured on this worker")
        ref = ModelRef(name, self.sources[name])
        try:
            check_source(self.engine, ref)
        except Exception as exc:  # the resident model stays: this one never got near memory
            raise SourceUnusable(f"model {name!r} failed to load: {exc}") from None
        self.unload()
        self.loading = name
        started = time.perf_counter()
        error = None
        try:
            handle = self.engine.load(ref, self.device)
            self.engine.warm_up(handle)
        except Exception as exc:  # any load error: the process will exit
            error = f"{type(exc).__name__}: {exc}"
        # The exception (and the half-built model its frames hold) is gone by now.
        self.loading = None
        if error is not None:
            raise LoadFailed(f"model {name!r} failed to load: {error}")
        self.last_load_seconds = time.perf_counter() - started
        self.loads += 1
        memory.keep_resident()
        log.info("loaded model %s on %s in %.2f s", name, self.device, self.last_load_seconds)
        self.name, self.handle, self.last_used = name, handle, time.time()
        return handle

    def unload(self) -> None:
        if self.handle is None and self.diarizer_handle is None:
            return
        name, handle, diarizer = self.name, self.handle, self.diarizer_handle
        self.name = self.handle = self.diarizer_handle = None
        if handle is not None:
            self.engine.unload(handle)
        if diarizer is not None and self.diarizer is not None:
            self.diarizer.unload(diarizer)
            log.info("unloaded the diarizer")
        del handle, diarizer
        # the diarizer runs on torch even beside an engine that does not (faster-whisper)
        memory.release_all(self.engine.uses_torch or self.diarizer is not None)
        log.info("unloaded model %s", name)

    def touch(self) -> None:
        """The resident model was just used: an engine call on it ended now."""
        if self.handle is not None:
            self.last_used = time.time()

    def idle_for(self) -> float:
        """Seconds since the resident model's last call began or ended."""
        return time.time() - self.last_used if self.last_used else 0.0

    @property
    def loaded_models(self) -> list[str]:
        return [self.name] if self.name else []
