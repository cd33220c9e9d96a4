"""OpenAI-compatible audio API: transcriptions, translations, models. The logic is in
gateway/serving/; these calls use the same queue and workers as async tasks."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from gateway.auth import Owner
from gateway.dependencies import SettingsDep
from gateway.errors import openai_errors
from gateway.protocol import (
    TRANSCRIPTION_CONTENT,
    ModelCard,
    ModelList,
    Transcription,
    TranscriptionDiarized,
    TranscriptionRequest,
    TranscriptionVerbose,
    TranslationRequest,
    form_body,
)
from gateway.serving.models import model_card, model_list
from gateway.serving.transcription import TranscriptionServing

router = APIRouter(tags=["OpenAI audio"])


async def transcription_serving(request: Request) -> TranscriptionServing:
    return request.app.state.transcription


Serving = Annotated[TranscriptionServing, Depends(transcription_serving)]
TRANSCRIBED = {200: {"model": Transcription | TranscriptionVerbose | TranscriptionDiarized,
                     "description": "The transcript in `response_format`",
                     "content": TRANSCRIPTION_CONTENT}}
ASR_ERRORS = openai_errors(400, 401, 404, 409, 413, 429, 500, 503, 504)


@router.post("/v1/audio/transcriptions", openapi_extra=form_body(TranscriptionRequest),
             responses={**TRANSCRIBED, **ASR_ERRORS})
async def transcriptions(request: Request, owner: Owner, serving: Serving) -> Response:
    """Transcribe an upload: queued like any task, answered when it finishes."""
    return await serving.create(request, owner, "transcribe")


@router.post("/v1/audio/translations", openapi_extra=form_body(TranslationRequest),
             responses={**TRANSCRIBED, **ASR_ERRORS})
async def translations(request: Request, owner: Owner, serving: Serving) -> Response:
    """Translate an upload into English text."""
    return await serving.create(request, owner, "translate")


@router.get("/v1/models", responses={200: {"model": ModelList}, **openai_errors(401)})
async def models(settings: SettingsDep) -> JSONResponse:
    """Every configured model (`BACKEND/MODEL`) and alias."""
    return JSONResponse(model_list(settings).model_dump(exclude_none=True))


@router.get("/v1/models/{model:path}", responses={200: {"model": ModelCard},
                                                  **openai_errors(401, 404)})
async def model(model: str, settings: SettingsDep) -> JSONResponse:
    """One model or alias, as `GET /v1/models` lists it (an id may hold a `/`)."""
    return JSONResponse(model_card(settings, model).model_dump(exclude_none=True))
