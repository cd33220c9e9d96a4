"""uvicorn's h11 protocol with a deadline for the request line and headers, and the send
buffer each connection may fill (SPEECH_SEND_BUFFER_BYTES).

uvicorn has no header-read timeout: a client that opens a connection and sends nothing, or
trickles its headers a byte at a time, holds a socket and its memory for ever. This class
closes the connection when a request's headers are not complete within
`header_timeout_seconds` (from the first byte of a keep-alive connection's next request, or
from the moment the connection opens). When a response went out before its request body
was read (a 401, a 413), uvicorn keeps reading that body to reuse the connection; that gets
`body_timeout_seconds`. The body a route reads is bounded by gateway/process/limits.py.

Use it with `uvicorn --http gateway.process.slow_clients:SlowClientProtocol` (`http=` in
uvicorn.Config).
"""

from __future__ import annotations

import asyncio
import socket
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from common.settings import get_settings


class SlowClientProtocol(H11Protocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = get_settings()
        self.header_timeout = settings.header_timeout_seconds
        self.drain_timeout = settings.body_timeout_seconds
        self.send_buffer = settings.send_buffer_bytes
        self._deadline: asyncio.TimerHandle | None = None
        self._draining_deadline = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.send_buffer and (sock := transport.get_extra_info("socket")) is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer)
        self._arm(self.header_timeout)

    def data_received(self, data: bytes) -> None:
        if self._deadline is None and self.conn.their_state is h11.IDLE:
            self._arm(self.header_timeout)  # the first bytes of a keep-alive's next request
        super().data_received(data)
        if self._draining():
            return  # the drain deadline stands
        if self.conn.their_state is h11.IDLE:
            if self._draining_deadline:  # drained: what follows is the next request's headers
                self._arm(self.header_timeout)
        else:
            self._disarm()  # headers complete: the app and gateway/process/limits.py take over

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._draining():
            self._arm(self.drain_timeout, draining=True)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _draining(self) -> bool:
        """The response is out but the client is still sending a body nobody reads."""
        return self.conn.our_state is h11.DONE and self.conn.their_state is h11.SEND_BODY

    def _arm(self, seconds: float, draining: bool = False) -> None:
        self._disarm()
        self._deadline = self.loop.call_later(seconds, self._expire)
        self._draining_deadline = draining

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._draining_deadline = False

    def _expire(self) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            self.transport.close()
