"""Sage's status poll read and written without h11: the most frequent request, in its one
plain form.

A poll is a bodiless `GET /api/status?task_id=…` (or `/api/{backend}-status`), most often
of a task still queued or running, whose answer is a few dozen bytes. h11's event machinery
(parse the head into events, validate and normalise the response headers, track both sides'
states) and uvicorn's per-request cycle cost such a poll about as much CPU as the app's own
work (bench/README.md, issue 24). Here a request head that arrives whole, alone, in that
plain form is parsed with one regex a line and handed to the same ASGI app (uvicorn's
proxy-headers wrapper, the launcher's `Connection: close` wrapper, gateway.app.Gateway), and
the app's reply is written as bytes.

Anything else takes h11's path unchanged: a head split across reads, a pipelined second
request, a body, HTTP/1.0, `Connection` (but `keep-alive`), `Expect`, `Upgrade` or
`Transfer-Encoding` headers, percent-escapes in the path, bytes outside printable ASCII. So
this parser only ever accepts a subset of what h11 accepts, and a request it declines loses
nothing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

#: the request line: a status route (gateway/routes/sage.py), no escapes, printable query
_REQUEST_LINE = re.compile(
    rb"GET (/api/(?:[A-Za-z0-9_.~-]+-)?status)(?:\?([\x21-\x7e]*))? HTTP/1\.1")
#: a header line (RFC 9110 token, printable value, optional whitespace around it)
_HEADER = re.compile(
    rb"([!#$%&'*+\-.^_`|~0-9A-Za-z]+):[ \t]*((?:[\x21-\x7e](?:[\x20-\x7e\t]*[\x21-\x7e])?)?)"
    rb"[ \t]*")
#: headers that ask for framing, a protocol switch or connection handling h11 does
_DECLINED = frozenset({b"transfer-encoding", b"expect", b"upgrade", b"te"})
#: headers taken only with the value that changes nothing (`Connection: keep-alive` is what
#: HTTP/1.1 does anyway, and what python-requests sends)
_ONLY = {b"connection": b"keep-alive", b"content-length": b"0"}
#: how every such request begins (a cheap test before the parse, for every other request)
PREFIX = b"GET /api/"
#: a head larger than this goes to h11 (its own limit applies there)
MOST_HEAD_BYTES = 8192


@dataclass(frozen=True, slots=True)
class PollHead:
    raw_path: bytes
    query_string: bytes
    headers: list[tuple[bytes, bytes]]  # names lower-cased, as uvicorn gives them


def parse(data: bytes) -> PollHead | None:
    """`data` as one plain poll request head, or None (h11 takes it)."""
    if len(data) > MOST_HEAD_BYTES or not data.endswith(b"\r\n\r\n"):
        return None
    lines = data[:-4].split(b"\r\n")
    if (line := _REQUEST_LINE.fullmatch(lines[0])) is None:
        return None
    headers: list[tuple[bytes, bytes]] = []
    hosts = 0
    for raw in lines[1:]:  # an empty line here is a second request (pipelined): no match
        if (header := _HEADER.fullmatch(raw)) is None:
            return None
        name = header[1].lower()
        if name in _DECLINED or _ONLY.get(name, header[2].lower()) != header[2].lower():
            return None
        hosts += name == b"host"
        headers.append((name, header[2]))
    if hosts != 1:  # HTTP/1.1 requires exactly one (h11 answers 400 otherwise)
        return None
    return PollHead(line[1], line[2] or b"", headers)


def scope_of(head: PollHead, protocol: Any) -> dict[str, Any]:
    """The ASGI scope uvicorn's h11 protocol builds for the same request."""
    root_path: str = protocol.root_path
    return {"type": "http", "asgi": {"version": protocol.asgi_version, "spec_version": "2.3"},
            "http_version": "1.1", "server": protocol.server, "client": protocol.client,
            "scheme": protocol.scheme, "method": "GET", "root_path": root_path,
            "path": root_path + head.raw_path.decode("ascii"),
            "raw_path": root_path.encode("ascii") + head.raw_path,
            "query_string": head.query_string, "headers": head.headers,
            "state": protocol.app_state.copy()}


async def receive() -> dict[str, Any]:
    """The poll's body: empty (a request with one never takes this path)."""
    return {"type": "http.request", "body": b"", "more_body": False}


@dataclass(slots=True)
class Reply:
    """The app's ASGI messages, collected into one HTTP/1.1 response."""

    status: int = 0
    headers: list[tuple[bytes, bytes]] = field(default_factory=list)
    body: bytearray = field(default_factory=bytearray)
    complete: bool = False

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start" and not self.status:
            self.status = message["status"]
            self.headers = list(message.get("headers", []))
        elif message["type"] == "http.response.body" and self.status and not self.complete:
            self.body += message.get("body", b"")
            self.complete = not message.get("more_body", False)
        else:
            raise RuntimeError(f"unexpected ASGI message {message['type']!r}")

    @property
    def closes(self) -> bool:
        return any(name.lower() == b"connection" and b"close" in value.lower()
                   for name, value in self.headers)

    def encoded(self, default_headers: list[tuple[bytes, bytes]], reason: bytes) -> bytes:
        lines = [b"HTTP/1.1 %d %s" % (self.status, reason)]
        lines += [name + b": " + value for name, value in default_headers]
        lines += [name + b": " + value for name, value in self.headers
                  if name.lower() != b"content-length"]
        lines.append(b"content-length: %d" % len(self.body))
        return b"\r\n".join(lines) + b"\r\n\r\n" + self.body


def access_line(protocol: Any, scope: dict[str, Any], status: int) -> None:
    """uvicorn's access log line for the request, when uvicorn logs them."""
    if protocol.access_log:
        protocol.access_logger.info('%s - "%s %s HTTP/%s" %d', get_client_addr(scope),
                                    scope["method"], get_path_with_query_string(scope),
                                    scope["http_version"], status)
