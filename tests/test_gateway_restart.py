"""`scripts/ctl.sh restart gateway` replaces the gateway's processes without refusing or
failing one request (issue 12): Sage polls every 20 ms and takes a refused poll for a failed
task. The stack runs under supervisord as in production; the polled task id is unknown
(answered 200 with status FAILED from Redis, like any task), so no worker is needed."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from gateway.process import launcher
from harness import procs
from harness.http_client import http
from harness.procs import ROOT, wait_until

POLL_SECONDS = 0.02
POLLING_LIMIT_SECONDS = 55.0
TASK_ID = "0123456789abcdef0123"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    workdir = tmp_path_factory.mktemp("restart")
    port, redis_port = procs.free_port(), procs.free_port()
    env = procs.stack_env(
        SPEECH_RUN_DIR=str(workdir), SPEECH_PORT=str(port), SPEECH_LOCAL_REDIS="true",
        SPEECH_REDIS_PORT=str(redis_port), SPEECH_REDIS_URL=f"redis://127.0.0.1:{redis_port}/0",
        FW_ENABLED="false")
    supervisor = procs.Supervisor(workdir, env).start()
    url = f"http://127.0.0.1:{port}"

    def ready() -> bool:
        try:
            return http.get(f"{url}/ready", timeout=5).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, 60, "the gateway and Redis", 0.2)
        yield {"url": url, "env": env, "supervisor": supervisor,
               "state": workdir / "gateway.state"}
    finally:
        supervisor.stop()


def launcher_state(path: Path) -> dict[str, str]:
    lines = path.read_text().splitlines()
    return dict(line.split("=", 1) for line in lines)


def server_pids(path: Path) -> set[int]:
    return {int(pid) for pid in launcher_state(path)["children"].split()}


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


class Poller(threading.Thread):
    """GET /api/status every 20 ms; one outcome per poll ("ok" or what went wrong)."""

    def __init__(self, url: str, keep_alive: bool, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.url, self.keep_alive, self.stop = url, keep_alive, stop
        self.outcomes: list[str] = []
        self.closes = 0  # responses that said `Connection: close`

    def run(self) -> None:
        deadline = time.monotonic() + POLLING_LIMIT_SECONDS
        shared = httpx.Client(timeout=10) if self.keep_alive else None
        while not self.stop.is_set() and time.monotonic() < deadline:
            # verify=False: plain http, and loading the CA bundle costs 30 ms per client
            client = shared or httpx.Client(timeout=10, verify=False)
            try:
                reply = client.get(f"{self.url}/api/status", params={"taskid": TASK_ID})
                ok = reply.status_code == 200 and reply.json().get("status") == "FAILED"
                self.outcomes.append("ok" if ok else f"{reply.status_code} {reply.text[:300]}")
                self.closes += reply.headers.get("connection", "").lower() == "close"
            except (httpx.HTTPError, ValueError) as exc:
                self.outcomes.append(f"{type(exc).__name__}: {exc}")
            finally:
                if shared is None:
                    client.close()
            time.sleep(POLL_SECONDS)
        if shared is not None:
            shared.close()


def restart_gateway(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(ROOT / "scripts" / "ctl.sh"), "restart", "gateway"], env=env,
                          cwd=ROOT, capture_output=True, text=True, timeout=20)


def test_restart_gateway_refuses_no_poll(stack: dict) -> None:
    url, state = stack["url"], stack["state"]
    first = http.get(f"{url}/api/status", params={"taskid": TASK_ID}, timeout=10)
    assert first.json() == {"task_id": TASK_ID, "taskid": TASK_ID, "status": "FAILED",
                            "error": "unknown or expired task"}
    parent = launcher_state(state)["parent"]
    generations = [server_pids(state)]
    assert all(alive(pid) for pid in generations[0])

    stop = threading.Event()
    pollers = [Poller(url, keep_alive, stop) for keep_alive in (False, True)]
    for poller in pollers:
        poller.start()
    try:
        time.sleep(0.5)
        for _ in range(2):
            result = restart_gateway(stack["env"])
            assert result.returncode == 0, result.stdout + result.stderr
            assert "reloaded" in result.stdout
            assert launcher_state(state)["parent"] == parent  # the socket's holder stayed
            generations.append(server_pids(state))
            assert generations[-1].isdisjoint(generations[-2])
            assert all(alive(pid) for pid in generations[-1])
        # the retired servers drain and exit: whatever answers now runs the new code
        old = generations[0] | generations[1]
        wait_until(lambda: not any(alive(pid) for pid in old), 15, "old servers to exit", 0.1)
        time.sleep(0.5)
    finally:
        stop.set()
        for poller in pollers:
            poller.join(15)

    for poller in pollers:
        kind = "keep-alive" if poller.keep_alive else "fresh client"
        failures = [outcome for outcome in poller.outcomes if outcome != "ok"]
        assert not failures, (kind, len(poller.outcomes), failures[:5])
        assert len(poller.outcomes) >= 50, (kind, len(poller.outcomes))
    # the keep-alive client was told to reconnect by each retiring server
    assert pollers[1].closes >= 2


def test_restart_when_the_gateway_is_stopped_starts_it(stack: dict) -> None:
    supervisor: procs.Supervisor = stack["supervisor"]
    supervisor.ctl("stop", "gateway")
    result = restart_gateway(stack["env"])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ordinary restart" in result.stderr
    assert http.get(f"{stack['url']}/health", timeout=30).status_code == 200


def test_stopping_the_gateway_stops_every_server_process(stack: dict) -> None:
    supervisor: procs.Supervisor = stack["supervisor"]
    state = stack["state"]
    wait_until(lambda: state.exists() and server_pids(state), 30, "gateway state", 0.1)
    pids = server_pids(state) | {int(launcher_state(state)["parent"])}
    supervisor.ctl("stop", "gateway")
    wait_until(lambda: not any(alive(pid) for pid in pids), 20, "gateway processes gone", 0.1)
    assert not state.exists()
    supervisor.ctl("start", "gateway")
    assert http.get(f"{stack['url']}/health", timeout=30).status_code == 200


def wakeups(pid: int) -> int:
    """The process's main thread's voluntary context switches so far (one per sleep)."""
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("voluntary_ctxt_switches:")[1].split()[0])


def test_the_launcher_sleeps_until_a_signal_and_respawns_a_server_that_died(
        stack: dict) -> None:
    """Idle, the launcher wakes about once a second (it looped every 0.1 s); a server process
    killed outright is replaced at once, woken by SIGCHLD, and the gateway serves again."""
    state = stack["state"]
    wait_until(lambda: state.exists() and server_pids(state), 30, "gateway state", 0.1)
    parent = int(launcher_state(state)["parent"])
    before = wakeups(parent)
    time.sleep(3.0)
    woke = wakeups(parent) - before
    assert woke <= 10, f"the idle launcher woke {woke} times in 3 s"

    (victim,) = server_pids(state)
    os.kill(victim, 9)
    wait_until(lambda: server_pids(state) and victim not in server_pids(state), 30,
               "a new server process", 0.1)
    assert http.get(f"{stack['url']}/health", timeout=30).status_code == 200
    assert alive(parent)


async def _ok(scope: dict, receive: object, send: object) -> None:
    if scope["type"] != "http":
        return
    await send({"type": "http.response.start", "status": 200, "headers": []})  # type: ignore[operator]
    await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]


async def _retire_with_connections_just_accepted(clients: int) -> list[bytes]:
    """A retiring server whose last accept took `clients` connections whose transports do
    not exist yet (asyncio makes them a loop turn later): each must still be answered."""
    draining = threading.Event()
    config = uvicorn.Config(launcher.CloseWhenDraining(_ok, draining), log_level="warning",
                            lifespan="off", timeout_keep_alive=1)
    config.load()
    server = launcher._Server(config, None, draining)
    server.lifespan = config.lifespan_class(config)
    listening = launcher.bind("127.0.0.1", 0)
    await server.startup(sockets=[listening])
    address = listening.getsockname()
    connections = [socket.create_connection(address) for _ in range(clients)]
    for connection in connections:
        connection.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
    # resume after the loop turn that accepts them, before the turn that makes their transports
    loop = asyncio.get_running_loop()
    turn = loop.create_future()
    loop.call_soon(turn.set_result, None)
    await turn
    draining.set()
    await server.shutdown(sockets=[listening])

    def read(connection: socket.socket) -> bytes:
        connection.settimeout(2)
        try:
            return connection.recv(4096)
        except OSError as exc:
            return f"{type(exc).__name__}: {exc}".encode()
        finally:
            connection.close()

    return await asyncio.gather(*(asyncio.to_thread(read, c) for c in connections))


def test_a_retiring_server_answers_the_connections_it_just_accepted() -> None:
    replies = asyncio.run(_retire_with_connections_just_accepted(8))
    assert all(reply.startswith(b"HTTP/1.1 200") for reply in replies), replies
    assert all(b"connection: close" in reply.lower() for reply in replies), replies


def test_python_m_gateway_listens_where_the_settings_say(tmp_path: Path) -> None:
    """SPEECH_HOST and SPEECH_PORT are `python -m gateway`'s defaults (it listened on
    127.0.0.1:8000 whatever they said)."""
    redis = procs.RedisServer(tmp_path / "redis").start()
    port = procs.free_port()
    env = procs.service_env(redis.url, host="127.0.0.1", port=str(port))
    server = procs.spawn([str(procs.CORE_PYTHON), "-m", "gateway", "--single"], env=env,
                         cwd=ROOT, stdout=(tmp_path / "gateway.log").open("ab"),
                         stderr=subprocess.STDOUT)
    try:
        reply = wait_until(lambda: _health(f"http://127.0.0.1:{port}"), 60,
                           "the gateway on SPEECH_PORT", 0.2)
        assert reply.status_code == 200
    finally:
        procs.stop(server)
        redis.stop()


def _health(base: str) -> httpx.Response | None:
    try:
        return http.get(f"{base}/health", timeout=5)
    except httpx.HTTPError:
        return None
