"""Real processes for tests and benchmarks: redis-server, gateway, workers, supervisord.

Each binds to 127.0.0.1 on a free port, lives in a temp dir, and is stopped by its own
pid (or process group): never by name. Whatever is still running when the interpreter
exits is stopped too (`stop_leftovers`, registered with atexit; tests/conftest.py also
calls it when the test session ends).
"""

from __future__ import annotations

import asyncio
import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time
import xmlrpc.client
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import redis

from common.backends import BACKENDS, WORKER_PROCESS_ENV
from harness.http_client import http
from harness.ports import free_port

ROOT = Path(__file__).resolve().parents[1]
TEST_AUDIO = ROOT / "tests" / "audio"  # in the repo: see tests/audio/README.md
VENVS = ROOT / ".venvs"
CORE_PYTHON = Path(sys.executable)


def wait_until(predicate: Callable[[], Any], timeout: float, what: str,
               interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


#: every process these helpers started and have not stopped yet (see stop_leftovers)
STARTED: list[subprocess.Popen] = []


def spawn(args: list[str], **kwargs: Any) -> subprocess.Popen:
    """Start a process in its own group, remembered until it is stopped (see stop)."""
    proc = subprocess.Popen(args, start_new_session=True, **kwargs)
    STARTED.append(proc)
    return proc


_spawn = spawn


def stop_leftovers() -> None:
    """Stop what a failed fixture or test left running: only our own processes, by pid."""
    for proc in list(STARTED):
        _stop(proc)


# Also when the test process ends in an error outside any fixture's teardown.
atexit.register(stop_leftovers)


def stop(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    """Stop a process started by spawn, and its group: SIGTERM, then SIGKILL."""
    _stop(proc, timeout)


def _stop(proc: subprocess.Popen, timeout: float = 15.0) -> None:
    if proc in STARTED:
        STARTED.remove(proc)
    if proc.poll() is not None:
        return
    with _suppress():
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        with _suppress():
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(5)


class _suppress:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is ProcessLookupError


class RedisServer:
    def __init__(self, workdir: Path, appendonly: bool = True,
                 replica_of: RedisServer | None = None) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.appendonly = appendonly
        self.replica_of = replica_of  # started as its replica (Sentinel may change roles)
        self.proc: subprocess.Popen | None = None
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        args = ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port),
                "--dir", str(self.workdir), "--save", "",
                "--appendonly", "yes" if self.appendonly else "no",
                "--appendfsync", "everysec", "--logfile", str(self.workdir / "redis.log"),
                # a replica (re)joining is synced at once, not after the default 5 s pause
                "--repl-diskless-sync-delay", "0"]
        if self.replica_of is not None:
            args += ["--replicaof", "127.0.0.1", str(self.replica_of.port)]
            self.replica_of = None  # restarted, it starts as a primary; Sentinel demotes it
        self.proc = _spawn(args)
        wait_until(self._pings, 30, "redis-server")
        return self

    def _pings(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.RedisError:
            return False

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_timeout=5)

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)

    def restart(self, down_seconds: float = 0.0) -> None:
        self.stop()
        time.sleep(down_seconds)
        self.start()

    def kill(self) -> None:
        """kill -9: no shutdown, no last AOF write (a host that died)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(5)
            _stop(self.proc)


class SentinelServer:
    """One Redis Sentinel (`redis-server CONF --sentinel`) watching `primary` as `master`."""

    def __init__(self, workdir: Path, primary: RedisServer, master: str = "speech",
                 quorum: int = 2, down_after_ms: int = 1000) -> None:
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.master = master
        self.conf = workdir / "sentinel.conf"  # Sentinel rewrites it as it learns
        self.conf.write_text("\n".join([
            "bind 127.0.0.1", f"port {self.port}", f"dir {workdir}",
            f"logfile {workdir / 'sentinel.log'}",
            f"sentinel monitor {master} 127.0.0.1 {primary.port} {quorum}",
            f"sentinel down-after-milliseconds {master} {down_after_ms}",
            f"sentinel failover-timeout {master} {max(10 * down_after_ms, 5000)}",
            f"sentinel parallel-syncs {master} 1", ""]))
        self.proc: subprocess.Popen | None = None

    def start(self) -> SentinelServer:
        self.proc = _spawn(["redis-server", str(self.conf), "--sentinel"])
        wait_until(self._pings, 10, "redis sentinel")
        return self

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2,
                           decode_responses=True)

    def _pings(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.RedisError:
            return False

    def primary_port(self) -> int:
        """The port of the primary this sentinel names now."""
        _, port = self.client().sentinel_get_master_addr_by_name(self.master)
        return int(port)

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)


#: how long sentinels may take to find a replica (the primary's INFO, every 10 s) and each
#: other (hello messages, every 2 s): a bound that holds on a loaded 2-core machine
SENTINEL_READY_SECONDS = 120.0


def sentinel_rows(sentinel: redis.Redis, what: str, master: str) -> list[dict[str, str]]:
    """`SENTINEL REPLICAS master` or `SENTINEL SENTINELS master`, one dict per row (a sentinel
    client with decode_responses; a RESP2 row is a flat list of names and values)."""
    return [row if isinstance(row, dict) else dict(zip(row[::2], row[1::2], strict=True))
            for row in sentinel.execute_command("SENTINEL", what, master)]


def sentinels_see(sentinels: dict[int, redis.Redis], master: str, replica_port: int) -> bool:
    """Every sentinel (port -> client) lists the replica and every other sentinel, each
    reachable (flags without s_down or disconnected), in its own answers: ready to fail over."""
    def reachable(rows: list[dict[str, str]]) -> set[int]:
        return {int(row["port"]) for row in rows
                if not {"s_down", "o_down", "disconnected"} & set(row["flags"].split(","))}
    try:
        return all(reachable(sentinel_rows(client, "REPLICAS", master)) == {replica_port}
                   and reachable(sentinel_rows(client, "SENTINELS", master))
                   == set(sentinels) - {port}
                   for port, client in sentinels.items())
    except redis.RedisError:  # one still starting
        return False


class SentinelGroup:
    """A primary, its replica and `sentinels` sentinels on loopback, started and ready: every
    sentinel sees the replica and the other sentinels (so a failover can start at once)."""

    def __init__(self, workdir: Path, sentinels: int = 3, down_after_ms: int = 1000) -> None:
        self.primary = RedisServer(workdir / "primary").start()
        self.replica = RedisServer(workdir / "replica", replica_of=self.primary).start()
        self.sentinels = [SentinelServer(workdir / f"sentinel-{n}", self.primary,
                                         quorum=sentinels // 2 + 1,
                                         down_after_ms=down_after_ms).start()
                          for n in range(sentinels)]
        self.master = self.sentinels[0].master
        clients = {s.port: s.client() for s in self.sentinels}
        wait_until(lambda: sentinels_see(clients, self.master, self.replica.port)
                   and self.replica.client().info("replication")["master_link_status"] == "up",
                   SENTINEL_READY_SECONDS, "sentinels to see the replica and each other", 0.2)

    def settings(self) -> dict[str, Any]:
        """The SPEECH_* settings (for `service_env`) that find Redis through the sentinels."""
        return {"redis_sentinels": [s.address for s in self.sentinels],
                "redis_sentinel_master": self.master}

    def node(self, port: int) -> RedisServer:
        return next(n for n in (self.primary, self.replica) if n.port == port)

    def current_primary(self) -> RedisServer:
        """The node the sentinels name now (they may disagree for a moment: the majority)."""
        ports = [s.primary_port() for s in self.sentinels]
        return self.node(max(set(ports), key=ports.count))

    def stop(self) -> None:
        for server in (*self.sentinels, self.replica, self.primary):
            server.stop()


def service_env(redis_url: str, **settings: Any) -> dict[str, str]:
    """Environment for gateway/worker processes: SPEECH_* from keyword arguments."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPEECH_")}
    env.update(SPEECH_REDIS_URL=redis_url, SPEECH_HEARTBEAT_SECONDS="0.5",
               PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1")
    for key, value in settings.items():
        env[f"SPEECH_{key.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    return env


class Service:
    """A gateway or worker subprocess with its own log file."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path, url: str) -> None:
        self.args, self.env, self.log_path, self.url = args, env, log_path, url
        self.health_url = f"{url}/health"
        self.proc: subprocess.Popen | None = None

    def start(self, wait: bool = True) -> Service:
        log = self.log_path.open("ab")
        self.proc = _spawn(self.args, env=self.env, cwd=ROOT, stdout=log,
                           stderr=subprocess.STDOUT)
        if wait:
            wait_until(self.healthy, 120, f"{self.args[-1]} health ({self.log_path})", 0.1)
        return self

    def healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            raise RuntimeError(f"{self.args} exited with {self.proc.returncode}: "
                               f"{self.log_path.read_text()[-3000:]}")
        try:
            return http.get(self.health_url, timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")


def serve_in_thread(server: Any) -> threading.Thread:
    """A uvicorn server (an in-process test's) serving on a thread of its own, started; stop
    it with `server.stop()` (common/uvicorn_server.QuietServer) and join the thread."""
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    wait_until(lambda: server.started or not thread.is_alive(), 30, "the server", 0.01)
    assert server.started, "the server did not start"
    return thread


def gateway(redis_url: str, workdir: Path, **settings: Any) -> Service:
    """One gateway server process as the launcher runs each (`python -m gateway --single`:
    the same uvicorn server, options and app), without the launcher, so its pid is the
    server's own."""
    port = free_port()
    env = service_env(redis_url, **settings)
    args = [str(CORE_PYTHON), "-m", "gateway", "--single", "--host", "127.0.0.1",
            "--port", str(port), "--log-level", "warning"]
    return Service(args, env, workdir / f"gateway-{port}.log", f"http://127.0.0.1:{port}")


def worker(redis_url: str, workdir: Path, backend: str = "faster-whisper",
           python: Path = CORE_PYTHON, **settings: Any) -> Service:
    port = free_port()
    settings.setdefault("consumer", f"test-{backend}-{port}")
    env = service_env(redis_url, backend=backend, worker_port=str(port), **settings)
    env.update(WORKER_PROCESS_ENV)  # as every deployment runs workers
    env.pop("OMP_WAIT_POLICY", None)  # the worker's own choice (workers/openmp.py), as deployed
    args = [str(python), "-m", "workers"]
    return Service(args, env, workdir / f"worker-{backend}-{port}.log",
                   f"http://127.0.0.1:{port}")


class Supervisor:
    """scripts/run_stack.sh (supervisord with deploy/supervisord.conf) in a test's env."""

    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
        self.workdir = workdir
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.conf = ROOT / "deploy" / "supervisord.conf"

    def start(self) -> Supervisor:
        self.proc = _spawn(  # the same entry the README and the container use
            [str(ROOT / "scripts" / "run_stack.sh")], env=self.env, cwd=ROOT,
            stdout=(self.workdir / "supervisord.out").open("ab"), stderr=subprocess.STDOUT)
        wait_until(lambda: (self.workdir / "supervisor.sock").exists(), 60, "supervisord")
        return self

    def ctl(self, *args: str) -> str:
        out = subprocess.run([str(VENVS / "core" / "bin" / "supervisorctl"), "-c", str(self.conf),
                              *args], env=self.env, cwd=ROOT, capture_output=True, text=True,
                             timeout=30)
        return out.stdout + out.stderr

    def info(self, program: str) -> dict[str, Any]:
        """supervisord's view of `program` ("group:name": pid, statename, …) over its
        socket's XML-RPC: no supervisorctl process (~0.12 s of CPU) per look in a poll."""
        from supervisor.xmlrpc import SupervisorTransport

        transport = SupervisorTransport(None, None, f"unix://{self.workdir / 'supervisor.sock'}")
        proxy = xmlrpc.client.ServerProxy("http://127.0.0.1", transport=transport)
        return proxy.supervisor.getProcessInfo(program)

    def pid(self, program: str) -> int:
        return int(self.info(program)["pid"])

    def state(self, program: str) -> str:
        return str(self.info(program)["statename"])

    def stop(self) -> None:
        if self.proc is not None:
            _stop(self.proc, timeout=60)


def stack_env(**overrides: Any) -> dict[str, str]:
    """deploy/defaults.env, then `overrides`: the environment supervisord runs the stack with."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("SPEECH_") and k.split("_")[0] not in _WORKER_PREFIXES}
    env.pop("OMP_WAIT_POLICY", None)  # the workers' own choice (workers/openmp.py)
    for line in (ROOT / "deploy" / "defaults.env").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            env[key] = value
    env["PYTHONUNBUFFERED"] = "1"
    for key, value in overrides.items():
        env[key] = value if isinstance(value, str) else json.dumps(value)
    return env


_WORKER_PREFIXES = tuple(row.prefix for row in BACKENDS.values())
