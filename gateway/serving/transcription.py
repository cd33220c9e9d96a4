"""`POST /v1/audio/transcriptions` and `/v1/audio/translations`: validate, queue the task
already subscribed to its events, then stream its segments or wait and answer in the asked
format. Every refusal is a RequestError, rendered by the app."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from common import formats
from common.catalog import BACKENDS
from common.languages import LANGUAGE_NAMES
from common.schemas import INTERACTIVE, TaskState
from common.store import Task
from gateway.errors import RequestError
from gateway.protocol import TRANSCRIPTION_FORMATS
from gateway.serving.calls import (
    KEEPALIVE,
    Deltas,
    Disconnected,
    Events,
    SyncCalls,
    metered_seconds,
    public_model,
    response_format,
    sse_error,
    sse_event,
    sse_reply,
    still_running,
    stream_usage,
    task_failed,
    task_headers,
    unless_gone,
)
from gateway.submit.diarization import asr_input
from gateway.submit.enqueue import refuse_fetch_if_full
from gateway.submit.inputs import Params, read_params
from gateway.submit.terms import SubmitTerms, default_lane

SEGMENT_FIELDS = ("id", "seek", "start", "end", "text", "tokens", "temperature", "avg_logprob",
                  "compression_ratio", "no_speech_prob")


@dataclass(slots=True)
class Asked:
    """What the caller asked for besides the task itself: how to answer."""

    task: str  # transcribe | translate
    response_format: str
    granularities: set[str]
    stream: bool
    #: known_speaker_names were given: speakers keep their labels (else A, B, …)
    known_speakers: bool = False


class TranscriptionServing:
    def __init__(self, calls: SyncCalls) -> None:
        self.calls = calls
        self.settings = calls.settings

    async def create(self, request: Request, owner: str, task: str) -> Response:
        params = await read_params(request)
        if "file" not in params.files:
            raise RequestError(400, "missing the 'file' upload", param="file")
        backend, model = public_model(self.settings, params, "whisper-1", "asr")
        fmt = response_format(params, TRANSCRIPTION_FORMATS, "json")
        if task == "translate" and fmt == "diarized_json":  # OpenAI's is the transcription's
            raise RequestError(400, "a translation has no diarized_json; use "
                                    "/v1/audio/transcriptions for speakers",
                               param="response_format")
        row = BACKENDS[backend]
        if fmt == "diarized_json" and not (row.speakers or row.diarization):
            raise RequestError(400, f"{backend} does not identify speakers; diarized_json needs "
                                    "a backend that does (see /api/config)",
                               param="response_format")
        if fmt == "diarized_json" and not row.speakers:
            params.override("diarize", "true")  # the diarizing format diarizes
        granularities = _granularities(params)
        params.override("task", task)
        params.override("word_timestamps", "true" if "word" in granularities else "false")
        if "word" in granularities and not BACKENDS[backend].word_timestamps:
            raise RequestError(400, f"{backend} has no word timestamps",
                               param="timestamp_granularities[]")
        if task == "translate":
            params.override("language", None)  # the output language of a translation is English
        terms = SubmitTerms.of(request, params, default_lane(self.settings, owner, INTERACTIVE),
                               self.settings)
        stream = params.flag("stream")  # a bad flag is refused before the upload is staged
        await refuse_fetch_if_full(self.calls.store, self.settings, owner, params, terms)
        # the upload is staged in Redis from here on: calls.start drops it if it refuses
        options, audio = await asr_input(params, self.settings, backend,
                                         self.calls.store.blobs)
        asked = Asked(task, fmt, granularities, stream,
                      known_speakers=bool((options.get("diarization") or {}).get("names")))
        if stream:  # its segments reach the client as they are published: each is delivered
            options["streamed"] = True

        call = await self.calls.start(backend=backend, model=model, options=options,
                                      audio=audio, owner=owner, terms=terms)
        if asked.stream:
            # the reply waits for the first segment, the end or one keep-alive interval: an
            # outcome before then is the reply's status (a 503 the SDK retries, 429, 409 …),
            # as a streamed speech's is; after it, the stream's `error` event
            try:
                first = await _first_event(call.events, request)
            except BaseException:  # (the events hold the key's waiter: given back)
                await call.events.aclose()
                raise
            if first is None:
                return Response(status_code=499)  # never delivered: the client is gone
            last = first[-1]
            if last["type"] == "timeout" or (last["type"] == "done"
                                             and last["task"].state != TaskState.SUCCEEDED):
                await call.events.aclose()
                error = (still_running(call.task_id) if last["type"] == "timeout"
                         else task_failed(last["task"]))
                error.headers = {**call.headers, **(error.headers or {})}
                raise error
            return sse_reply(_sse(call.events, call.task_id, asked, first),
                             self.settings.send_timeout_seconds,
                             {**task_headers(call.task_id), **call.headers})
        finished = await call.outcome(request)
        if isinstance(finished, Disconnected):
            return Response(status_code=499)  # never delivered: the client is gone
        reply = render(finished, asked)
        reply.headers.update(call.headers)
        return reply


def _granularities(params: Params) -> set[str]:
    values = params.lists.get("timestamp_granularities[]", []) + params.lists.get(
        "timestamp_granularities", [])
    found: set[str] = set()
    for value in values:
        items: Any = [value]
        if value.lstrip().startswith("["):  # a JSON list in one field
            try:
                items = json.loads(value)
            except (ValueError, RecursionError):
                items = None
        if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
            raise RequestError(400, "timestamp_granularities must be 'word', 'segment' or a "
                                    "list of them", param="timestamp_granularities[]")
        found.update(item.strip().lower() for item in items)
    if found - {"word", "segment"}:
        raise RequestError(400, "timestamp_granularities may hold 'word' and 'segment'",
                           param="timestamp_granularities[]")
    return found or {"segment"}


def render(task: Task, asked: Asked) -> Response:
    """The finished task in the asked format (protocol.Transcription, TranscriptionVerbose,
    TranscriptionDiarized, or text)."""
    if task.state != TaskState.SUCCEEDED or task.result is None:
        raise task_failed(task)
    result = task.result
    segments = result["segments"]
    headers = task_headers(task.id)
    usage = _usage(result)
    if asked.response_format == "text":
        return PlainTextResponse(result["text"] + "\n", headers=headers)
    if asked.response_format == "srt":
        # (Starlette adds a charset to text/* only: a client guessing the encoding of
        # another type may read non-ASCII cues wrong)
        return PlainTextResponse(formats.srt(segments), headers=headers,
                                 media_type="application/x-subrip; charset=utf-8")
    if asked.response_format == "vtt":
        return PlainTextResponse(formats.vtt(segments), headers=headers,
                                 media_type="text/vtt")
    if asked.response_format == "json":
        return JSONResponse({"text": result["text"], "usage": usage}, headers=headers)
    if asked.response_format == "diarized_json":
        return JSONResponse({"task": asked.task, "duration": result["duration"],
                             "text": result["text"],
                             "segments": [_diarized(s) for s in speakers_lettered(segments, asked)],
                             "usage": usage},
                            headers=headers)
    body: dict[str, Any] = {"task": asked.task, "language": _language(result, asked),
                            "duration": float(result["duration"]), "text": result["text"],
                            "usage": usage}
    if "segment" in asked.granularities:
        body["segments"] = [{field: s.get(field) for field in SEGMENT_FIELDS}
                            for s in segments]
    if "word" in asked.granularities:
        body["words"] = [{"word": w["word"], "start": w["start"], "end": w["end"]}
                         for s in segments for w in s.get("words") or []]
    return JSONResponse(body, headers=headers)


def speakers_lettered(segments: list[dict[str, Any]], asked: Asked) -> list[dict[str, Any]]:
    """`segments` with diarized_json's speaker labels: without known_speaker_names, the
    speakers are A, B, … in order of first appearance, as OpenAI's; with them, the labels
    (the names) as they are. The task keeps its own labels (SPEAKER_00, …) for the Sage and
    native routes, and srt/vtt cues show those too."""
    if asked.known_speakers:
        return segments
    letters: dict[str, str] = {}
    for segment in segments:
        if (speaker := segment.get("speaker")) is not None:
            letters.setdefault(speaker, _letters(len(letters)))
    return [{**s, "speaker": letters[s["speaker"]]} if s.get("speaker") is not None else s
            for s in segments]


#: diarized_json's label of a segment with no speaker found
UNKNOWN_SPEAKER = "unknown"


def _letters(index: int) -> str:
    """A, B, … Z, then AA, AB, … (spreadsheet columns)."""
    name = ""
    index += 1
    while index:
        index, rest = divmod(index - 1, 26)
        name = chr(ord("A") + rest) + name
    return name


def _diarized(segment: dict[str, Any]) -> dict[str, Any]:
    """A segment of diarized_json, also the `transcript.text.segment` event of a stream."""
    return {"type": "transcript.text.segment", "id": str(segment["id"]),
            "start": segment["start"], "end": segment["end"], "text": segment["text"],
            # a segment no speaker was found for (no speech the VAD heard there): a label
            # no speaker has (it read "A", the first speaker's)
            "speaker": segment.get("speaker") or UNKNOWN_SPEAKER}


#: verbose_json's `language` where the engine names none (Parakeet, VibeVoice not told one):
#: the SDK's type is a string, never null
UNKNOWN_LANGUAGE = "unknown"


def _language(result: dict[str, Any], asked: Asked) -> str:
    """verbose_json's `language`: OpenAI's name ("english"); a translation's is English."""
    if asked.task == "translate":
        return "english"
    code = result.get("language")
    if not isinstance(code, str) or not code:
        return UNKNOWN_LANGUAGE
    code = code.lower()
    return LANGUAGE_NAMES.get(code) or LANGUAGE_NAMES.get(code.split("-", 1)[0], code)


def _usage(result: dict[str, Any]) -> dict[str, Any]:
    return {"type": "duration", "seconds": metered_seconds(result["usage"]["audio_seconds"])}


def _done_usage(result: dict[str, Any]) -> dict[str, Any]:
    """`transcript.text.done`'s usage: the SDK reads only token usage there (calls.stream_usage)."""
    return stream_usage(seconds=metered_seconds(result["usage"]["audio_seconds"]))


async def _first_event(events: Events, request: Request) -> list[dict[str, Any]] | None:
    """The events up to the first one a stream's reply waits for (a segment with text, the
    end, or a tick: nothing within one keep-alive interval, the stream starts without it),
    that one last: the segments without text before it still count for `Deltas` (their
    ids). None as soon as the client hangs up."""
    seen: list[dict[str, Any]] = []

    async def first() -> list[dict[str, Any]]:
        async for event in events:
            seen.append(event)
            if event["type"] != "segment" or event.get("text"):
                return seen
        return [*seen, {"type": "tick"}]  # (the events end with their done or timeout)

    if (found := await unless_gone(first(), request)) is None:
        await events.aclose()
    return found


async def _prepended(first: list[dict[str, Any]], events: Events) -> Events:
    for event in first:
        yield event
    async for event in events:
        yield event


async def _sse(events: Events, task_id: str, asked: Asked,
               first: list[dict[str, Any]]) -> AsyncIterator[bytes]:
    """Deltas as the worker transcribes (from `first`, the events the reply waited for), then
    `transcript.text.done`. A diarized_json stream sends its deltas (with their
    `segment_id`) and `transcript.text.segment` events once the task is done: diarization,
    which may split segments, runs after transcription."""
    diarized = asked.response_format == "diarized_json"
    deltas = Deltas()
    try:
        async for event in _prepended(first, events):
            if event["type"] == "segment" and not diarized:
                if delta := deltas.of(event):
                    yield sse_event({"type": "transcript.text.delta", "delta": delta})
            elif event["type"] == "tick":
                yield KEEPALIVE
            elif event["type"] == "done":
                task = event["task"]
                if (not diarized and task.state == TaskState.SUCCEEDED and task.result
                        and (rest := deltas.closing(str(task.result.get("text", ""))))):
                    yield sse_event({"type": "transcript.text.delta", "delta": rest})
                for chunk in _finish(task, asked):
                    yield chunk
            elif event["type"] == "timeout":
                yield sse_error(still_running(task_id))
    finally:
        await events.aclose()  # the waiter, released as soon as the stream ends


def _deltas(text: str, pieces: list[str]) -> list[str]:
    """The segments' texts as deltas that add up to `text` (whatever the engine joined them
    with): each runs from where the one before ended to the end of its own text in `text`;
    a piece not found there (a blank one, or one the diarizer rebuilt from words) is "", the
    next found one's delta covering it, and the last delta takes what is left."""
    deltas, at = [], 0
    for piece in pieces:
        found = text.find(piece.strip(), at) if piece.strip() else -1
        if found < 0:
            deltas.append("")
            continue
        end = found + len(piece.strip())
        deltas.append(text[at:end])
        at = end
    if deltas:
        deltas[-1] += text[at:]
    return deltas


def _finish(task: Task, asked: Asked) -> list[bytes]:
    """The events that end a stream: a diarized one's segments, then the text; or an error."""
    if task.state != TaskState.SUCCEEDED or task.result is None:
        return [sse_error(task_failed(task))]
    chunks = []
    if asked.response_format == "diarized_json":
        segments = speakers_lettered(task.result["segments"], asked)
        deltas = _deltas(task.result["text"], [segment["text"] for segment in segments])
        for segment, delta in zip(segments, deltas, strict=True):
            event = _diarized(segment)
            chunks.append(sse_event({"type": "transcript.text.delta", "delta": delta,
                                     "segment_id": event["id"]}))
            chunks.append(sse_event(event))
    chunks.append(sse_event({"type": "transcript.text.done", "text": task.result["text"],
                             "usage": _done_usage(task.result)}))
    return chunks
