"""The one host allow-list: which `host[:port]`s the gateway may reach (`audio_url` fetches,
webhook `callback_url`s).

An allow-list entry without a port allows only the scheme's default port (80, 443), so
allowing a web host does not open its other services (Redis, admin ports).
"""

from __future__ import annotations

from urllib.parse import SplitResult, urlsplit

import httpx

from gateway.errors import RequestError

DEFAULT_PORTS = {"http": 80, "https": 443}


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
    try:
        parts = urlsplit(url.strip())  # ValueError: a bracketed host that is no IPv6 address, …
        # port 0 is no port (the allow-list would read it as the default one)
        if parts.scheme not in DEFAULT_PORTS or not parts.hostname or parts.port == 0:
            raise ValueError  # (.port raises ValueError itself for one that is not a number)
        httpx.URL(parts.geturl())  # the client that fetches or delivers must read it too
    except (ValueError, httpx.InvalidURL):
        raise RequestError(400, f"{param} must be an http(s) URL", param=param) from None
    if not allowed(parts, hosts):
        where = f"{parts.hostname}:{parts.port or DEFAULT_PORTS[parts.scheme]}"
        raise RequestError(400, f"{param} host {where!r} is not allowed", param=param, code=code)
    return parts
