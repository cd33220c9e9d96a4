"""`audio_url` inputs: fetched by the gateway, only from configured `host[:port]`s (no open
proxy into the operator's network; gateway/policy/hosts.py), bounded in size and in time,
then treated like an upload. Redirects are not followed: they could lead anywhere.
"""

from __future__ import annotations

import asyncio
import functools
import ssl

import httpx

from common.body_limit import BodiesOverBudget, HoldMore
from common.settings import Settings
from gateway.errors import RequestError
from gateway.policy.hosts import checked_url


def _refuse(message: str, status_code: int = 400) -> RequestError:
    return RequestError(status_code, message, param="audio_url")


async def fetch_audio_url(url: str, settings: Settings,
                          hold_more: HoldMore | None = None) -> bytes:
    """The body at `url`; with `hold_more`, each chunk is held in the request's upload budget
    as it arrives (a download is in memory as an upload is: one key's concurrent downloads
    must not take the process past its memory, nor past that key's share)."""
    parts = checked_url(url, settings.audio_url_hosts, "audio_url")
    limit = settings.max_upload_bytes
    deadline = settings.audio_url_timeout_seconds
    try:
        # one deadline for the whole download: httpx's timeouts are per read, so a server
        # that drips its body would never trip them
        async with asyncio.timeout(deadline):
            blob = await _download(parts.geturl(), limit, deadline, hold_more)
    except TimeoutError:
        raise _refuse(f"audio_url did not finish downloading within {deadline:g} s") from None
    except (httpx.HTTPError, httpx.InvalidURL) as exc:
        raise _refuse(f"could not fetch audio_url ({type(exc).__name__})") from None
    if not blob:
        raise _refuse("audio_url returned an empty body")
    return blob


@functools.cache
def _tls() -> ssl.SSLContext:
    """One TLS context for every download: httpx builds a new one per client by default, and
    parsing the CA bundle holds the event loop for ~30 ms."""
    return httpx.create_ssl_context()


async def _download(url: str, limit: int, timeout: float,
                    hold_more: HoldMore | None) -> bytes:
    async with httpx.AsyncClient(timeout=timeout, verify=_tls()) as client, \
            client.stream("GET", url) as reply:
        if reply.status_code != 200:
            raise _refuse(f"audio_url answered HTTP {reply.status_code}")
        declared = reply.headers.get("content-length", "")
        if declared.isascii() and declared.isdigit() and int(declared) > limit:
            raise _refuse(f"audio_url is larger than {limit} bytes", 413)
        chunks, size = [], 0
        async for chunk in reply.aiter_bytes():
            size += len(chunk)
            if size > limit:
                raise _refuse(f"audio_url is larger than {limit} bytes", 413)
            if hold_more is not None and (over := hold_more(len(chunk))):
                raise RequestError(503, over, param="audio_url", code="overloaded",
                                   headers={"Retry-After": str(BodiesOverBudget.retry_after)})
            chunks.append(chunk)
    return b"".join(chunks)
