"""Turn a checked submit into a queued task: the breaker, admission, quota and idempotency
answers of one store call. Shared by the Sage, OpenAI and realtime paths."""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Any, TypeVar

from common.catalog import model_language_problem
from common.schemas import DIARIZER, TaskState
from common.settings import Settings
from common.store import (
    BreakerPolicy,
    Duplicate,
    InputsFull,
    QueueFull,
    QuotaExceeded,
    StoreError,
    Task,
    TaskStore,
    TooManyInFlight,
    TooManySubmits,
    new_task_id,
)
from gateway.errors import RequestError, store_unavailable
from gateway.policy.admission import admit, queue_full, refuse_past, retry_after
from gateway.policy.quotas import charge_of, quota_exceeded
from gateway.submit.audio import AudioInput
from gateway.submit.inputs import Params
from gateway.submit.terms import NO_TERMS, SubmitTerms

T = TypeVar("T")


async def enqueue(store: TaskStore, settings: Settings, *, backend: str, model: str,
                  options: dict[str, Any], audio: AudioInput, owner: str,
                  terms: SubmitTerms = NO_TERMS, task_id: str | None = None) -> Task:
    """Queue a new task charged to its owner's usage, or return the original one for a
    repeated idempotency key; a 429 when the backend's queue is full or the deadline cannot
    be met (gateway/policy/admission.py), when the charge would pass a quota
    (gateway/policy/quotas.py), or when its key has its most tasks in flight. A key not
    allowed the interactive lane queues as batch. A staged upload (AudioInput.staged) becomes
    the task's input, or is dropped with any refusal."""
    try:
        return await _enqueue(store, settings, backend=backend, model=model, options=options,
                              audio=audio, owner=owner, terms=terms, task_id=task_id)
    except BaseException:
        await store.blobs.unstage(audio.staged)
        raise


async def _enqueue(store: TaskStore, settings: Settings, *, backend: str, model: str,
                   options: dict[str, Any], audio: AudioInput, owner: str,
                   terms: SubmitTerms, task_id: str | None) -> Task:
    # A repeated key skips every refusal a new task could meet (a deadline passed since, an
    # open breaker, the predicted wait): its submit answers with the original task, as the
    # store confirms it (a replica's wait included); the submit's own check closes the race.
    repeat = bool(terms.idempotency_key) and await guard_store(
        store.idempotent(owner, terms.idempotency_key)) is not None
    if not repeat:
        if problem := model_language_problem(settings, backend, model,
                                             options.get("language")):
            raise RequestError(400, problem, param="language", code="unsupported_language")
        refuse_past(terms.deadline, terms.deadline_param)
        await _refuse_if_broken(store, settings, backend, model, options)
    seconds = round(audio.info.duration, 3)
    # what it costs its key is also its size for the backlog: audio-seconds, or characters
    charge = charge_of(settings, owner, backend, options, seconds)
    task = Task(id=task_id or new_task_id(), backend=backend, model=model, state=TaskState.PENDING,
                params=options, input_path=str(audio.path or ""), owner=owner,
                audio_seconds=seconds, work=charge.amount,
                lane=settings.lane_for(owner, terms.lane),
                deadline=terms.deadline, callback_url=terms.callback_url)
    if not repeat:
        await guard_store(admit(store, settings, task))
    most = settings.max_queued_tasks.get(backend, 0)
    try:
        await guard_store(store.submit(task, audio.blob, terms.idempotency_key, most, charge,
                                       settings.in_flight_limit(owner), audio.staged,
                                       settings.lane_share(owner),
                                       settings.lane_share_work(owner, charge.unit),
                                       settings.queued_share(owner, backend),
                                       settings.input_bytes_limit(owner),
                                       0 if terms.live else settings.submit_rate(owner)))
    except TooManyInFlight as busy:
        raise too_many_in_flight(busy.in_flight) from None
    except TooManySubmits as fast:
        raise RequestError(429, f"this key submitted {settings.submits_per_minute_per_key} "
                                "tasks this minute, its most (SPEECH_SUBMITS_PER_MINUTE_PER_KEY)",
                           code="rate_limited", headers=retry_after(fast.retry_after)) from None
    except InputsFull as full:
        raise RequestError(429, f"this key's unfinished tasks hold {full.held / 1024:.0f} KiB "
                                "of input, and this upload would take them past their most "
                                f"({settings.queued_input_mib_per_key:g} MiB); retry when "
                                "some have finished", code="too_much_input_queued",
                           headers=retry_after(None)) from None
    except QueueFull as full:
        raise await queue_full(store, task, full, most) from None
    except QuotaExceeded as refused:
        raise quota_exceeded(refused, time.time()) from None
    except Duplicate as repeat:
        return await _original(store, backend, repeat.task_id, audio,
                               bool(options.get("streamed")))
    return task


def too_many_in_flight(in_flight: int) -> RequestError:
    return RequestError(429, f"this key already has {in_flight} tasks queued or running, its "
                             "most at once; retry when some have finished",
                        code="too_many_tasks_in_flight", headers=retry_after(None))


async def refuse_fetch_if_full(store: TaskStore, settings: Settings, owner: str,
                               params: Params, terms: SubmitTerms) -> None:
    """Before an `audio_url` download: a key at its most tasks in flight would have it
    refused after the download (a loop of them costs the gateway's memory and the file's
    host, for nothing): the 429 comes first. The submit checks again, atomically. A submit
    with an idempotency key is not checked: its repeat is answered with its task."""
    limit = settings.in_flight_limit(owner)
    if limit and params.get("audio_url") and not terms.idempotency_key and (
            flying := await guard_store(store.in_flight(owner))) >= limit:
        raise too_many_in_flight(flying)


async def _refuse_if_broken(store: TaskStore, settings: Settings, backend: str, model: str,
                            options: dict[str, Any]) -> None:
    """A 503 while the model's breaker (or its diarizer's) is open; past its cool-down the
    task goes through as its probe."""
    guarded = {model: settings.backend_models(backend).get(model, "")}
    if options.get("diarization") is not None:  # a diarizer that keeps failing stops these
        guarded[DIARIZER] = settings.diarization_model
    breakers = await guard_store(store.breakers.read(backend, guarded,
                                                BreakerPolicy.of(settings)))
    for name, breaker in breakers.items():
        if breaker.state == "open":
            what = f"the diarizer of {backend}" if name == DIARIZER else f"model {backend}/{model}"
            raise RequestError(503, f"{what} is unavailable: {breaker.error}",
                               param="model", code="model_unavailable")


async def _original(store: TaskStore, backend: str, task_id: str, audio: AudioInput,
                    streamed: bool) -> Task:
    """The task a repeated idempotency key made; a 409 when it expired, is another
    backend's, or was not streamed where the repeat streams it."""
    await store.blobs.unstage(audio.staged)  # the original task has its own input
    original = await guard_store(store.get(task_id))
    if original is None:
        raise RequestError(409, "this idempotency key was used for a task that has expired",
                           param="idempotency_key", code="idempotency_key_expired")
    if original.backend != backend:  # another kind of call could not render it
        raise RequestError(409, f"this idempotency key was used for a {original.backend} "
                                f"task, not {backend}: use a new key for another request",
                           param="idempotency_key", code="idempotency_key_reused")
    if streamed and not original.params.get("streamed"):
        # a task not streamed is charged whole, and refunded whole if it fails: a stream of
        # its pieces would take what a failure gives back (the worker meters a streamed
        # task's pieces as it delivers them)
        raise RequestError(409, "this idempotency key was used for a request that was not "
                                "streamed: use a new key to stream",
                           param="idempotency_key", code="idempotency_key_reused")
    return original


async def guard_store(awaitable: Awaitable[T], headers: dict[str, str] | None = None) -> T:
    """The store call's result; a 503 (with `headers`) while the store is unavailable."""
    try:
        return await awaitable
    except StoreError as exc:
        raise store_unavailable(exc, headers) from None
