"""A closing connection with bytes left to send (gateway/process/bounded_ws.StuckAbort), on
real loopback sockets: a client that reads nothing is reset once the wait passes, one that
reads slowly gets every byte however long it takes. (The wait is shortened to 1 s here.)"""

from __future__ import annotations

import asyncio
import socket
import time

import pytest

from gateway.process import bounded_ws
from tests.helpers import TCP_ESTABLISHED, tcp_state

BODY = 16 * 2**20  # far more than both kernels' socket buffers hold (tcp_wmem: 4 MB)


async def serve_then_close(loop: asyncio.AbstractEventLoop) -> tuple[asyncio.Server, int]:
    """A server that writes BODY bytes to each connection, closes it and starts the abort."""

    class Writer(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            transport.write(b"x" * BODY)
            transport.close()
            self.stuck = bounded_ws.StuckAbort(loop, transport)

        def connection_lost(self, exc: Exception | None) -> None:
            self.stuck.cancel()

    server = await loop.create_server(Writer, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def client(port: int, receive_buffer: int = 4096) -> socket.socket:
    sock = socket.socket()
    # before connect: the kernel does not grow it
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect(("127.0.0.1", port))
    return sock


@pytest.fixture(autouse=True)
def short_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bounded_ws, "ABORT_AFTER_SECONDS", 1.0)


def test_a_client_that_reads_nothing_is_reset() -> None:
    async def scenario() -> int:
        loop = asyncio.get_running_loop()
        server, port = await serve_then_close(loop)
        sock = await loop.run_in_executor(None, client, port)
        await asyncio.sleep(3.0)  # reads nothing
        state = tcp_state(sock)
        sock.close()
        server.close()
        return state

    assert asyncio.run(scenario()) != TCP_ESTABLISHED


def test_a_client_that_reads_slowly_gets_every_byte() -> None:
    def read_slowly(port: int) -> int:
        sock = client(port, 65536)
        got, started = 0, time.monotonic()
        with sock:
            while chunk := sock.recv(65536):
                got += len(chunk)
                time.sleep(0.02)  # at most ~3 MB/s: seconds for the whole body
        assert time.monotonic() - started > 2.0  # longer than the wait, more than once
        return got

    async def scenario() -> int:
        loop = asyncio.get_running_loop()
        server, port = await serve_then_close(loop)
        got = await loop.run_in_executor(None, read_slowly, port)
        server.close()
        return got

    assert asyncio.run(scenario()) == BODY
