"""uvicorn's WebSocket protocol (websockets' sans-I/O, what `ws="auto"` picks) with two
bounds a hostile or stalled client could otherwise lift.

- **Back-pressure on what the protocol answers by itself.** uvicorn pauses reading only
  while a message waits for the app; a ping is answered with a pong written straight to the
  transport, so a client that sends pings and reads nothing made the gateway buffer every
  pong (419 MB of pings: +390 MB of RSS, also on a connection whose key was refused and is
  only waiting out its close). Reading now pauses while the transport's write buffer is
  over its high-water mark and resumes when it drains.
- **A connection the app is done with goes.** asyncio's `transport.close()` completes only
  once the write buffer has drained, so a client that never reads kept its socket, its
  buffers and a file descriptor for ever after the session had dropped it (and freed its
  slot: nothing bounded how many piled up). A connection still open after the app returned
  is aborted once ABORT_AFTER_SECONDS pass in which the client took none of what is left
  (`StuckAbort`: a slow client that reads keeps it).

And a text message that is not UTF-8 is closed 1007 as before, logged in one line: uvicorn
logged each with an ERROR traceback, so any client could fill the log.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any

from uvicorn.protocols.websockets.websockets_sansio_impl import WebSocketsSansIOProtocol

#: how long a closing connection may go without the client taking any of what is left to
#: send; uvicorn's own close handshake waits as long for the client's close frame
ABORT_AFTER_SECONDS = 10.0


def abort(transport: asyncio.BaseTransport) -> None:
    """Drop the connection now, with a reset: a plain close (asyncio's abort too) leaves
    the kernel sending what it still buffers to a client that reads nothing, its socket
    held for minutes; a zero linger discards it."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # already gone
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()


class StuckAbort:
    """Aborts a closing `transport` once ABORT_AFTER_SECONDS pass in which its unsent bytes
    did not shrink (a slow client that still reads keeps its connection: a large download
    over a slow link ends whole)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, transport: asyncio.Transport) -> None:
        self.loop, self.transport = loop, transport
        self._left = transport.get_write_buffer_size()
        self._timer = loop.call_later(ABORT_AFTER_SECONDS, self._check)

    def _check(self) -> None:
        left = self.transport.get_write_buffer_size()
        if 0 < left < self._left:
            self._left = left
            self._timer = self.loop.call_later(ABORT_AFTER_SECONDS, self._check)
            return
        abort(self.transport)

    def cancel(self) -> None:
        self._timer.cancel()


class BoundedWebSocketProtocol(WebSocketsSansIOProtocol):
    _stuck: StuckAbort | None = None

    def pause_writing(self) -> None:
        super().pause_writing()
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        super().resume_writing()
        if not self.read_paused and not self.transport.is_closing():
            self.transport.resume_reading()

    async def receive(self) -> Any:
        message = await self.queue.get()
        if self.read_paused and self.queue.empty():
            self.read_paused = False
            # the base class resumes here; while writes are held up reading stays paused
            if self.writable.is_set() and not self.transport.is_closing():
                self.transport.resume_reading()
        return message

    def send_receive_event_to_app(self) -> None:
        if self.curr_msg_data_type == "text" and not self.close_sent:
            data = self.frames[0] if len(self.frames) == 1 else b"".join(self.frames)
            try:
                data.decode()
            except UnicodeDecodeError:
                self.frames = []
                self.logger.info("a WebSocket text message that is not UTF-8: closed 1007")
                self.conn.send_close(1007)
                self.handle_parser_exception()
                return
        super().send_receive_event_to_app()

    async def run_asgi(self) -> None:
        await super().run_asgi()
        if not self.disconnected:
            self._stuck = StuckAbort(self.loop, self.transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._stuck is not None:
            self._stuck.cancel()
        super().connection_lost(exc)
