"""Speech output: `POST /v1/audio/speech` (OpenAI shape, through the queue) and
`GET /v1/tasks/{id}/audio` (a finished TTS task's WAV). The logic is in
gateway/serving/speech.py."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from gateway.auth import SIGNED_AUDIO_ROUTE, Owner
from gateway.errors import openai_errors
from gateway.protocol import SPEECH_FORMATS, SpeechRequest, json_body
from gateway.serving.speech import SpeechServing

router = APIRouter(tags=["OpenAI audio"])
#: its own access rule (a signed token instead of a key): see create_app
audio_router = APIRouter(tags=["Tasks"])


async def speech_serving(request: Request) -> SpeechServing:
    return request.app.state.speech


Serving = Annotated[SpeechServing, Depends(speech_serving)]
AUDIO = {"content": {"audio/mpeg": {}, "audio/ogg": {}, "audio/aac": {}, "audio/flac": {},
                     "audio/wav": {}, "audio/pcm": {},
                     "text/event-stream": {"description": "with `stream_format=sse`"}}}


@router.post("/v1/audio/speech", openapi_extra=json_body(SpeechRequest),
             responses={200: {"description": f"The audio, as `response_format` "
                                             f"({', '.join(SPEECH_FORMATS)})", **AUDIO},
                        **openai_errors(400, 401, 404, 409, 413, 429, 500, 503, 504)})
async def speech(request: Request, owner: Owner, serving: Serving) -> Response:
    """Speak a text (XTTS): queued like any task, answered with the audio when it finishes,
    or, with `stream_format`, sent sentence by sentence as it is spoken."""
    return await serving.create(request, owner)


@audio_router.get(SIGNED_AUDIO_ROUTE,
                  responses={200: {"description": "The task's WAV",
                                   "content": {"audio/wav": {}}},
                             **openai_errors(401, 404, 503)})
async def task_audio(request: Request, task_id: str, serving: Serving,
                     token: str | None = None) -> Response:
    """A finished TTS task's audio: with the signed `token` of its `output_url`, or (API keys
    on) the key that submitted it."""
    return await serving.task_audio(request, task_id, token)
