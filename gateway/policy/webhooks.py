"""Signed webhooks (issue 18): what a submit's `callback_url` may be, and how a delivery is
signed. gateway/jobs/deliverer.py sends them.

Signatures follow Standard Webhooks (what OpenAI's own webhooks use, so its SDK's
`client.webhooks.verify_signature` checks ours): `webhook-id` is the event id,
`webhook-timestamp` the send time (epoch seconds), and `webhook-signature` is
`v1,<base64 HMAC-SHA256 of "{id}.{timestamp}.{body}">`, once per configured secret (space
separated, in `SPEECH_WEBHOOK_SECRETS` order), so a receiver that knows any one of the
secrets verifies it: secrets rotate without a flag day. `webhook-key-id` names the keys in
the same order.
"""

from __future__ import annotations

import base64
import hashlib
import hmac

from common.schemas import TaskState
from common.settings import Settings
from common.webhook_keys import webhook_key
from gateway.errors import RequestError
from gateway.policy.hosts import checked_url

MAX_CALLBACK_URL = 2048
REFUSED = "callback_url_not_allowed"


def callback_url(raw: str | None, settings: Settings) -> str:
    """The submit's `callback_url` ("" when absent), checked against the allow-list: a 400
    (`callback_url_not_allowed`) for anything else, before anything is queued. (A gateway
    with an allow-list has secrets too: create_app refuses to start otherwise.)"""
    if raw is None:
        return ""
    if len(raw) > MAX_CALLBACK_URL:
        raise RequestError(400, f"callback_url is longer than {MAX_CALLBACK_URL} characters",
                           param="callback_url", code=REFUSED)
    url = raw.strip()
    if any(not char.isprintable() or char.isspace() for char in url):  # CR/LF, tabs, spaces
        raise RequestError(400, "callback_url must be an http(s) URL without spaces or control "
                                "characters", param="callback_url")
    parts = checked_url(url, settings.callback_url_hosts, "callback_url", REFUSED)
    if "@" in parts.netloc:
        # Credentials would be stored with the task, shown by /v1/tasks and its deliveries,
        # and sent to the receiver in the clear; the signature is how a receiver knows us.
        raise RequestError(400, "callback_url must not carry credentials (user:password@): "
                                "receivers verify the webhook-signature header instead",
                           param="callback_url")
    return parts.geturl()


def event_id(task_id: str, state: TaskState) -> str:
    """One per task and terminal state: every attempt and redelivery carries it, so a
    receiver can drop repeats (delivery is at-least-once)."""
    return f"evt_{task_id}_{state.value.lower()}"


def signature_headers(secrets: dict[str, str], event: str, timestamp: int,
                      body: bytes) -> dict[str, str]:
    """The Standard Webhooks headers of one attempt, signed with every secret."""
    signed = f"{event}.{timestamp}.".encode() + body
    signatures = [base64.b64encode(hmac.new(webhook_key(secret), signed, hashlib.sha256)
                                   .digest()).decode() for secret in secrets.values()]
    return {"webhook-id": event, "webhook-timestamp": str(timestamp),
            "webhook-signature": " ".join(f"v1,{sig}" for sig in signatures),
            "webhook-key-id": " ".join(secrets)}
