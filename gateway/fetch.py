"""`audio_url` inputs: fetched by the gateway, only from configured `host[:port]`s (no open
proxy into the operator's network), bounded in size and in time, then treated like an upload.

An allow-list entry without a port allows only the scheme's default port (80, 443), so
allowing a web host does not open its other services (Redis, admin ports). Redirects are
not followed: they could lead anywhere. `checked_url` is the one allow-list check, also for
webhook `callback_url`s (gateway/webhooks.py).
"""

from __future__ import annotations

import asyncio
from urllib.parse import SplitResult, urlsplit

import httpx

from common.settings import Settings
from gateway.errors import RequestError

DEFAULT_PORTS = {"http": 80, "https": 443}


def _refuse(message: str, status_code: int = 400) -> RequestError:
    return RequestError(status_code, message, param="audio_url")


def allowed(parts: SplitResult, hosts: list[str]) -> bool:
    """Whether the URL's host and port match an entry of `hosts` ("*" = anything)."""
    if "*" in hosts:
        return True
    host = (parts.hostname or "").lower()
    port = parts.port or DEFAULT_PORTS[parts.scheme]
    for entry in hosts:
        allowed_parts = urlsplit(f"//{entry.strip().lower()}")
        try:
            allowed_port = allowed_parts.port or DEFAULT_PORTS[parts.scheme]
        except ValueError:  # a malformed entry allows nothing
            continue
        if allowed_parts.hostname == host and allowed_port == port:
            return True
    return False


def checked_url(url: str, hosts: list[str], param: str, code: str | None = None) -> SplitResult:
    """`url` parsed, if it is http(s) to a host:port of `hosts`; a 400 naming `param` (with
    `code` when the host is the problem) otherwise."""
    if not hosts:
        raise RequestError(400, f"{param} is not enabled on this server", param=param, code=code)
    parts = urlsplit(url.strip())
    try:
        # port 0 is no port (the allow-list would read it as the default one)
        if parts.scheme not in DEFAULT_PORTS or not parts.hostname or parts.port == 0:
            raise ValueError  # (.port raises ValueError itself for one that is not a number)
    except ValueError:
        raise RequestError(400, f"{param} must be an http(s) URL", param=param) from None
    if not allowed(parts, hosts):
        where = f"{parts.hostname}:{parts.port or DEFAULT_PORTS[parts.scheme]}"
        raise RequestError(400, f"{param} host {where!r} is not allowed", param=param, code=code)
    return parts


async def fetch_audio_url(url: str, settings: Settings) -> bytes:
    parts = checked_url(url, settings.audio_url_hosts, "audio_url")
    limit = int(settings.max_upload_mib * 1024 * 1024)
    deadline = settings.audio_url_timeout_seconds
    try:
        # one deadline for the whole download: httpx's timeouts are per read, so a server
        # that drips its body would never trip them
        async with asyncio.timeout(deadline):
            blob = await _download(parts.geturl(), limit, deadline)
    except TimeoutError:
        raise _refuse(f"audio_url did not finish downloading within {deadline:g} s") from None
    except httpx.HTTPError as exc:
        raise _refuse(f"could not fetch audio_url ({type(exc).__name__})") from None
    if not blob:
        raise _refuse("audio_url returned an empty body")
    return blob


async def _download(url: str, limit: int, timeout: float) -> bytes:
    async with httpx.AsyncClient(timeout=timeout) as client, \
            client.stream("GET", url) as reply:
        if reply.status_code != 200:
            raise _refuse(f"audio_url answered HTTP {reply.status_code}")
        declared = reply.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise _refuse(f"audio_url is larger than {limit} bytes", 413)
        chunks, size = [], 0
        async for chunk in reply.aiter_bytes():
            size += len(chunk)
            if size > limit:
                raise _refuse(f"audio_url is larger than {limit} bytes", 413)
            chunks.append(chunk)
    return b"".join(chunks)
