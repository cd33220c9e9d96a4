"""The gateway's and workers' uvicorn server (common/uvicorn_server.py): it ticks about once
a second instead of ten times, serves as uvicorn does, and a stop ends its wait at once."""

from __future__ import annotations

import signal
import time

import httpx
import pytest
import uvicorn

from common import uvicorn_server
from common.uvicorn_server import QuietServer
from harness import procs


async def app(scope: dict, receive: object, send: object) -> None:
    assert scope["type"] == "http"
    await send({"type": "http.response.start", "status": 200,  # type: ignore[operator]
                "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]


class Counted(QuietServer):
    ticks = 0

    async def on_tick(self, counter: int) -> bool:
        self.ticks += 1
        return await super().on_tick(counter)


@pytest.mark.parametrize("how", ["stop", "signal handler"])
def test_the_server_ticks_once_a_second_and_stops_at_once(
        how: str, monkeypatch: pytest.MonkeyPatch) -> None:
    port = procs.free_port()
    server = Counted(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                    lifespan="off"))
    thread = procs.serve_in_thread(server)
    reply = httpx.get(f"http://127.0.0.1:{port}/", timeout=10)
    assert reply.status_code == 200 and reply.text == "ok"
    assert "date" in reply.headers  # on_tick still sets the header uvicorn sends

    before = server.ticks
    time.sleep(2.0)
    assert server.ticks - before <= 4, f"{server.ticks - before} ticks in 2 s (uvicorn: 20)"

    # a wait far longer than any test: only the stop's wake-up can end it in time
    monkeypatch.setattr(uvicorn_server, "WAIT_SECONDS", 600.0)
    time.sleep(1.5)  # the loop is now in a 600 s wait
    asked = time.monotonic()
    if how == "stop":
        server.stop()
    else:
        server.handle_exit(signal.SIGTERM, None)
    thread.join(timeout=60)
    assert not thread.is_alive(), "the server did not stop"
    assert time.monotonic() - asked < 60
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"http://127.0.0.1:{port}/", timeout=5)
