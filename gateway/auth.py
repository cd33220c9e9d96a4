"""API keys: optional, stored as SHA-256 digests, compared in constant time, never logged.

    python -m gateway.auth NEW-KEY     # prints the digest to put in SPEECH_API_KEYS
"""

from __future__ import annotations

import hashlib
import hmac
import sys

from fastapi import Request

from gateway.inputs import RequestError
from gateway.state import settings_of

PUBLIC_PATHS = frozenset({"/health", "/ready"})


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
                           code="invalid_api_key")
    presented = digest(key)
    matched = False
    for stored in digests:  # no early exit: the time taken does not depend on which matched
        matched |= hmac.compare_digest(presented, stored)
    if not matched:
        raise RequestError(401, "invalid API key", code="invalid_api_key")
    return presented[:16]


if __name__ == "__main__":
    print("sha256:" + digest(sys.argv[1]))
