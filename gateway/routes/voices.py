"""Custom voices with consent, in OpenAI's shapes (`client.audio.voice_consents`,
`client.audio.voices`). The logic is in gateway/serving/voices.py."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Query, Request

from common.store.voices import CONSENTS, VOICES
from gateway.auth import Owner
from gateway.errors import openai_errors
from gateway.protocol import (
    VoiceConsentRequest,
    VoiceConsentUpdate,
    VoiceRequest,
    form_body,
    json_body,
)
from gateway.serving.voices import VoiceServing

router = APIRouter(tags=["OpenAI custom voices"])
CONSENTS_PATH = "/v1/audio/voice_consents"
VOICES_PATH = "/v1/audio/voices"
CHECKED = openai_errors(400, 401, 404, 413, 429, 503, 504)
FOUND = openai_errors(401, 404, 503)
CHANGED = openai_errors(400, 401, 404, 503)


def voice_serving(request: Request) -> VoiceServing:
    return request.app.state.voices


Serving = Annotated[VoiceServing, Depends(voice_serving)]
After = Annotated[str | None, Query(description="the last id of the previous page")]
Limit = Annotated[int, Query(description="1 to 100")]


@router.post(CONSENTS_PATH, responses=CHECKED, openapi_extra=form_body(VoiceConsentRequest))
async def create_consent(request: Request, owner: Owner, serving: Serving) -> dict[str, Any]:
    """A consent recording (multipart: `recording`, `name`, `language`): its transcript must
    read the consent phrase of `language` (`/api/config` lists them as `consent_phrases`);
    a 400 `consent_phrase_mismatch` if it does not."""
    return await serving.create_consent(request, owner)


@router.get(CONSENTS_PATH, responses=FOUND)
async def list_consents(owner: Owner, serving: Serving, after: After = None,
                        limit: Limit = 20) -> dict[str, Any]:
    """This key's consent recordings, newest first (cursor page)."""
    return await serving.list(CONSENTS, owner, after, limit)


@router.get(CONSENTS_PATH + "/{consent_id}", responses=FOUND)
async def retrieve_consent(consent_id: str, owner: Owner, serving: Serving) -> dict[str, Any]:
    return await serving.retrieve_consent(owner, consent_id)


@router.post(CONSENTS_PATH + "/{consent_id}", responses=CHANGED,
             openapi_extra=json_body(VoiceConsentUpdate))
async def update_consent(consent_id: str, request: Request, owner: Owner,
                         serving: Serving) -> dict[str, Any]:
    """Rename a consent recording (`name`)."""
    return await serving.update_consent(request, owner, consent_id)


@router.delete(CONSENTS_PATH + "/{consent_id}", responses=FOUND)
async def delete_consent(consent_id: str, owner: Owner, serving: Serving) -> dict[str, Any]:
    """Delete a consent recording, and the voices made under it."""
    return await serving.delete_consent(owner, consent_id)


@router.post(VOICES_PATH, responses=CHECKED, openapi_extra=form_body(VoiceRequest))
async def create_voice(request: Request, owner: Owner, serving: Serving) -> dict[str, Any]:
    """A voice from a sample (multipart: `audio_sample` ≤ 30 s and 10 MiB, `consent`,
    `name`): the sample's speaker must match the consent recording's (voiceprint); a 400
    `voice_mismatch` if not. Use it as `voice: {"id": …}` in speech."""
    return await serving.create_voice(request, owner)


@router.get(VOICES_PATH, responses=FOUND)
async def list_voices(owner: Owner, serving: Serving, after: After = None,
                      limit: Limit = 20) -> dict[str, Any]:
    """This key's voices, newest first (cursor page)."""
    return await serving.list(VOICES, owner, after, limit)


@router.get(VOICES_PATH + "/{voice_id}", responses=FOUND)
async def retrieve_voice(voice_id: str, owner: Owner, serving: Serving) -> dict[str, Any]:
    return await serving.retrieve_voice(owner, voice_id)


@router.delete(VOICES_PATH + "/{voice_id}", responses=FOUND)
async def delete_voice(voice_id: str, owner: Owner, serving: Serving) -> dict[str, Any]:
    return await serving.delete_voice(owner, voice_id)
