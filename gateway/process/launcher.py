"""The gateway launcher (`python -m gateway`), which restarts the gateway without refusing a
connection.

The launcher binds the listening socket once and never restarts. It runs `--processes`
uvicorn servers on that socket, each a fresh interpreter (`python -m gateway --serve-fd …`),
so every server runs the code on disk when it starts. SIGHUP replaces the servers one at a
time: start a new one, wait until it serves, then retire an old one, which stops accepting,
answers what it still receives with `Connection: close`, and exits once its connections are
done. Connections that arrive meanwhile wait in the socket's backlog, which lives as long as
the launcher holds the socket, so none is refused. SIGTERM/SIGINT stop everything.

The launcher writes its state (its pid, the servers' pids, reloads done) to `--state-file`;
`scripts/ctl.sh restart gateway` sends the SIGHUP and waits there for the reload to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from common.uvicorn_server import QuietServer

if TYPE_CHECKING:
    from common.settings import Settings

log = logging.getLogger("gateway.launcher")

READY_TIMEOUT_SECONDS = 60.0
BACKLOG = 2048
#: the longest the launcher sleeps: a signal (SIGHUP, SIGTERM, a server's exit: SIGCHLD) wakes
#: it at once, so this only bounds how late a lost wake-up is made up for
IDLE_SECONDS = 1.0
#: how long a retiring server lets connections it already accepted get their transports
ACCEPTED_SETTLE_SECONDS = 0.05


def uvicorn_options(settings: Settings) -> dict[str, Any]:
    """Extra uvicorn.Config options of every server process: the HTTP protocol that closes
    connections whose request line and headers do not arrive in time, the WebSocket protocol
    that bounds what a client can make it buffer (gateway/process/bounded_ws.py), and the largest
    WebSocket message a live session can use (gateway/realtime/protocol.py). The loop is
    asyncio's even where uvloop is installed: the protocol's timers and a retiring server's
    drain (`_stop_accepting`) are written against its selector loop."""
    from gateway.realtime.protocol import max_message_bytes  # the launcher stays light

    # a live session's keep-alive is the WebSocket's own ping (the realtime protocol has no
    # comment event, and pings are below it), sent by uvicorn every keep-alive interval
    return {"http": "gateway.process.slow_clients:SlowClientProtocol", "loop": "asyncio",
            "ws": "gateway.process.bounded_ws:BoundedWebSocketProtocol",
            "ws_max_size": max_message_bytes(settings.realtime_max_buffer_seconds),
            "ws_ping_interval": settings.stream_keepalive_seconds}


# --- the launcher (parent) ---------------------------------------------------------------


@dataclass
class Server:
    proc: subprocess.Popen[bytes]
    ready: int  # read end of the pipe the server writes to once it serves


class Launcher:
    def __init__(self, sock: socket.socket, processes: int, state_file: Path | None,
                 log_level: str) -> None:
        self.sock = sock
        self.processes = processes
        self.state_file = state_file
        self.log_level = log_level
        self.servers: list[Server] = []
        self.retiring: list[subprocess.Popen[bytes]] = []
        self.requested = 0  # SIGHUPs received
        self.reloads = 0  # SIGHUPs answered: a reload answers every one received before it began
        self.reloading = 0  # `requested` when the running reload began
        self.result = "ok"
        self.stopping = False
        self.respawn_at = 0.0
        self.backoff = 1.0

    def run(self) -> int:
        woken, wake = os.pipe()
        for end in (woken, wake):
            os.set_blocking(end, False)
        signal.set_wakeup_fd(wake)  # every signal writes a byte here: the sleep below ends
        signal.signal(signal.SIGHUP, self._on_hup)
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGCHLD, _nothing)  # a server's exit wakes the loop (reap)
        self.write_state()
        starting = [self.spawn() for _ in range(self.processes)]
        for server in starting:
            if not self.wait_ready(server):
                self.stop_all([s.proc for s in starting])
                if self.stopping:
                    return 0
                log.error("gateway server process %d did not start", server.proc.pid)
                return 1
        self.servers = starting
        self.write_state()
        log.info("gateway serving on %s, server pids %s", _address(self.sock), self.pids())
        while not self.stopping:
            if self.requested > self.reloads:
                self.reload()
            self.reap()
            self.sleep(woken)
        self.stop_all([s.proc for s in self.servers] + self.retiring)
        return 0

    def sleep(self, woken: int) -> None:
        """Until a signal arrives, a respawn is due, or IDLE_SECONDS pass."""
        seconds = IDLE_SECONDS
        if len(self.servers) < self.processes:
            seconds = min(seconds, max(0.0, self.respawn_at - time.monotonic()))
        if not self.stopping and self.requested <= self.reloads:
            select.select([woken], [], [], seconds)
        with contextlib.suppress(BlockingIOError):
            while os.read(woken, 512):
                pass

    def _on_hup(self, signum: int, frame: FrameType | None) -> None:
        self.requested += 1

    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        self.stopping = True

    def pids(self) -> list[int]:
        return [s.proc.pid for s in self.servers]

    def spawn(self) -> Server:
        read_end, write_end = os.pipe()
        fd = self.sock.fileno()
        args = [sys.executable, "-m", "gateway", "--serve-fd", str(fd),
                "--ready-fd", str(write_end), "--log-level", self.log_level]
        proc = subprocess.Popen(args, pass_fds=(fd, write_end))
        os.close(write_end)
        return Server(proc, read_end)

    def wait_ready(self, server: Server) -> bool:
        """True once the server says it serves; False if it exits, times out or we stop."""
        deadline = time.monotonic() + READY_TIMEOUT_SECONDS
        try:
            while not self.stopping and time.monotonic() < deadline:
                readable, _, _ = select.select([server.ready], [], [], 0.2)
                if readable:  # one byte once it serves, or end of file if it died first
                    return os.read(server.ready, 1) == b"1"
            return False
        finally:
            os.close(server.ready)

    def reload(self) -> None:
        self.reloading = self.requested
        self.write_state()
        log.info("reloading gateway server processes %s", self.pids())
        self.result = "ok"
        for index, old in enumerate(list(self.servers)):
            new = self.spawn()
            if not self.wait_ready(new):
                self.result = ("failed: a new server process did not start, "
                               "the old ones keep serving (see the gateway log)")
                _kill(new.proc)
                break
            self.servers[index] = new
            self.retire(old.proc)
        if self.stopping:
            self.result = "failed: the gateway is stopping"
        self.reloads = self.reloading
        self.write_state()
        report = log.info if self.result == "ok" else log.error
        report("reload %s, server pids %s", self.result, self.pids())

    def retire(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGUSR1: the server drains its connections and exits (see _Server.shutdown)."""
        self.retiring.append(proc)
        _signal(proc, signal.SIGUSR1)

    def reap(self) -> None:
        for proc in list(self.retiring):
            if proc.poll() is not None:
                self.retiring.remove(proc)
        alive = [s for s in self.servers if s.proc.poll() is None]
        for server in self.servers:
            if server not in alive:
                log.error("gateway server process %d exited with %s",
                          server.proc.pid, server.proc.returncode)
        self.servers = alive
        if len(self.servers) < self.processes and time.monotonic() >= self.respawn_at:
            server = self.spawn()
            if self.wait_ready(server):
                self.servers.append(server)
                self.backoff = 1.0
            else:
                _kill(server.proc)
                self.respawn_at = time.monotonic() + self.backoff
                self.backoff = min(self.backoff * 2, 30.0)
            self.write_state()

    def stop_all(self, procs: list[subprocess.Popen[bytes]]) -> None:
        for proc in procs:
            _signal(proc, signal.SIGTERM)
        for proc in procs:
            proc.wait()
        if self.state_file is not None:
            self.state_file.unlink(missing_ok=True)

    def write_state(self) -> None:
        if self.state_file is None:
            return
        lines = [f"parent={os.getpid()}", f"children={' '.join(map(str, self.pids()))}",
                 f"reloads={self.reloads}", f"reloading={self.reloading}",
                 f"result={self.result}"]
        tmp = self.state_file.with_name(self.state_file.name + ".tmp")
        tmp.write_text("\n".join(lines) + "\n")
        os.replace(tmp, self.state_file)


def _nothing(signum: int, frame: FrameType | None) -> None:
    return None


def _signal(proc: subprocess.Popen[bytes], signum: int) -> None:
    if proc.poll() is None:
        proc.send_signal(signum)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    _signal(proc, signal.SIGKILL)
    proc.wait()


def _address(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=BACKLOG)


# --- one server process (child) ----------------------------------------------------------


class _Server(QuietServer):
    def __init__(self, config: uvicorn.Config, ready_fd: int | None,
                 draining: threading.Event) -> None:
        super().__init__(config)
        self.ready_fd = ready_fd
        self.draining = draining

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started and self.ready_fd is not None:
            os.write(self.ready_fd, b"1")
            os.close(self.ready_fd)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.draining.is_set():
            # Stop accepting (the other processes take new connections), then let the
            # connections end on their own: a busy one gets `Connection: close` on its next
            # response, an idle one ends at the keep-alive timeout. Closing an idle keep-alive
            # connection now could race a request its client is just sending on it.
            await _stop_accepting(self.servers)
            deadline = time.monotonic() + self.config.timeout_keep_alive + 1
            while self.server_state.connections and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        await super().shutdown(sockets)


async def _stop_accepting(listeners: list[asyncio.Server]) -> None:
    """Close the listeners without dropping a connection they just accepted.

    asyncio accepts a connection in one loop turn and makes its transport in a later one, and
    that refuses (silently, closing the socket) once the listener is closed: the client, whose
    request is already sent, reads a reset. So stop reading the listening sockets first, let
    those turns run, then close them."""
    loop = asyncio.get_running_loop()
    for listener in listeners:
        for sock in listener.sockets:
            loop.remove_reader(sock.fileno())
    await asyncio.sleep(ACCEPTED_SETTLE_SECONDS)
    for listener in listeners:
        listener.close()


def serve(fd: int, ready_fd: int | None, log_level: str) -> None:
    """One server process on the listening socket `fd`: the launcher's child (which tells it
    on `ready_fd` once it serves, and stops with its launcher), or with `ready_fd` None a
    gateway of one process and no launcher (`python -m gateway --single`)."""
    from common.settings import get_settings
    from gateway.app import create_app

    settings = get_settings()
    draining = threading.Event()
    # in-flight requests may take this long: OpenAI-style calls wait up to the request timeout
    grace = settings.request_timeout_seconds + 30
    config = uvicorn.Config(CloseWhenDraining(create_app(settings), draining),
                            log_level=log_level, timeout_graceful_shutdown=int(grace),
                            **uvicorn_options(settings))
    server = _Server(config, ready_fd, draining)

    def retire(signum: int, frame: FrameType | None) -> None:
        draining.set()
        server.stop()
        # a request stuck in a worker thread would keep asyncio.run from returning
        timer = threading.Timer(grace + 30, os._exit, (1,))
        timer.daemon = True
        timer.start()

    signal.signal(signal.SIGUSR1, retire)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)  # reloads are the launcher's business
    if ready_fd is not None:
        threading.Thread(target=_exit_with_parent, args=(os.getppid(),), daemon=True).start()
    server.run(sockets=[socket.socket(fileno=fd)])


class CloseWhenDraining:
    """ASGI wrapper: once the process is retiring, every response says `Connection: close`,
    so a keep-alive client reconnects (to a serving process) rather than reuse a connection
    this process is about to close."""

    def __init__(self, app: Any, draining: threading.Event) -> None:
        self.app = app
        self.draining = draining

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_closing(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and self.draining.is_set():
                headers = [*message.get("headers", []), (b"connection", b"close")]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_closing)


def _exit_with_parent(parent: int) -> None:
    """A server whose launcher died (SIGKILL) stops, so a new launcher can bind the port."""
    while os.getppid() == parent:
        time.sleep(1)
    os.kill(os.getpid(), signal.SIGTERM)
