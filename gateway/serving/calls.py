"""What the OpenAI-style calls share: they queue a task like any other, then wait for it.

`SyncCalls.start` subscribes to the task's events before the task exists (so no segment is
missed) and queues it; `Call.outcome` waits for the terminal state, for the caller to hang
up, or for the request timeout (a 504 naming the task, which goes on).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections import Counter
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from common.catalog import UnknownBackend, UnknownModel, resolve_public_model
from common.schemas import ErrorCode, TaskState
from common.settings import Settings
from common.store import StoreError, Task, TaskStore, new_task_id
from common.store.events import EventHub, Overloaded
from gateway.errors import ErrorType, RequestError, openai_error
from gateway.policy.admission import estimate_queued
from gateway.process.limits import BodyRefused
from gateway.submit.audio import AudioInput
from gateway.submit.enqueue import enqueue
from gateway.submit.inputs import Params
from gateway.submit.terms import SubmitTerms

Events = AsyncGenerator[dict[str, Any], None]
T = TypeVar("T")
log = logging.getLogger("gateway.calls")


class Disconnected:
    """The caller hung up while waiting: nobody reads the reply (the task goes on)."""


DISCONNECTED = Disconnected()


@dataclass(slots=True)
class Call:
    """A queued task its caller waits for: its events, from the first segment on."""

    task_id: str
    events: Events
    #: X-Queue-Position and X-Estimated-Wait at submit (empty when unknown)
    headers: dict[str, str] = field(default_factory=dict)

    async def outcome(self, request: Request, *,
                      timeout_headers: dict[str, str] | None = None) -> Task | Disconnected:
        """The finished task, or DISCONNECTED as soon as the client hangs up (which releases
        the waiter at once). A 504 naming the task (plus `timeout_headers`) when the wait
        times out."""
        try:
            waiting, _ = await first_of(_done(self.events), client_gone(request))
        finally:
            await self.events.aclose()
        if not waiting.done() or waiting.cancelled():
            return DISCONNECTED
        task = waiting.result()
        if task is None:
            raise still_running(self.task_id, timeout_headers)
        return task


class SyncCalls:
    def __init__(self, settings: Settings, store: TaskStore, hub: EventHub) -> None:
        self.settings = settings
        self.store = store
        self.hub = hub
        #: waiting calls per key, of which one key may hold `waiter_share_limit`
        self.waiting: Counter[str] = Counter()
        self.waiter_share_limit = max(1, math.floor(settings.max_waiting_requests
                                                    * settings.realtime_key_share))

    async def start(self, *, backend: str, model: str, options: dict[str, Any],
                    audio: AudioInput, owner: str, terms: SubmitTerms,
                    task_id: str = "") -> Call:
        """Queue the task (under `task_id`, or a new id), already subscribed to its events;
        RequestError if refused (a 503 with Retry-After when this process has too many
        waiting calls). A repeated idempotency key listens to the original task instead."""
        task_id = task_id or new_task_id()
        if owner and self.waiting[owner] >= self.waiter_share_limit:
            await self.store.blobs.unstage(audio.staged)  # (enqueue drops it itself)
            raise RequestError(503, f"this key has {self.waiter_share_limit} calls "
                                    "waiting in this gateway process, its share; retry "
                                    "shortly, or submit through /api/submit and poll",
                               code="overloaded", headers={"retry-after": "1"})
        # counted before the first await, so concurrent calls of one key see each other;
        # given back by the call's events, or here if anything below fails or is cancelled
        self.waiting[owner] += 1
        events: Events | None = None
        try:
            try:
                events = await self._listen(task_id)  # subscribed before the task exists
            except BaseException:
                await self.store.blobs.unstage(audio.staged)
                raise
            task = await enqueue(self.store, self.settings, backend=backend, model=model,
                                 options=options, audio=audio, owner=owner, terms=terms,
                                 task_id=task_id)
            if task.id != task_id:
                await events.aclose()
                events = None
                # The subscription comes before the state is read, so a finished original
                # is seen.
                events = await self._listen(task.id)
            outlook = await self._outlook(task)
        except BaseException:
            if events is not None:
                await events.aclose()
            self._release(owner)
            raise
        counted = _Counted(events, lambda: self._release(owner))
        return Call(task.id, cast(Events, counted), outlook)

    def _release(self, owner: str) -> None:
        self.waiting[owner] -= 1
        if self.waiting[owner] <= 0:
            del self.waiting[owner]

    async def _outlook(self, task: Task) -> dict[str, str]:
        """X-Queue-Position and X-Estimated-Wait (seconds until it starts) of a queued task."""
        headers: dict[str, str] = {}
        with contextlib.suppress(StoreError):
            position = await self.store.positions.of(task)
            if position is not None:
                headers["x-queue-position"] = str(position)
                estimate = await estimate_queued(self.store, task, position)
                if estimate is not None:
                    headers["x-estimated-wait"] = f"{estimate.start:.2f}"
        return headers

    async def _listen(self, task_id: str) -> Events:
        events = self.hub.events(task_id, self.settings.request_timeout_seconds)
        try:
            await anext(events)
        except Overloaded as full:
            raise RequestError(503, "too many requests are waiting for their tasks; retry "
                                    "shortly, or submit through /api/submit and poll",
                               code="overloaded",
                               headers={"retry-after": str(full.retry_after)}) from None
        return events


class _Counted:
    """A call's events, counted as one of its key's waiting calls until closed (also when
    closed before it was read)."""

    def __init__(self, events: Events, release: Callable[[], None]) -> None:
        self.events = events
        self._release: Callable[[], None] | None = release

    def __aiter__(self) -> _Counted:
        return self

    async def __anext__(self) -> dict[str, Any]:
        return await self.events.__anext__()

    async def aclose(self) -> None:
        if self._release is not None:
            self._release, release = None, self._release
            release()
        await self.events.aclose()


def public_model(settings: Settings, params: Params, default: str, kind: str) -> tuple[str, str]:
    """(backend, model) for the request's OpenAI-style `model`; 404 if unknown."""
    try:
        return resolve_public_model(settings, params.get("model") or default, kind)
    except (UnknownModel, UnknownBackend) as exc:
        raise RequestError(404, f"{exc}; GET /v1/models lists them", param="model",
                           code="model_not_found") from None


def response_format(params: Params, allowed: tuple[str, ...], default: str) -> str:
    value = (params.get("response_format") or default).lower()
    if value not in allowed:
        raise RequestError(400, f"response_format must be one of {', '.join(allowed)}",
                           param="response_format")
    return value


#: the task codes a retry would only repeat (the same input, the same engine, the same
#: quota) or would undo (a cancel): their replies say `x-should-retry: false`, which the
#: OpenAI SDKs obey instead of re-submitting the upload as a new task. The others (a worker
#: short of memory, a model breaker, no worker, a deadline) may pass on the next try.
FINAL_CODES = frozenset({ErrorCode.ENGINE_ERROR, ErrorCode.INVALID_REQUEST,
                         ErrorCode.INVALID_AUDIO, ErrorCode.AUDIO_TOO_LONG,
                         ErrorCode.DELIVERY_LIMIT, ErrorCode.QUOTA_EXCEEDED,
                         ErrorCode.CANCELLED})
NO_RETRY = {"x-should-retry": "false"}


def task_headers(task_id: str, final: bool = False) -> dict[str, str]:
    """The headers naming a call's task: `x-task-id`, and the same as `x-request-id`, the id
    the openai SDK keeps (`response._request_id`, `error.request_id`) for a support request;
    `final`: an error a retry would not mend, or would pay for again (NO_RETRY)."""
    named = {"x-task-id": task_id, "x-request-id": task_id}
    return {**named, **NO_RETRY} if final else named


def task_failed(task: Task) -> RequestError:
    """A FAILED or CANCELLED task, as the error its caller gets (with `x-task-id`, and
    `x-should-retry: false` for FINAL_CODES): the one error of every reply, whole or streamed
    (SSE `error` events, realtime `...failed`), with the task's own code."""
    if task.state == TaskState.CANCELLED:
        return RequestError(409, task.error or "the task was cancelled",
                            code=ErrorCode.CANCELLED.value,
                            headers=task_headers(task.id, final=True))
    try:
        code = ErrorCode(task.error_code or ErrorCode.ENGINE_ERROR)
    except ValueError:  # a code a newer worker wrote
        code = ErrorCode.ENGINE_ERROR
    message = task.error or "the task failed"
    if code == ErrorCode.OUT_OF_MEMORY:
        message = ("the worker has too little memory for this file right now (not an "
                   f"upload size limit); retry later or with shorter audio: {message}")
    return RequestError(code.http_status, message, code=code.value,
                        headers=task_headers(task.id, final=code in FINAL_CODES))


def delta_of(event: dict[str, Any], started: bool) -> str:
    """A streamed segment event's text as a stream's delta (`started`: an earlier one was
    sent): the worker's (workers/execute.stream_delta: the deltas add up to the engine's
    transcript), else (an older worker's event) its text, the first without its space."""
    if "delta" in event:
        return str(event["delta"])
    return event["text"] if started else event["text"].lstrip()


class Deltas:
    """A stream's text deltas from its task's segment events (each segment id once: the
    event hub's), adding up to the task's final text. A segment that never reached the
    stream (its id skipped: a pub/sub message dropped while the gateway reconnected, one
    the worker gave up publishing) holds every later one back: what was sent stays the
    start of the text, and `closing` sends the rest at the end in one delta."""

    def __init__(self) -> None:
        self.sent = ""  # what the deltas sent add up to
        self._next_id = 0
        self._held = False

    def of(self, event: dict[str, Any]) -> str:
        """The delta a segment event sends ("": none)."""
        number = event.get("id")
        if isinstance(number, int):
            if number != self._next_id and not self._held:
                log.warning("segments %d-%d never reached a stream: its deltas wait for the "
                            "end", self._next_id, number - 1)
                self._held = True
            self._next_id = number + 1
        if self._held or not event.get("text"):
            return ""
        delta = delta_of(event, bool(self.sent))
        self.sent += delta
        return delta

    def closing(self, text: str) -> str:
        """What the stream still owes once its task's final text is `text`."""
        rest = closing_delta(text, self.sent)
        self.sent += rest
        return rest


def closing_delta(text: str, sent: str) -> str:
    """What a stream still owes once its task's text is final, the deltas it sent adding up
    to `sent`: the rest of `text` when it starts with them (the last segments never reached
    the stream, or `Deltas` held them back after a lost one), else "" (a redelivered attempt
    that read the audio differently: the final text, which the stream's last event carries,
    stands)."""
    stem = sent.rstrip()  # (the final text is stripped; a segment's delta may not be)
    if text.startswith(stem):
        rest, tail = text[len(stem):], sent[len(stem):]
        return rest[len(tail):] if rest.startswith(tail) else rest.lstrip()
    log.warning("a stream's deltas (%d characters) differ from its task's final text",
                len(sent))
    return ""


def still_running(task_id: str, headers: dict[str, str] | None = None) -> RequestError:
    """The 504 of a wait past the request timeout: the task goes on, under `task_id`, so a
    retry would queue the same work again (`x-should-retry: false`)."""
    return RequestError(504, f"the task is still running; poll /v1/tasks/{task_id}",
                        code="task_timeout", type=ErrorType.TIMEOUT,
                        headers={**task_headers(task_id, final=True), **(headers or {})},
                        extra={"task_id": task_id})


async def _done(events: Events) -> Task | None:
    async for event in events:
        if event["type"] == "done":
            return event["task"]
    return None


class StalledClient(Exception):
    """A streamed reply's client took none of it for the send timeout."""


class TimedStreamingResponse(StreamingResponse):
    """A StreamingResponse whose every write must be taken within `send_timeout` s. A client
    that reads nothing fills the socket's buffers, and uvicorn's send then waits as long as
    the connection stays open, holding the stream's task waiter (SPEECH_MAX_WAITING_REQUESTS)
    the whole time; past the timeout the stream is closed and the waiter freed (its task
    goes on, its result kept as always)."""

    def __init__(self, content: AsyncIterator[bytes], send_timeout: float,
                 **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self.send_timeout = send_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def timed(message: Message) -> None:
            try:
                async with asyncio.timeout(self.send_timeout):
                    await send(message)
            except TimeoutError:
                raise StalledClient from None

        try:
            await super().__call__(scope, receive, timed)
        except StalledClient:  # uvicorn ends the connection as the reply is left unfinished
            log.warning("a streamed reply's client took nothing for %g s; dropped",
                        self.send_timeout)
        finally:
            body = self.body_iterator
            if isinstance(body, AsyncGenerator):
                await body.aclose()  # now, not when it is collected: it holds the waiter


def sse_reply(events: AsyncIterator[bytes], send_timeout: float,
              headers: dict[str, str]) -> TimedStreamingResponse:
    """A server-sent events reply: no cache or proxy may hold its events back (nginx buffers
    a proxied reply unless told `x-accel-buffering: no`, and the client then sees nothing
    until the end)."""
    return TimedStreamingResponse(events, send_timeout, media_type="text/event-stream",
                                  headers={**headers, "cache-control": "no-cache",
                                           "x-accel-buffering": "no"})


def sse_event(payload: dict[str, Any]) -> bytes:
    """One server-sent event carrying `payload` as JSON."""
    return f"data: {json.dumps(payload)}\n\n".encode()


def sse_error(error: RequestError) -> bytes:
    """The `error` event that ends a stream (transcription and speech alike), with what the
    whole reply's body carries beside the error (a timeout's `task_id`)."""
    return sse_event({"type": "error", "error": openai_error(error), **error.extra})


def stream_usage(**metered: float) -> dict[str, Any]:
    """The `usage` of a stream's last event (`transcript.text.done`, `speech.audio.done`):
    OpenAI's token usage, with no tokens (nothing here is billed in tokens), and beside it
    what is metered, by name (`seconds` of audio heard, `characters` spoken): one rule for
    both streams, so a client that reads one reads the other."""
    return {"type": "tokens", "input_tokens": 0, "output_tokens": 0, "total_tokens": 0,
            **metered}


def metered_seconds(seconds: float) -> float:
    """Audio seconds as every reply reports them (a body's `usage`, a stream's, a realtime
    turn's): as charged, to the millisecond."""
    return round(seconds, 3)


#: an SSE comment: clients ignore it, proxies see the connection is alive
KEEPALIVE = b": keep-alive\n\n"


async def first_of(*work: Coroutine[Any, Any, Any]) -> list[asyncio.Future[Any]]:
    """Run `work` until the first of it ends; the rest is cancelled and reaped. Their futures,
    in order: `.cancelled()` says which did not finish."""
    futures = [asyncio.ensure_future(item) for item in work]
    try:
        await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for future in futures:
            future.cancel()
        await asyncio.gather(*futures, return_exceptions=True)
    return futures


async def unless_gone(work: Coroutine[Any, Any, T], request: Request) -> T | None:
    """`work`'s result (never None), or None as soon as the client hangs up (`work` is then
    cancelled, and has run its `finally`)."""
    waiting, _ = await first_of(work, client_gone(request))
    return None if waiting.cancelled() else waiting.result()


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects (the request body has been read by then)."""
    try:
        while (await request.receive())["type"] != "http.disconnect":
            pass
    except BodyRefused:  # a body nobody read: stop watching, the wait has its own deadline
        await asyncio.Event().wait()
