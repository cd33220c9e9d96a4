"""`audio_url` inputs: fetched only from allowed hosts, bounded, then like an upload."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests import procs
from tests.helpers import queue_counts, wait_done
from tests.procs import TEST_AUDIO, wait_until


@pytest.fixture(scope="module")
def file_server() -> Iterator[str]:
    port = procs.free_port()
    proc = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind",
                             "127.0.0.1", "--directory", str(TEST_AUDIO)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(f"{url}/README.md", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, 10, "file server")
    yield url
    proc.terminate()
    proc.wait(10)


@pytest.fixture(scope="module")
def url_gateway(stack: dict, redis_server: procs.RedisServer, workdir: Path) -> Iterator[str]:
    """A gateway on the session's Redis and worker that fetches from 127.0.0.1 only."""
    service = procs.gateway(redis_server.url, workdir, audio_url_hosts=["127.0.0.1"],
                            max_upload_mib="1").start()
    yield service.url
    service.stop()


def submit(gateway: str, audio_url: str) -> httpx.Response:
    return httpx.post(f"{gateway}/api/faster-whisper-submit", data={"audio_url": audio_url},
                      timeout=60)


def test_audio_url_is_fetched_and_transcribed(url_gateway: str, file_server: str) -> None:
    reply = submit(url_gateway, f"{file_server}/hotwords.mp3")
    assert reply.status_code == 200, reply.text
    final = wait_done(url_gateway, reply.json()["taskid"])
    assert final["status"] == "SUCCEEDED"
    assert final["usage"]["audio_seconds"] == pytest.approx(4.0, abs=0.1)


def test_bad_audio_urls_are_refused_and_enqueue_nothing(url_gateway: str, file_server: str,
                                                       stack: dict) -> None:
    before = queue_counts(stack["redis"])
    port = file_server.rsplit(":", 1)[1]
    cases = {
        f"{file_server}/jfk.flac": (413, "larger than"),  # 1.15 MB over the 1 MiB limit
        f"{file_server}/missing.wav": (400, "HTTP 404"),
        f"http://localhost:{port}/hotwords.mp3": (400, "not allowed"),
        f"ftp://127.0.0.1:{port}/hotwords.mp3": (400, "http(s)"),
        f"{file_server}/README.md": (400, "not a readable audio file"),
        f"http://127.0.0.1:{procs.free_port()}/x.wav": (400, "could not fetch"),
    }
    for url, (code, message) in cases.items():
        reply = submit(url_gateway, url)
        assert reply.status_code == code, (url, reply.text)
        assert message in reply.json()["error"], (url, reply.json())
    assert queue_counts(stack["redis"]) == before
