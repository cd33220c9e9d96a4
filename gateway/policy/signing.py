"""Signed audio URLs: a finished TTS task's `output_url` carries an HMAC token, so a player
fetches the audio without the API key (`SPEECH_URL_SIGNING_KEY`)."""

from __future__ import annotations

import hashlib
import hmac

from fastapi import Request

from common.settings import Settings

TOKEN_HEX_CHARS = 32  # 128 bits of HMAC-SHA256


def audio_token(settings: Settings, task_id: str) -> str:
    digest = hmac.new(settings.url_signing_key(), task_id.encode(), hashlib.sha256).hexdigest()
    return digest[:TOKEN_HEX_CHARS]


def token_valid(settings: Settings, task_id: str, token: str | None) -> bool:
    expected = audio_token(settings, task_id).encode()
    return bool(token) and hmac.compare_digest(expected, (token or "").encode())


def output_url(request: Request, settings: Settings, task_id: str) -> str:
    """Absolute URL of the task's audio: `public_url` if set, else the URL this request came to."""
    base = (settings.public_url or str(request.base_url)).rstrip("/")
    return f"{base}/v1/tasks/{task_id}/audio?token={audio_token(settings, task_id)}"
