"""A worker's direct HTTP server binds the host it is given, IPv6 as well as IPv4 (a pod IP on
an IPv6 cluster: deploy/k8s/ sets SPEECH_WORKER_HOST to status.podIP), and publishes a URL a
client can use (an IPv6 host in brackets)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from common.settings import Settings
from harness import procs
from workers.http import is_loopback, serve_http


def ipv6_loopback() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


async def serve_and_ask(host: str) -> tuple[str, dict]:
    """Serve on `host` (a free port), then ask the URL it publishes for /health."""
    settings = Settings(worker_host=host, worker_port=0, worker_secret="")
    fake = SimpleNamespace(settings=settings, backend="faster-whisper",
                           health=lambda: {"status": "ok"})
    bound: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def on_bound(url: str, fd: int) -> None:
        socket.socket(fileno=fd).close()  # the duplicate the runtime would keep
        bound.set_result(url)

    serving = asyncio.ensure_future(serve_http(fake, on_bound=on_bound))  # type: ignore[arg-type]
    try:
        url = await asyncio.wait_for(asyncio.shield(bound), 10)
        async with httpx.AsyncClient(timeout=5) as client:
            for _ in range(100):  # uvicorn serves the socket a moment after the bind
                try:
                    answer = await client.get(f"{url}/health")
                    break
                except httpx.TransportError:
                    await asyncio.sleep(0.05)
            else:
                raise AssertionError(f"nothing answers at {url}")
        return url, answer.json()
    finally:
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await serving


def test_ipv4_loopback_url_is_unchanged() -> None:
    url, health = asyncio.run(serve_and_ask("127.0.0.1"))
    assert url.startswith("http://127.0.0.1:") and health == {"status": "ok"}


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_ipv6_host_binds_and_its_url_is_bracketed() -> None:
    assert is_loopback("::1")  # open /health without a secret, as 127.0.0.1
    url, health = asyncio.run(serve_and_ask("::1"))
    assert url.startswith("http://[::1]:") and health == {"status": "ok"}


def test_ipv6_non_loopback_still_needs_the_secret() -> None:
    assert not is_loopback("::") and not is_loopback("fd00::5")
    fake = SimpleNamespace(settings=Settings(worker_host="fd00::5", worker_secret=""),
                           backend="faster-whisper")
    with pytest.raises(RuntimeError, match="SPEECH_WORKER_SECRET"):
        asyncio.run(serve_http(fake))  # type: ignore[arg-type]


def test_a_worker_told_cuda_without_cuda_does_not_start(tmp_path: Path,
                                                        module_redis: procs.RedisServer) -> None:
    """SPEECH_DEVICE=cuda (every GPU pod of deploy/k8s) where the engine sees no CUDA device
    (a wrong driver, device plugin or a CPU torch build): the worker exits at once, saying
    so, instead of holding the GPU and running every model on the CPU. `auto` falls back."""
    worker = procs.worker(module_redis.url, tmp_path, device="cuda")
    worker.start(wait=False)
    try:
        assert worker.proc is not None
        assert worker.proc.wait(60) != 0
    finally:
        worker.stop()
    assert "SPEECH_DEVICE=cuda, but this worker's engine sees no CUDA device" in worker.log()
