"""API keys: optional, stored as SHA-256 digests, looked up by digest, never logged.

Access rules are router dependencies, attached in `gateway.app.create_app`, where the public
and the protected routers are listed:

- `require_key`: every protected router. A Sage status poll refused here still reads as
  HTTP 200 (`gateway.errors.SAGE_STATUS_ROUTES`).
- `require_key_or_metrics_token`: `/metrics` (`SPEECH_METRICS_TOKEN`, for Prometheus).
- `require_key_or_signed_url`: a finished TTS task's audio (a signed `token`, checked by
  the route, instead of a key).
- `websocket_caller`: the live transcription WebSocket, which checks its key itself (a
  header, or a subprotocol) and refuses with close code 1008 (gateway/realtime/). It alone
  also takes an ephemeral key (`ek_…`, from `POST /v1/realtime/client_secrets`): its
  minting key's owner, until it expires; every other route refuses one with a 401.
- none: the routes in `PUBLIC_ROUTES`, and only those (create_app checks).

    python -m gateway.auth NEW-KEY     # prints the digest to put in SPEECH_API_KEYS
"""

from __future__ import annotations

import hashlib
import hmac
import sys
from typing import Annotated, Any

from fastapi import Depends, Request, WebSocket
from starlette.requests import HTTPConnection
from starlette.types import Scope

from common.settings import Settings
from common.store import StoreError
from common.store.client_secrets import ClientSecretStore, is_client_secret
from gateway.dependencies import SettingsDep
from gateway.errors import RequestError

#: the only routes anyone may call; every other route needs a client key when keys are on
PUBLIC_ROUTES = frozenset({"/health", "/ready",
                           "/", "/static/{name}"})  # the try-it page: files, no data
#: a finished TTS task's audio: a signed `token` (checked by the route) instead of a key
SIGNED_AUDIO_ROUTE = "/v1/tasks/{task_id}/audio"
#: a WebSocket's key may come as this subprotocol + KEY (what browsers send)
SUBPROTOCOL_KEY_PREFIX = "openai-insecure-api-key."
#: Prometheus: `metrics_token` instead of a key when set
METRICS_ROUTE = "/metrics"

_CHALLENGE = {"www-authenticate": "Bearer"}


def caller(request: Request, settings: SettingsDep) -> str:
    """The owner id of the caller's tasks ("" when keys are off); 401 for a bad key."""
    return key_owner(presented_key(request), settings)


async def websocket_caller(websocket: WebSocket, settings: Settings,
                           secrets: ClientSecretStore) -> tuple[str, dict[str, Any] | None]:
    """`caller` for a WebSocket, and the session an ephemeral key was minted with (None for an
    API key): the key as a header, or as the subprotocol browsers must use
    (`openai-insecure-api-key.KEY` in Sec-WebSocket-Protocol: a browser cannot set headers
    on a WebSocket). gateway/realtime/connection.py closes with 1008 on a RequestError."""
    key = presented_key(websocket)
    for protocol in websocket.scope.get("subprotocols") or []:
        if key is None and protocol.startswith(SUBPROTOCOL_KEY_PREFIX):
            key = protocol.removeprefix(SUBPROTOCOL_KEY_PREFIX) or None
    if key is not None and is_client_secret(key):
        try:
            secret = await secrets.lookup(key)
        except StoreError:
            raise RequestError(503, "the key store is unavailable; retry shortly") from None
        if secret is None:
            raise RequestError(401, "the ephemeral key has expired (or was never minted)",
                               code="invalid_api_key")
        if settings.api_keys and settings.api_key(secret.owner) is None:
            # its key was revoked since: the ephemeral keys it minted go with it (they would
            # run on, for up to two hours, with none of its quotas or limits)
            raise RequestError(401, "the API key that minted this ephemeral key is no longer "
                                    "configured", code="invalid_api_key")
        return secret.owner, secret.session
    return key_owner(key, settings), None


def key_owner(key: str | None, settings: Settings) -> str:
    """The owner id of a presented key ("" when keys are off); 401 for a missing or bad one."""
    if not settings.api_keys:
        return ""
    if key is None:
        raise RequestError(401, "missing API key: send 'Authorization: Bearer KEY'",
                           code="invalid_api_key", headers=_CHALLENGE)
    if is_client_secret(key):
        raise RequestError(401, "an ephemeral key (ek_…) opens the realtime WebSocket only: "
                                "send an API key", code="invalid_api_key", headers=_CHALLENGE)
    # One dict lookup of the presented key's digest: what it costs does not depend on which
    # key matched, nor on how many are configured, and a digest's bytes are no secret to
    # time (finding a key from them is inverting SHA-256).
    owner = _owners(settings).get(digest(key))
    if owner is None:
        raise RequestError(401, "invalid API key", code="invalid_api_key", headers=_CHALLENGE)
    return owner


_owner_table: tuple[Settings, dict[str, str]] | None = None


def _owners(settings: Settings) -> dict[str, str]:
    """digest -> owner id of the configured keys, built once per Settings."""
    global _owner_table
    if _owner_table is None or _owner_table[0] is not settings:
        _owner_table = (settings, {entry.digest: entry.owner for entry in settings.api_keys})
    return _owner_table[1]


async def _caller(request: Request, settings: SettingsDep) -> str:
    """`caller` as a dependency (an `async def`: FastAPI runs a plain `def` in a thread)."""
    return caller(request, settings)


#: the caller's owner id, for routes that read or create their tasks
Owner = Annotated[str, Depends(_caller)]


async def require_key(owner: Owner) -> None:
    """A client key (when keys are on): 401 otherwise."""
    del owner


async def require_key_or_metrics_token(request: Request, settings: SettingsDep) -> None:
    if settings.metrics_token:
        if _is_metrics_token(request, settings.metrics_token):
            return
        if not settings.api_keys:
            raise RequestError(401, "send the metrics token: 'Authorization: Bearer TOKEN'",
                               code="invalid_api_key", headers=_CHALLENGE)
    caller(request, settings)


async def require_key_or_signed_url(request: Request, settings: SettingsDep) -> None:
    """A request with a `token` goes on to the route, which checks it (a wrong one is a 404,
    like an unknown task); without one, a key as everywhere."""
    if not request.query_params.get("token"):
        caller(request, settings)


def owner_or_none(request: Request, settings: Settings) -> str | None:
    """The caller's owner id, or None for a missing or wrong key (no 401: for routes that
    answer such a caller in their own way)."""
    try:
        return caller(request, settings)
    except RequestError:
        return None


def is_authenticated(request: Request, settings: Settings) -> bool:
    """Whether the caller may see internals (keys off, or a valid key)."""
    return owner_or_none(request, settings) is not None


def _is_metrics_token(request: Request, token: str) -> bool:
    presented = presented_key(request) or ""
    if token.startswith("sha256:"):
        return hmac.compare_digest(digest(presented), token.removeprefix("sha256:").lower())
    return hmac.compare_digest(presented.encode(), token.encode())


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def body_holder(scope: Scope) -> str | None:
    """Who holds a request's body, for the upload budget's per-key share
    (common/body_limit.py): the key it presents (checked later, by its route)."""
    return presented_key(HTTPConnection(scope))


def presented_key(request: HTTPConnection) -> str | None:
    authorization = request.headers.get("authorization", "")
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("x-api-key") or None


if __name__ == "__main__":
    print("sha256:" + digest(sys.argv[1]))
