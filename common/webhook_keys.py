"""Webhook signing secrets ("whsec_<base64>", Standard Webhooks): their rules and their keys,
for the global `SPEECH_WEBHOOK_SECRETS` and a key's own."""

from __future__ import annotations

import base64
import binascii
import re

#: a webhook key id travels in a space-separated header (`webhook-key-id`)
WEBHOOK_KEY_ID = re.compile(r"[A-Za-z0-9._-]{1,64}")
#: shortest webhook secret (decoded); Standard Webhooks asks for 24 to 64 bytes
WEBHOOK_SECRET_MIN_BYTES = 24


def check_webhook_secrets(secrets: dict[str, str]) -> dict[str, str]:
    for key_id, secret in secrets.items():
        if not WEBHOOK_KEY_ID.fullmatch(key_id):
            raise ValueError(f"webhook key id {key_id!r}: use 1 to 64 of A-Z a-z 0-9 . _ -")
        try:
            size = len(webhook_key(secret))
        except (ValueError, binascii.Error):
            size = 0
        if size < WEBHOOK_SECRET_MIN_BYTES:
            raise ValueError(f"webhook secret {key_id!r} must be 'whsec_' and the base64 of "
                             f"at least {WEBHOOK_SECRET_MIN_BYTES} random bytes")
    return secrets


def webhook_key(secret: str) -> bytes:
    """The HMAC key of a `whsec_<base64>` webhook secret (Standard Webhooks)."""
    if not secret.startswith("whsec_"):
        raise ValueError("not a whsec_ secret")
    return base64.b64decode(secret.removeprefix("whsec_"), validate=True)
