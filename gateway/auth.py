"""API keys: optional, stored as SHA-256 digests, compared in constant time, never logged.
The access rule of every route is `authorize`, one app-wide dependency.

    python -m gateway.auth NEW-KEY     # prints the digest to put in SPEECH_API_KEYS
"""

from __future__ import annotations

import hashlib
import hmac
import sys

from fastapi import Request

from gateway.inputs import RequestError
from gateway.state import settings_of

#: the only routes anyone may call; every other route needs a client key when keys are on
PUBLIC_ROUTES = frozenset({"/health", "/ready",
                           "/", "/static/{name}"})  # the try-it page: files, no data
#: routes that answer a bad or missing key themselves: a Sage status poll is always HTTP 200
#: JSON with a `status` (FAILED for a bad key)
SELF_REPORTING_ROUTES = frozenset({"/api/status", "/api/{backend}-status"})
#: a finished TTS task's audio: a signed `token` (checked by the route) instead of a key
SIGNED_AUDIO_ROUTE = "/v1/tasks/{task_id}/audio"
#: Prometheus: `metrics_token` instead of a key when set
METRICS_ROUTE = "/metrics"


async def authorize(request: Request) -> None:
    """The access rule of every route (registered once, on the app): 401 unless allowed."""
    path = getattr(request.scope.get("route"), "path", "")
    if path in PUBLIC_ROUTES or path in SELF_REPORTING_ROUTES:
        return
    if path == SIGNED_AUDIO_ROUTE and request.query_params.get("token"):
        return
    if path == METRICS_ROUTE and settings_of(request).metrics_token:
        if _is_metrics_token(request):
            return
        if not settings_of(request).api_keys:
            raise RequestError(401, "send the metrics token: 'Authorization: Bearer TOKEN'",
                               code="invalid_api_key", headers=_CHALLENGE)
    caller(request)


def is_authenticated(request: Request) -> bool:
    """Whether the caller may see internals (keys off, or a valid key)."""
    try:
        caller(request)
    except RequestError:
        return False
    return True


def _is_metrics_token(request: Request) -> bool:
    token = settings_of(request).metrics_token
    presented = presented_key(request) or ""
    if token.startswith("sha256:"):
        return hmac.compare_digest(digest(presented), token.removeprefix("sha256:").lower())
    return hmac.compare_digest(presented.encode(), token.encode())


_CHALLENGE = {"www-authenticate": "Bearer"}


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def presented_key(request: Request) -> str | None:
    authorization = request.headers.get("authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key") or None


def caller(request: Request) -> str:
    """The owner id of the caller's tasks ("" when keys are off); 401 for a bad key."""
    digests = [d.removeprefix("sha256:").lower() for d in settings_of(request).api_keys]
    if not digests:
        return ""
    key = presented_key(request)
    if key is None:
        raise RequestError(401, "missing API key: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key", headers=_CHALLENGE)
    presented = digest(key)
    matched = False
    for stored in digests:  # no early exit: the time taken does not depend on which matched
        matched |= hmac.compare_digest(presented, stored)
    if not matched:
        raise RequestError(401, "invalid API key", code="invalid_api_key", headers=_CHALLENGE)
    return presented[:16]


if __name__ == "__main__":
    print("sha256:" + digest(sys.argv[1]))
