"""`/v1/realtime?intent=transcription`: live transcription over a WebSocket, the OpenAI
Realtime transcription protocol (gateway/realtime/). Point the `openai` SDK's
`client.realtime.connect(extra_query={"intent": "transcription"})` at the gateway.

Two routes on one path: the WebSocket (`socket_router`: it checks the key itself, as a
header or a subprotocol, and closes with 1008 when it is wrong), and a plain GET (`router`,
behind the key like every route) that answers 426 and documents the protocol in /docs."""

from __future__ import annotations

from fastapi import APIRouter, WebSocket

from gateway.errors import RequestError, openai_errors
from gateway.realtime.connection import RealtimeServing

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
    `realtime, openai-insecure-api-key.KEY`). The server sends `session.created`; send
    `session.update` (`session.type` `transcription`; `audio.input.format` `audio/pcm` at
    24000 or 16000 Hz; `audio.input.transcription` `{model, language, prompt}`;
    `audio.input.turn_detection` `server_vad` or null for manual commits), then
    `input_audio_buffer.append` (base64 PCM16 mono), `.commit`, `.clear`. Each turn yields
    `input_audio_buffer.speech_started` / `speech_stopped` / `committed`, then
    `conversation.item.input_audio_transcription.delta` per segment and `.completed` (or
    `.failed`). A plain HTTP GET is answered 426."""
    raise RequestError(426, "this is a WebSocket endpoint: connect with Upgrade: websocket "
                            f"(ws://HOST{PATH}?intent=transcription)", code="upgrade_required",
                       headers={"upgrade": "websocket"})
