"""`audio_url` inputs: fetched by the gateway, only from configured hosts (no open proxy
into the operator's network), bounded in size and time, then treated like an upload."""

from __future__ import annotations

from urllib.parse import urlsplit

import httpx

from common.settings import Settings
from gateway.inputs import RequestError

FETCH_TIMEOUT_SECONDS = 30.0


async def fetch_audio_url(url: str, settings: Settings) -> bytes:
    hosts = settings.audio_url_hosts
    if not hosts:
        raise RequestError(400, "audio_url inputs are not enabled on this server",
                           param="audio_url")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise RequestError(400, "audio_url must be an http(s) URL", param="audio_url")
    if "*" not in hosts and parts.hostname not in hosts:
        raise RequestError(400, f"audio_url host {parts.hostname!r} is not allowed",
                           param="audio_url")
    limit = int(settings.max_upload_mib * 1024 * 1024)
    try:
        async with httpx.AsyncClient(timeout=FETCH_TIMEOUT_SECONDS) as client, \
                client.stream("GET", url) as reply:
            if reply.status_code != 200:
                raise RequestError(400, f"audio_url answered HTTP {reply.status_code}",
                                   param="audio_url")
            chunks, size = [], 0
            async for chunk in reply.aiter_bytes():
                size += len(chunk)
                if size > limit:
                    raise RequestError(413, f"audio_url is larger than {limit} bytes",
                                       param="audio_url")
                chunks.append(chunk)
    except httpx.HTTPError as exc:
        raise RequestError(400, f"could not fetch audio_url ({type(exc).__name__})",
                           param="audio_url") from None
    if not size:
        raise RequestError(400, "audio_url returned an empty body", param="audio_url")
    return b"".join(chunks)
