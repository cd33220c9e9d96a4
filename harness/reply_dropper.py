"""A TCP proxy in front of a real Redis that loses one connection's replies: a reply lost
after the server acted, on demand (tests of what a caller does when it hears nothing)."""

from __future__ import annotations

import asyncio
import contextlib


class ReplyDropper:
    """A TCP proxy in front of a real Redis that passes every command and every reply, but
    for the connection that sends the next command once `drop_next` is set: its replies are
    lost from then on (its server acted; its client hears nothing, as when a network fault
    or a timeout breaks a connection after the command went through). With
    `refuse_after_drop`, Redis is then away for new connections too until `refusing` is
    cleared (a caller's next try fails as well)."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.drop_next = False
        self.refuse_after_drop = False
        self.refusing = False
        self.server: asyncio.Server | None = None
        self.connections: set[asyncio.Task] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.refusing:
            writer.close()
            return
        self.connections.add(asyncio.current_task())  # type: ignore[arg-type]
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target)
        lost = False

        async def commands() -> None:
            nonlocal lost
            while data := await reader.read(65536):
                if self.drop_next:
                    self.drop_next, lost = False, True
                    self.refusing = self.refuse_after_drop
                upstream_writer.write(data)
                await upstream_writer.drain()
            upstream_writer.close()  # the client left: so does the server's side

        async def replies() -> None:
            while data := await upstream_reader.read(65536):
                if not lost:
                    writer.write(data)
                    await writer.drain()

        try:
            with contextlib.suppress(ConnectionError):
                await asyncio.gather(commands(), replies())
        finally:
            for side in (writer, upstream_writer):
                side.close()

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        if self.connections:  # each ends as its client closes it
            await asyncio.wait(self.connections, timeout=5)
