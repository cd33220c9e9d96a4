"""Cross-request batching: the rule, written once for every engine that has a batch call.

- **Gather** (`Gatherer`): after a first new entry that could share a call (the consumer
  checks; one that cannot sweeps nothing), the queue is swept (no waiting) for
  more, up to `SPEECH_BATCH_MAX_SIZE`. Only when company is seen (the sweep found some, or
  the previous batch had several tasks: a burst is under way) does it wait for more, until
  `SPEECH_BATCH_WINDOW_MS` after the first task arrived (its entry id is its add time),
  and never longer than that window after the worker read it. A lone task, or one client's
  request after request, is never held: batching costs it one empty read.
- **Group** (`group`): only tasks of one model whose engine key (`batch_key`: the options
  that must match) is equal, and whose lengths are of one class (`length_class`: a call
  returns when its longest clip is done, so an 11 s clip never waits for a 4-minute one),
  share a call; a task without a key runs alone, as before. Groups holding interactive work
  run first (`urgent_first`).
- **Fit** (`next_call`): a batch is split so that each call's extra memory (`item_mib` a
  clip) fits what the memory cap and the device reservation leave then; until a clip's
  cost is measured, a bounded process makes calls of PROBE_CALL clips.
- **Run** (`run_batch`, on the engine thread): each clip is decoded alone (a clip that
  fails to decode fails alone), the rest go to the engine's batch call, and each clip gets
  its own outcome. A batch call that fails as a whole is retried clip by clip, so one bad
  clip never fails the others. A clip whose audio decodes far longer than its file told
  the probe (two length classes past the call's shortest) leaves the call (`Longer`) and
  runs alone once the others' results are out.

Everything else about a task (its attempt, fence, lease, deadline, cancellation, streamed
segments, result, usage and backlog) stays the consumer's, per task (workers/consumer.py).
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from common.audio import AudioTooLong
from common.schemas import DiarizationOptions, Segment, TranscriptionOptions
from common.settings import Settings
from common.store.queue import Delivery
from workers.engines.base import BatchTranscriptionEngine, Engine
from workers.execute import (
    OnDecoded,
    Outcome,
    Source,
    TaskError,
    asr_audio,
    run_engine,
    task_error,
)

T = TypeVar("T")
#: reads up to `count` new entries a lane in one round trip, waiting up to `block_ms` (None:
#: not at all)
Read = Callable[[int, int | None], Awaitable[list[Delivery]]]


def batch_engine(engine: Engine, settings: Settings) -> BatchTranscriptionEngine | None:
    """The engine's batch call, when it has one and batching is on."""
    if settings.batch_max_size < 2 or settings.batch_window_ms <= 0:
        return None
    return engine if isinstance(engine, BatchTranscriptionEngine) else None


def describe(engine: Engine, settings: Settings) -> dict[str, Any]:
    """The batch settings a worker shows in its health snapshot (and /ready)."""
    return {"enabled": batch_engine(engine, settings) is not None,
            "max_size": settings.batch_max_size, "window_ms": settings.batch_window_ms}


def arrival(delivery: Delivery) -> float:
    """When the entry was added (epoch seconds, Redis's clock): its id says."""
    millis, _, _ = delivery.entry_id.partition("-")
    return int(millis) / 1000 if millis.isdigit() else time.time()


class Gatherer:
    def __init__(self, max_size: int, window_ms: float) -> None:
        self.max_size = max_size
        self.window = window_ms / 1000
        self.company = False  # the previous batch had several tasks

    async def gather(self, first: list[Delivery], read: Read) -> tuple[list[Delivery], float]:
        """`first` and what joins it; and the seconds spent waiting for company."""
        taken = list(first)
        read_at = time.monotonic()
        deadline = read_at + max(0.0, min(self.window,
                                          arrival(taken[0]) + self.window - time.time()))
        while len(taken) < self.max_size:
            more = await read(self.max_size - len(taken), None)
            if not more:
                if not (self.company or len(taken) > 1):
                    break  # alone: go at once
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms < 1:  # XREADGROUP's BLOCK 0 would wait for ever
                    break
                more = await read(self.max_size - len(taken), left_ms)
                if not more:
                    break
            taken.extend(more)
        self.company = len(taken) > 1
        waited = time.monotonic() - read_at
        return taken, waited  # a read may bring more than asked (up to `count` a lane)


def length_class(audio_seconds: float | None) -> int:
    """Clips of one class are at most about twice as long as each other: 0 up to 2 s, then
    one class per doubling (unknown lengths together)."""
    if not audio_seconds or audio_seconds < 2.0:
        return 0
    return int(math.log2(audio_seconds))


def batch_key(engine: BatchTranscriptionEngine, model: str, params: dict[str, Any],
              audio_seconds: float | None = None) -> Hashable | None:
    """What tasks must share to share a call (the options the engine names, and the length
    class); None: this one runs alone (speakers, options that do not parse: the single path
    says why)."""
    if params.get("diarization") is not None or params.get("clips_packed"):
        return None
    try:
        key = engine.batch_key(TranscriptionOptions.from_params(params))
    except ValueError:
        return None
    return None if key is None else (model, length_class(audio_seconds), key)


def group(items: list[T], key: Callable[[T], Hashable | None],
          max_size: int) -> list[list[T]]:
    """Items with equal keys together (at most `max_size` a group), in order of their
    first; a None key alone."""
    groups: dict[Hashable, list[T]] = {}
    alone: list[list[T]] = []
    order: list[list[T]] = []
    for item in items:
        found = key(item)
        if found is None:
            alone.append([item])
            order.append(alone[-1])
        elif found in groups and len(groups[found]) < max_size:
            groups[found].append(item)
        else:
            groups[found] = [item]
            order.append(groups[found])
    return order


def urgent_first(groups: list[list[T]], urgent: Callable[[T], bool]) -> list[list[T]]:
    """`groups` with those holding an `urgent` item (interactive work) first, each side in
    its order."""
    return sorted(groups, key=lambda members: not any(urgent(item) for item in members))


#: clips of a call while nothing says what a clip costs and memory is bounded: a small call
#: measures it (the first batch after a start took all 8 clips under a cap with room for 2)
PROBE_CALL = 2


def next_call(left: int, item_mib: float | None, headroom_mib: float | None) -> int:
    """How many of the `left` clips the next call takes: as many as fit `headroom_mib`
    (None: no bound) at `item_mib` each (None: not measured yet, PROBE_CALL; 0: measured
    as nothing, all of them); at least one."""
    if headroom_mib is None:
        return left
    if item_mib is None:
        return min(left, PROBE_CALL)
    if item_mib <= 0:
        return left
    return max(1, min(left, int(headroom_mib // item_mib)))


@dataclass(slots=True)
class BatchItem:
    """One task's part of a batch: what `run_engine` takes for it alone."""

    params: dict[str, Any]
    source: Source | None
    on_segment: Callable[[Segment], None]
    on_decoded: OnDecoded | None = None


class Longer:
    """A clip's place in a batch call's outcomes when its audio decoded to a length class
    past its company's (its file claimed far less to the probe it was grouped by): it runs
    alone after them, so their results never wait for its length."""


class Again(Longer):
    """A clip whose shared call failed for it (or as a whole: memory, an engine error that
    may be its neighbours' doing): it runs once more alone after the call, so the others'
    results are out before its retry."""


def run_batch(engine: BatchTranscriptionEngine, handle: Any, *, backend: str, model: str,
              items: list[BatchItem], max_audio_seconds: float | None,
              allowed_roots: tuple[Path, ...],
              probed_seconds: float | None = None) -> list[Outcome | TaskError | Longer]:
    """One batch call on the engine thread: each item's outcome, or why it failed (or that
    it runs alone after the call: `Longer`). `probed_seconds`: the longest length the
    clips' files told the probe (their group's class)."""
    if len(items) == 1:
        alone = _alone(engine, handle, backend, model, items[0], max_audio_seconds,
                       allowed_roots)
        return [task_error(alone) if isinstance(alone, Exception) else alone]
    results: list[Outcome | TaskError | Longer | None] = [None] * len(items)
    audios: dict[int, np.ndarray] = {}
    options: dict[int, TranscriptionOptions] = {}
    # decoding stops where a clip would leave the call (`_alike`): the others wait neither
    # for a lying file's whole decode nor for its charge and its device memory (`on_decoded`),
    # which its run alone after them decodes and tells
    leaves_at = 2.0 ** (length_class(probed_seconds) + 2)
    capped = max_audio_seconds is None or leaves_at < max_audio_seconds
    for index, item in enumerate(items):
        try:
            options[index] = TranscriptionOptions.from_params(item.params)
            if DiarizationOptions.from_params(item.params) is not None:
                raise ValueError("a task with speakers cannot share a batch")
            audios[index] = asr_audio(item.source, item.params, engine.sample_rate,
                                      leaves_at if capped else max_audio_seconds,
                                      allowed_roots, item.on_decoded)
        except AudioTooLong as exc:
            results[index] = Longer() if capped else task_error(exc)
        except Exception as exc:
            results[index] = task_error(exc)
    ready = _alike(audios, engine.sample_rate, length_class(probed_seconds))
    for index in set(audios) - set(ready):
        results[index] = Longer()
        del audios[index]
    answers: list[Any] = [None] * len(ready)  # None: the clip runs alone, here
    if len(ready) > 1:
        try:
            answers = list(engine.transcribe_batch(
                handle, [audios[i] for i in ready], [options[i] for i in ready],
                [items[i].on_segment for i in ready]))
        except Exception:  # the call as a whole: each clip again, alone, after it
            answers = [Again()] * len(ready)
        if len(answers) != len(ready):  # an engine's broken answer: as a failed call
            answers = [Again()] * len(ready)
    audios.clear()
    for index, answer in zip(ready, answers, strict=True):
        if isinstance(answer, Exception | Again) and len(ready) > 1:
            results[index] = Again()  # maybe its neighbours' doing: once more, alone, after
            continue
        if answer is None:
            answer = _alone(engine, handle, backend, model, items[index], max_audio_seconds,
                            allowed_roots)
        try:
            if isinstance(answer, Exception):
                answer = task_error(answer)
            elif not isinstance(answer, Outcome):
                answer = Outcome(answer.to_result(backend, model,
                                                  options[index].word_timestamps))
        except Exception as exc:  # one clip's result that cannot be read: its own failure
            answer = task_error(exc)
        results[index] = answer
    return [result if result is not None else TaskError("no result") for result in results]


def _alike(audios: dict[int, np.ndarray], sample_rate: int, probed: int) -> list[int]:
    """The decoded clips that stay in the call: all but those two length classes or more
    past the `probed` class they were grouped by (an honest clip decodes to it or next to
    it; one that decodes shorter, its file having overstated, stays)."""
    return [index for index, audio in audios.items()
            if length_class(len(audio) / sample_rate) <= probed + 1]


def _alone(engine: Engine, handle: Any, backend: str, model: str, item: BatchItem,
           max_audio_seconds: float | None,
           allowed_roots: tuple[Path, ...]) -> Outcome | Exception:
    try:
        return run_engine(engine, handle, backend=backend, model=model, params=item.params,
                          source=item.source, on_segment=item.on_segment,
                          max_audio_seconds=max_audio_seconds, allowed_roots=allowed_roots,
                          on_decoded=item.on_decoded)
    except Exception as exc:
        return exc
