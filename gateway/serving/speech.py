"""`POST /v1/audio/speech`: validate, queue a TTS task like any other, wait for it and answer
with its audio transcoded to the asked format, or stream it as it is spoken (`stream_format`,
gateway/serving/speech_stream.py); `GET /v1/tasks/{id}/audio`: a finished TTS
task's WAV, by signed URL or by its owner's key."""

from __future__ import annotations

import asyncio

from fastapi import Request
from fastapi.responses import Response

from common.audio import OUTPUT_FORMATS, AudioError, transcode
from common.schemas import INTERACTIVE, TaskState
from common.store import Task
from common.store.voices import VoiceStore
from common.stream_audio import STREAM_FORMATS
from gateway.auth import owner_or_none
from gateway.errors import RequestError
from gateway.policy.signing import output_url, token_valid
from gateway.serving.calls import (
    Disconnected,
    SyncCalls,
    public_model,
    response_format,
    task_failed,
    task_headers,
)
from gateway.serving.speech_stream import stream_reply
from gateway.serving.voices import use_custom_voice
from gateway.submit.enqueue import guard_store
from gateway.submit.inputs import Params, read_params
from gateway.submit.speech import tts_input
from gateway.submit.terms import SubmitTerms, default_lane


class SpeechServing:
    def __init__(self, calls: SyncCalls) -> None:
        self.calls = calls
        self.settings = calls.settings
        self.store = calls.store
        self.voices = VoiceStore.of(calls.store)

    async def create(self, request: Request, owner: str) -> Response:
        params = await read_params(request)
        await use_custom_voice(params, owner, self.voices)
        backend, model = public_model(self.settings, params, "tts-1", "tts")
        fmt = response_format(params, tuple(OUTPUT_FORMATS), "mp3")
        stream_format = _stream_format(params, fmt)
        terms = SubmitTerms.of(request, params, default_lane(self.settings, owner, INTERACTIVE),
                               self.settings)
        options, audio = await tts_input(params, self.settings, backend, text_param="input")
        if stream_format:  # its pieces reach the client as they are spoken: each is delivered
            options["streamed"] = True
        call = await self.calls.start(backend=backend, model=model, options=options,
                                      audio=audio, owner=owner, terms=terms)
        # past the timeout the audio stays fetchable (as WAV) at its URL once it finishes
        url = {"x-output-url": output_url(request, self.settings, call.task_id)}
        if stream_format:
            return await stream_reply(request, call, self.store, fmt=fmt,
                                      stream_format=stream_format,
                                      characters=len(options["text"]),
                                      headers={**url, **call.headers},
                                      send_timeout=self.settings.send_timeout_seconds,
                                      keepalive=self.settings.stream_keepalive_seconds)
        finished = await call.outcome(request, timeout_headers=url)
        if isinstance(finished, Disconnected):
            return Response(status_code=499)  # never delivered: the client is gone
        reply = await self._audio_reply(finished, fmt)
        reply.headers.update(call.headers)
        return reply

    async def _audio_reply(self, task: Task, response_format: str) -> Response:
        if task.state != TaskState.SUCCEEDED:
            raise task_failed(task)
        headers = task_headers(task.id)
        # the task SUCCEEDED (and is charged): the SDK's retry of a 5xx would speak it again
        # (its audio stays at its URL, x-output-url)
        final = task_headers(task.id, final=True)
        wav = await guard_store(self.store.blobs.output(task.id), final)
        if wav is None:
            raise RequestError(500, "the synthesized audio is missing", code="audio_missing",
                               headers=final)
        try:
            body, content_type = await asyncio.to_thread(transcode, wav, response_format)
        except AudioError as exc:
            raise RequestError(500, str(exc), headers=final) from None
        return Response(body, media_type=content_type, headers=headers)

    async def task_audio(self, request: Request, task_id: str, token: str | None) -> Response:
        task = await guard_store(self.store.get(task_id))
        audio = None
        if task is not None and task.state == TaskState.SUCCEEDED and self._may_read(
                request, task, token):
            audio = await guard_store(self.store.blobs.output(task.id))
        if audio is None:  # unknown, not yours, not finished or expired: all look the same
            raise RequestError(404, "unknown or expired audio", param="task_id",
                               code="audio_not_found")
        return Response(audio, media_type="audio/wav",
                        headers={"content-disposition": f'inline; filename="{task_id}.wav"'})

    def _may_read(self, request: Request, task: Task, token: str | None) -> bool:
        """A valid signed token, or (when API keys are on) the key that submitted the task."""
        if token_valid(self.settings, task.id, token):
            return True
        if not self.settings.api_keys:
            return False  # no keys: the signed URL is the only credential
        return owner_or_none(request, self.settings) == task.owner


def _stream_format(params: Params, fmt: str) -> str:
    """"audio" or "sse" when the caller asked for a stream, "" for the whole file at once
    (no stream_format: the reply has a Content-Length, and every format can be asked)."""
    value = (params.get("stream_format") or "").strip().lower()
    if value not in ("", "audio", "sse"):
        raise RequestError(400, "stream_format must be 'audio' or 'sse'", param="stream_format")
    if value and fmt not in STREAM_FORMATS:
        raise RequestError(400, f"response_format {fmt} cannot be streamed (its header is "
                                f"written last); stream one of {', '.join(STREAM_FORMATS)}, or "
                                "leave stream_format out to get the whole file",
                           param="response_format")
    return value
