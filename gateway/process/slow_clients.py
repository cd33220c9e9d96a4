"""uvicorn's h11 protocol with a deadline for the request line and headers, and the send
buffer each connection may fill (SPEECH_SEND_BUFFER_BYTES).

uvicorn has no header-read timeout: a client that opens a connection and sends nothing, or
trickles its headers a byte at a time, holds a socket and its memory for ever. This class
closes the connection when a request's headers are not complete within
`header_timeout_seconds` (from the first byte of a keep-alive connection's next request, or
from the moment the connection opens). When a response went out before its request body
was read (a 401, a 413), uvicorn keeps reading that body to reuse the connection; that gets
`body_timeout_seconds`. The body a route reads is bounded by gateway/process/limits.py.

A connection closed with replies still unsent (a streamed reply whose client stopped reading,
dropped after SPEECH_SEND_TIMEOUT_SECONDS) is aborted once ABORT_AFTER_SECONDS pass in which
the client took none of it (bounded_ws.StuckAbort): asyncio's close waits for the write
buffer to drain, which a client that never reads never lets happen, so its socket, buffers
and file descriptor stayed for ever.

A write that waits on a connection whose buffers are full (every reply's, as uvicorn waits
for the transport to drain before each write) waits while the client takes some of them
every SPEECH_SEND_TIMEOUT_SECONDS; past a timeout in which it took nothing the connection
is aborted and the reply's remaining writes return at once. A
client that pipelined requests and reads none of the replies held the next reply in memory
for as long as it kept the connection open.

Sage's plain status polls skip h11 here (gateway/process/fast_poll.py): same app, same
deadlines, a reply written as bytes.

Use it with `uvicorn --http gateway.process.slow_clients:SlowClientProtocol` (`http=` in
uvicorn.Config).
"""

from __future__ import annotations

import asyncio
import logging
import socket
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import STATUS_PHRASES, H11Protocol

from common.settings import get_settings
from gateway.process import fast_poll
from gateway.process.bounded_ws import StuckAbort, abort

log = logging.getLogger("gateway")


class SlowClientProtocol(H11Protocol):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        settings = get_settings()
        self.header_timeout = settings.header_timeout_seconds
        self.drain_timeout = settings.body_timeout_seconds
        self.send_buffer = settings.send_buffer_bytes
        self.send_timeout = settings.send_timeout_seconds
        self._deadline: asyncio.TimerHandle | None = None
        self._draining_deadline = False
        #: a poll answered without h11 is in flight: what arrives meanwhile waits here
        self._polling = False
        self._held = bytearray()
        self._close_after_poll = False
        self._stuck: StuckAbort | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.send_buffer and (sock := transport.get_extra_info("socket")) is not None:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.send_buffer)
        # uvicorn closes the transport from many places; every close gets the abort timer
        close = transport.close

        def close_then_abort() -> None:
            close()
            if self._stuck is None:
                self._stuck = StuckAbort(self.loop, transport)

        transport.close = close_then_abort  # type: ignore[method-assign]
        drain = self.flow.drain

        async def drain_or_drop() -> None:
            left = transport.get_write_buffer_size()
            while True:
                try:
                    async with asyncio.timeout(self.send_timeout):
                        return await drain()
                except TimeoutError:
                    now = transport.get_write_buffer_size()
                    if 0 < now < left:  # it still reads (a large reply, a slow link): wait on
                        left = now
                        continue
                log.warning("a client took none of a reply for %g s; connection dropped",
                            self.send_timeout)
                abort(transport)
                break
            await drain()  # connection_lost resumes writing: the cycle's writes then return

        self.flow.drain = drain_or_drop  # type: ignore[method-assign]
        self._arm(self.header_timeout)

    def data_received(self, data: bytes) -> None:
        if self._polling:  # a pipelined request: read on once the poll is answered, as h11 does
            self._held += data
            self.flow.pause_reading()
            return
        if (data.startswith(fast_poll.PREFIX)
                and self.conn.their_state is h11.IDLE and self.conn.our_state is h11.IDLE
                and not self.conn.trailing_data[0] and self.limit_concurrency is None
                and (head := fast_poll.parse(data)) is not None):
            self._unset_keepalive_if_required()
            self._disarm()  # the head is complete
            self._start_poll(head)
            return
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
        if self._stuck is not None:
            self._stuck.cancel()
        super().connection_lost(exc)

    def shutdown(self) -> None:
        if self._polling:  # as uvicorn does with a cycle in flight: close once it is answered
            self._close_after_poll = True
            return
        super().shutdown()

    # --- a poll without h11 (gateway/process/fast_poll.py) -------------------------------

    def _start_poll(self, head: fast_poll.PollHead) -> None:
        self._polling = True
        task = self.loop.create_task(self._answer_poll(fast_poll.scope_of(head, self)))
        self.tasks.add(task)  # the server waits for these on shutdown
        task.add_done_callback(self.tasks.discard)

    async def _answer_poll(self, scope: dict[str, Any]) -> None:
        try:
            reply = await self._poll_reply(scope)
            fast_poll.access_line(self, scope, reply.status)
            if self.flow.write_paused and not self.transport.is_closing():
                # as uvicorn's send: a client that reads nothing holds up its next reply
                await self.flow.drain()
            if self.transport.is_closing():
                return
            self.transport.write(reply.encoded(self.server_state.default_headers,
                                               STATUS_PHRASES[reply.status]))
        finally:
            self._polling = False
        if reply.closes or self._close_after_poll:
            self.conn.send(h11.ConnectionClosed())
            self.transport.close()
            return
        self.on_response_complete()
        if self._held:
            held, self._held = bytes(self._held), bytearray()
            self.data_received(held)

    async def _poll_reply(self, scope: dict[str, Any]) -> fast_poll.Reply:
        reply = fast_poll.Reply()
        try:
            await self.app(scope, fast_poll.receive, reply.send)
            if not reply.complete:
                raise RuntimeError("the app returned without completing its response")
        except Exception as exc:  # what uvicorn's cycle answers: a 500 that closes
            self.logger.error("Exception in ASGI application\n", exc_info=exc)
            return fast_poll.Reply(500, [(b"content-type", b"text/plain; charset=utf-8"),
                                         (b"connection", b"close")],
                                   bytearray(b"Internal Server Error"), True)
        return reply

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
