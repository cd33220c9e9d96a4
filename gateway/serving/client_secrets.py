"""`POST /v1/realtime/client_secrets`: a short-lived key for a browser's live session.

The key opens only the realtime WebSocket (gateway/auth.py), as the minting key's owner, so
its turns count against that key's quotas; its sessions start with the `session` it was
minted with (checked here, as a session.update would be). It works until `expires_after`
(default SPEECH_CLIENT_SECRET_SECONDS); a session it opened goes on after that, as OpenAI's do.
"""

from __future__ import annotations

import json
from typing import Any

from fastapi import Request

from common.settings import Settings
from common.store.client_secrets import ClientSecretStore, TooManySecrets
from gateway.errors import RequestError
from gateway.realtime.protocol import (
    LONE_SURROGATE,
    ProtocolError,
    SessionConfig,
    holds_lone_surrogate,
    new_id,
    updated,
)
from gateway.realtime.session import resolve
from gateway.submit.enqueue import guard_store

MIN_SECONDS, MAX_SECONDS = 10, 7200
#: a session's configuration is a few hundred bytes; the store keeps it for the key's life
MAX_BODY_BYTES = 64 * 1024


async def create_client_secret(request: Request, owner: str, settings: Settings,
                               secrets: ClientSecretStore) -> dict[str, Any]:
    body = await _json_object(request)
    seconds = _seconds(body.get("expires_after"), settings.client_secret_seconds)
    session = body.get("session")
    if session is None:
        session = {"type": "transcription"}
    if not isinstance(session, dict) or session.get("type") != "transcription":
        raise RequestError(400, "this server serves transcription sessions only: "
                                "session.type must be 'transcription'", param="session.type")
    try:
        config = updated(SessionConfig(), session, None)
        if config.transcription is not None:
            resolve(settings, config.transcription)
    except ProtocolError as exc:
        raise RequestError(400, exc.message, param=exc.param, code=exc.code) from None
    checked = config.public(new_id("sess"))  # what is stored: the fields read, nothing else
    most = settings.client_secrets_per_key if settings.api_key(owner) is not None else 0
    try:
        value, expires_at = await guard_store(secrets.mint(owner, checked, seconds, most))
    except TooManySecrets:
        raise RequestError(429, f"this key has {most} client secrets alive, its most at once "
                                "(SPEECH_CLIENT_SECRETS_PER_KEY); mint more as they expire, or "
                                "mint shorter-lived ones", code="too_many_client_secrets",
                           headers={"Retry-After": "60"}) from None
    return {"value": value, "expires_at": expires_at,
            "session": {**checked, "expires_at": expires_at}}


async def _json_object(request: Request) -> dict[str, Any]:
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise RequestError(413, f"the body is larger than {MAX_BODY_BYTES} bytes")
    if not raw:
        return {}
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise RequestError(400, "the JSON body is not valid JSON") from None
    if not isinstance(body, dict):
        raise RequestError(400, "the JSON body must be an object")
    if holds_lone_surrogate(raw, body):
        raise RequestError(400, LONE_SURROGATE)
    return body


def _seconds(given: Any, default: int) -> int:
    if given is None:
        return default
    if not isinstance(given, dict):
        raise RequestError(400, "expires_after must be an object", param="expires_after")
    if given.get("anchor", "created_at") != "created_at":
        raise RequestError(400, "expires_after.anchor must be 'created_at'",
                           param="expires_after.anchor")
    seconds = given.get("seconds", default)
    if (not isinstance(seconds, int) or isinstance(seconds, bool)
            or not MIN_SECONDS <= seconds <= MAX_SECONDS):
        raise RequestError(400, f"expires_after.seconds must be an integer from {MIN_SECONDS} "
                                f"to {MAX_SECONDS}", param="expires_after.seconds")
    return seconds
