"""`/v1/audio/speech` with `stream_format`: the task's audio sent as it is spoken.

The worker stores each spoken piece (a sentence) in the task's chunk record and publishes a
notification (common/store/chunks.py). A stream reads that record by index, from piece 0,
woken by the notifications, so each piece is sent once, whatever attempt spoke it; once the
task is finished the rest comes from its WAV (the same samples: the worker drops the pieces
after the terminal write). `audio` sends the encoded bytes (chunked transfer), `sse` sends
them base64 in `speech.audio.delta` events, then one `speech.audio.done`.

The response starts with the first piece, so a task that fails before speaking is a plain
error reply (its status and JSON body); one that fails later ends an `audio` stream without
its last chunk (the client sees a broken transfer, never a short file passed off as whole)
and an `sse` stream with an `error` event.
"""

from __future__ import annotations

import asyncio
import base64
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from common.audio import AudioError, wav_pcm
from common.schemas import SpeechChunk, TaskState
from common.store import StoreError, Task, TaskStore
from common.stream_audio import StreamEncoder
from gateway.errors import RequestError, store_unavailable
from gateway.serving.calls import (
    KEEPALIVE,
    Call,
    TimedStreamingResponse,
    sse_error,
    sse_event,
    sse_reply,
    still_running,
    stream_usage,
    task_failed,
    task_headers,
    unless_gone,
)

Spoken = AsyncIterator[SpeechChunk | Task | None]  # None: silence, a keep-alive is due


class StreamBroken(Exception):
    """The task failed after its first audio was sent: the transfer is cut short."""


async def spoken(store: TaskStore, call: Call) -> Spoken:
    """The task's pieces in order, each once, then the finished Task; a RequestError (504)
    when the wait times out. A `tick` (silence) is passed on as None, for a keep-alive."""
    next_index = sent = 0
    event: dict[str, Any] = {"type": "tick"}  # pieces stored before we listened come first
    try:
        while True:
            if event["type"] in ("chunk", "tick", "done"):
                while chunks := await _read(store, call.task_id, next_index):
                    for chunk in chunks:
                        next_index, sent = chunk.index + 1, sent + len(chunk.pcm)
                        yield chunk
            if event["type"] == "tick":
                yield None
            elif event["type"] == "done":
                task: Task = event["task"]
                pieces = (task.result or {}).get("pieces")
                # the pieces outlive the task a minute: the WAV only for a reader slower
                # than that (or a task from before the worker counted its pieces)
                if task.state == TaskState.SUCCEEDED and (pieces is None or next_index < pieces):
                    tail = await _wav_tail(store, task, sent)
                    if tail:
                        yield SpeechChunk(next_index, tail[0], tail[1])
                yield task
                return
            elif event["type"] == "timeout":
                raise still_running(call.task_id)
            event = await anext(call.events)
    finally:
        await call.events.aclose()


#: how long a stream's read of the stored pieces is retried while Redis is away (a Sentinel
#: failover takes seconds); past it the stream ends with the store's error (an `sse` stream's
#: last event, an `audio` transfer cut short), never silently
STORE_PATIENCE_SECONDS = 15.0


async def _read(store: TaskStore, task_id: str, start: int) -> list[SpeechChunk]:
    """`store.speech.read`, retried through a failover; a RequestError (503) past
    STORE_PATIENCE_SECONDS."""
    give_up_at = time.monotonic() + STORE_PATIENCE_SECONDS
    while True:
        try:
            return await store.speech.read(task_id, start)
        except StoreError as exc:
            if time.monotonic() >= give_up_at:
                raise store_unavailable(exc) from None
            await asyncio.sleep(0.5)


async def _wav_tail(store: TaskStore, task: Task, sent: int) -> tuple[bytes, int] | None:
    """The finished task's samples past the first `sent` bytes, and their rate."""
    wav = await store.blobs.output(task.id)
    if wav is None:
        raise RequestError(500, "the synthesized audio is missing", code="audio_missing",
                           headers=task_headers(task.id, final=True))
    try:
        pcm, rate = await asyncio.to_thread(wav_pcm, wav)
    except AudioError as exc:
        raise RequestError(500, str(exc), code="audio_missing",
                           headers=task_headers(task.id, final=True)) from None
    return (pcm[sent:], rate) if len(pcm) > sent else None


async def stream_reply(request: Request, call: Call, store: TaskStore, *, fmt: str,
                       stream_format: str, characters: int, headers: dict[str, str],
                       send_timeout: float, keepalive: float) -> Response:
    """The streamed reply, once the first piece is there (or the task's error before). An
    `sse` stream whose task is still queued after `keepalive` s starts without it and sends
    keep-alive comments until it speaks, so no proxy cuts a long wait."""
    pieces = spoken(store, call)
    first = await _first(pieces, request, keepalive if stream_format == "sse" else None)
    if first is None:
        return Response(status_code=499)  # never delivered: the client is gone
    if isinstance(first, Task):  # finished without a piece: it failed
        await pieces.aclose()
        raise task_failed(first)
    headers = {**task_headers(call.task_id), "cache-control": "no-cache", **headers}
    if isinstance(first, Quiet):  # (sse only) the encoder is made with the first piece
        return sse_reply(_sse(pieces, None, Encoding(fmt), characters), send_timeout,
                         headers)
    encoding = Encoding(fmt)
    try:
        encoder = encoding.of(first.sample_rate)
    except AudioError as exc:
        await pieces.aclose()  # (the task speaks on: a retry would speak it again)
        raise RequestError(500, str(exc),
                           headers=task_headers(call.task_id, final=True)) from None
    if stream_format == "sse":
        return sse_reply(_sse(pieces, first, encoding, characters), send_timeout, headers)
    return TimedStreamingResponse(_audio(pieces, first, encoding), send_timeout,
                                  media_type=encoder.content_type, headers=headers)


class Encoding:
    """A response's encoder, made for the sample rate of its first piece."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self.encoder: StreamEncoder | None = None

    def of(self, sample_rate: int) -> StreamEncoder:
        if self.encoder is None:
            self.encoder = StreamEncoder(self.fmt, sample_rate)
        return self.encoder

    def feed(self, chunk: SpeechChunk) -> bytes:
        return self.of(chunk.sample_rate).feed(chunk.pcm)

    def finish(self) -> bytes:
        return self.encoder.finish() if self.encoder is not None else b""


class Quiet:
    """Nothing spoken yet within the patience of `_first`."""


QUIET = Quiet()


async def _first(pieces: Spoken, request: Request,
                 patience: float | None) -> SpeechChunk | Task | Quiet | None:
    """The first piece (or the finished task), QUIET when none came within `patience` s;
    None as soon as the client hangs up."""
    async def first() -> SpeechChunk | Task | Quiet:
        started = time.monotonic()
        while (item := await anext(pieces)) is None:
            if patience is not None and time.monotonic() - started >= patience:
                return QUIET
        return item

    return await unless_gone(first(), request)


async def _encoded(pieces: Spoken, first: SpeechChunk | None,
                   encoder: Encoding) -> AsyncIterator[bytes | Task | None]:
    """Encoded bytes of every piece as it comes (None for each silence), the encoder's last
    bytes, then the Task."""
    item: SpeechChunk | Task | None = first
    try:
        while not isinstance(item, Task):
            if item is None:
                yield None
            elif data := await asyncio.to_thread(encoder.feed, item):
                yield data
            item = await anext(pieces)
        if item.state == TaskState.SUCCEEDED and (tail := await asyncio.to_thread(
                encoder.finish)):
            yield tail
        yield item
    finally:
        await pieces.aclose()


async def _audio(pieces: Spoken, first: SpeechChunk | None,
                 encoder: Encoding) -> AsyncIterator[bytes]:
    """Raw audio has no room for a keep-alive: silences pass unsent."""
    async for item in _encoded(pieces, first, encoder):
        if isinstance(item, bytes):
            yield item
        elif isinstance(item, Task) and item.state != TaskState.SUCCEEDED:
            raise StreamBroken(f"task {item.id} ended {item.state.value} mid-stream: "
                               f"{item.error}")


async def _sse(pieces: Spoken, first: SpeechChunk | None, encoder: Encoding,
               characters: int) -> AsyncIterator[bytes]:
    """OpenAI's speech stream events; `usage` names the text's characters (what this
    service bills by: calls.stream_usage)."""
    try:
        async for item in _encoded(pieces, first, encoder):
            if item is None:
                yield KEEPALIVE
            elif isinstance(item, bytes):
                yield sse_event({"type": "speech.audio.delta",
                                 "audio": base64.b64encode(item).decode()})
            elif item.state == TaskState.SUCCEEDED:
                yield sse_event({"type": "speech.audio.done",
                                 "usage": stream_usage(characters=characters)})
            else:
                yield sse_error(task_failed(item))
    except RequestError as exc:  # timed out, the store gone too long, the audio missing
        yield sse_error(exc)
    except StoreError as exc:  # the finished task's audio could not be read
        yield sse_error(store_unavailable(exc))
    except AudioError as exc:  # a piece the encoder could not take
        yield sse_error(RequestError(500, str(exc)))
