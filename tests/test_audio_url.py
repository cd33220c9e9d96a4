"""`audio_url` inputs: fetched only from allowed hosts, bounded, then like an upload."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from harness import procs
from harness.http_client import http
from harness.procs import TEST_AUDIO, wait_until
from tests.helpers import queue_counts, wait_done


@pytest.fixture(scope="module")
def file_server() -> Iterator[str]:
    port = procs.free_port()
    proc = procs.spawn([sys.executable, "-m", "http.server", str(port), "--bind",
                        "127.0.0.1", "--directory", str(TEST_AUDIO)],
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return http.get(f"{url}/README.md", timeout=1).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, 10, "file server")
    yield url
    procs.stop(proc)


@pytest.fixture(scope="module")
def drip_server() -> Iterator[str]:
    """An HTTP server that promises 100 kB and sends one byte per second."""
    class Drip(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "audio/wav")
            self.send_header("Content-Length", "100000")
            self.end_headers()
            try:
                for _ in range(60):  # stops by itself
                    self.wfile.write(b"R")
                    self.wfile.flush()
                    time.sleep(1.0)
            except OSError:
                pass  # the gateway hung up: what we want

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Drip)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


@pytest.fixture(scope="module")
def url_gateway(stack: dict, redis_server: procs.RedisServer, workdir: Path, file_server: str,
                drip_server: str) -> Iterator[str]:
    """A gateway on the session's Redis and worker that fetches from the test servers only
    (host:port entries; a bare host would allow only port 80/443)."""
    hosts = [file_server.removeprefix("http://"), drip_server.removeprefix("http://")]
    service = procs.gateway(redis_server.url, workdir, audio_url_hosts=hosts,
                            max_upload_mib="1", audio_url_timeout_seconds="3").start()
    yield service.url
    service.stop()


def submit(gateway: str, audio_url: str) -> httpx.Response:
    return http.post(f"{gateway}/api/faster-whisper-submit", data={"audio_url": audio_url},
                      timeout=60)


def test_audio_url_is_fetched_and_transcribed(url_gateway: str, file_server: str) -> None:
    reply = submit(url_gateway, f"{file_server}/hotwords.mp3")
    assert reply.status_code == 200, reply.text
    final = wait_done(url_gateway, reply.json()["taskid"])
    assert final["status"] == "SUCCEEDED"
    assert final["usage"]["audio_seconds"] == pytest.approx(4.0, abs=0.1)


def test_bad_audio_urls_are_refused_and_enqueue_nothing(url_gateway: str, file_server: str,
                                                       stack: dict,
                                                       redis_server: procs.RedisServer) -> None:
    before = queue_counts(stack["redis"])
    port = file_server.rsplit(":", 1)[1]
    cases = {
        f"{file_server}/jfk.flac": (413, "larger than"),  # 1.15 MB over the 1 MiB limit
        f"{file_server}/missing.wav": (400, "HTTP 404"),
        f"http://localhost:{port}/hotwords.mp3": (400, "not allowed"),
        f"ftp://127.0.0.1:{port}/hotwords.mp3": (400, "http(s)"),
        f"{file_server}/README.md": (400, "not a readable audio file"),
        f"http://127.0.0.1:{procs.free_port()}/x.wav": (400, "not allowed"),  # another port
        f"http://127.0.0.1:{redis_server.port}/": (400, "not allowed"),  # Redis, same host
        f"http://127.0.0.1/{port}/hotwords.mp3": (400, "not allowed"),  # port 80: not listed
        f"http://127.0.0.1:{port}x/hotwords.mp3": (400, "http(s) URL"),
        "http://[abc/x.wav": (400, "http(s) URL"),  # no IPv6 address in the brackets
        "http://\uff20a/x.wav": (400, "http(s) URL"),  # a host NFKC makes '@a'
        f"{file_server}/\x01.wav": (400, "http(s) URL"),  # what httpx would not send
        f"{file_server}/" + "a" * 70_000: (400, "http(s) URL"),  # longer than httpx takes
    }
    for url, (code, message) in cases.items():
        reply = submit(url_gateway, url)
        assert reply.status_code == code, (url, reply.text)
        assert message in reply.json()["error"], (url, reply.json())
    assert queue_counts(stack["redis"]) == before


def test_an_allowed_host_that_drips_is_cut_off_at_the_deadline(url_gateway: str,
                                                              drip_server: str,
                                                              stack: dict) -> None:
    before = queue_counts(stack["redis"])
    started = time.monotonic()
    reply = submit(url_gateway, f"{drip_server}/slow.wav")
    elapsed = time.monotonic() - started
    assert reply.status_code == 400, reply.text
    assert "within 3 s" in reply.json()["error"]
    assert 2.5 < elapsed < 8, elapsed  # the 3 s deadline, not the 60 s the server would take
    assert queue_counts(stack["redis"]) == before
