"""`/v1/realtime?intent=transcription`: live transcription over a WebSocket, the OpenAI
Realtime transcription protocol (gateway/realtime/). Point the `openai` SDK's
`client.realtime.connect(extra_query={"intent": "transcription"})` at the gateway.

Two routes on one path: the WebSocket (`socket_router`: it checks the key itself, as a
header or a subprotocol, and closes with 1008 when it is wrong), and a plain GET (`router`,
behind the key like every route) that answers 426 and documents the protocol in /docs."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request, WebSocket

from gateway.auth import Owner
from gateway.dependencies import SettingsDep
from gateway.errors import RequestError, openai_errors
from gateway.protocol import ClientSecretRequest, json_body
from gateway.realtime.connection import RealtimeServing
from gateway.serving.client_secrets import create_client_secret

router = APIRouter(tags=["OpenAI realtime"])
socket_router = APIRouter()
PATH = "/v1/realtime"


@socket_router.websocket(PATH)
async def realtime(websocket: WebSocket) -> None:
    serving: RealtimeServing = websocket.app.state.realtime
    await serving.serve(websocket)


@router.get(PATH, status_code=426, responses=openai_errors(401, 426))
async def realtime_over_http() -> None:
    """**A WebSocket endpoint**: live transcription in the OpenAI Realtime protocol.

    Connect with `Upgrade: websocket` (key: `Authorization: Bearer KEY`, or the subprotocols
    `realtime, openai-insecure-api-key.KEY`; KEY may be an ephemeral `ek_…` key from
    `POST /v1/realtime/client_secrets`). The server sends `session.created`; send
    `session.update` (`session.type` `transcription`; `audio.input.format` `audio/pcm` at
    24000 or 16000 Hz, or G.711 `audio/pcmu` / `audio/pcma` at 8000 Hz;
    `audio.input.transcription` `{model, language, languages, prompt, keywords, delay}`;
    `audio.input.turn_detection` `server_vad` or null for manual commits), then
    `input_audio_buffer.append` (base64 PCM16 mono), `.commit`, `.clear`. Each turn yields
    `input_audio_buffer.speech_started` / `speech_stopped` / `committed`, then
    `conversation.item.input_audio_transcription.delta` per segment and `.completed` (or
    `.failed`). A plain HTTP GET is answered 426."""
    raise RequestError(426, "this is a WebSocket endpoint: connect with Upgrade: websocket "
                            f"(ws://HOST{PATH}?intent=transcription)", code="upgrade_required",
                       headers={"upgrade": "websocket"})


@router.post("/v1/realtime/client_secrets", responses=openai_errors(400, 401, 503),
             openapi_extra=json_body(ClientSecretRequest))
async def client_secrets(request: Request, owner: Owner, settings: SettingsDep) -> dict[str, Any]:
    """Mint an ephemeral key (`ek_…`) for a browser: it opens the realtime WebSocket only (as
    the subprotocol `openai-insecure-api-key.KEY`), as this key's owner (its quotas), with the
    given transcription `session`, until `expires_after.seconds` (10 to 7200; default 600)."""
    serving: RealtimeServing = request.app.state.realtime
    return await create_client_secret(request, owner, settings, serving.secrets)
