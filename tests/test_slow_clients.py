"""Clients that trickle their request: 300 connections sending headers, bodies (or nothing)
a byte at a time are all closed by the gateway within its timeouts, the gateway still
serves, and its open file descriptors return to their baseline."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest

from gateway.auth import digest
from harness import procs
from harness.http_client import http
from harness.procs import wait_until

HEADER_TIMEOUT = 2.0
BODY_IDLE = 2.0
BODY_DEADLINE = 4.0
SLACK = 4.0  # a loaded 2-core box
CLIENT_GIVES_UP = 20.0  # every client stops by itself
TRICKLE_SECONDS = 0.5
BODY_START = ("Content-Type: multipart/form-data; boundary=b0undary\r\n"
              "Content-Length: 100000\r\n\r\n--b0undary\r\n"
              'Content-Disposition: form-data; name="file"; filename="x.wav"\r\n\r\n')


@pytest.fixture(scope="module")
def slow(tmp_path_factory: pytest.TempPathFactory, speech_clip: Path) -> Iterator[dict]:
    workdir = tmp_path_factory.mktemp("slow-clients")
    server = procs.RedisServer(workdir / "redis", appendonly=False).start()
    gateway = procs.gateway(server.url, workdir, header_timeout_seconds=str(HEADER_TIMEOUT),
                            body_timeout_seconds=str(BODY_IDLE),
                            body_deadline_seconds=str(BODY_DEADLINE)).start()
    yield {"url": gateway.url, "port": int(gateway.url.rsplit(":", 1)[1]),
           "pid": gateway.pid, "clip": speech_clip.read_bytes()}
    gateway.stop()
    server.stop()


def _headers(path: str, extra: str = "") -> bytes:
    return f"POST {path} HTTP/1.1\r\nHost: x\r\n{extra}".encode()


#: (kind, what is sent at once, how long the server may take to close the connection)
KINDS = [
    # the request line and headers never complete: a byte of a header every 0.5 s
    ("headers", _headers("/api/faster-whisper-submit", "X-Slow: "), HEADER_TIMEOUT),
    # nothing at all after connecting
    ("silent", b"", HEADER_TIMEOUT),
    # complete headers, then a file part a byte at a time, to routes that read it
    ("body", _headers("/api/faster-whisper-submit", BODY_START), BODY_DEADLINE),
    ("body", _headers("/v1/audio/transcriptions", BODY_START), BODY_DEADLINE),
    # a body nobody reads (the reply went out first): uvicorn drains it, for BODY_IDLE
    ("drain", b"GET /health HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n", BODY_IDLE),
]
MIX = [0] * 120 + [1] * 30 + [2] * 50 + [3] * 50 + [4] * 50  # 300 connections


async def trickle(port: int, initial: bytes) -> tuple[float | None, bytes]:
    """(seconds until the server closed the connection, None if it never did; its reply)."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    reply = b""
    try:
        if initial:
            writer.write(initial)
            await writer.drain()
        while loop.time() - started < CLIENT_GIVES_UP:
            try:
                data = await asyncio.wait_for(reader.read(65536), TRICKLE_SECONDS)
            except TimeoutError:
                if initial:
                    writer.write(b"a")
                    await writer.drain()
                continue
            if not data:
                return loop.time() - started, reply
            reply += data
    except (ConnectionError, OSError):
        return loop.time() - started, reply
    finally:
        writer.close()
    return None, reply


def test_trickling_clients_are_cut_off_and_leave_nothing_behind(slow: dict) -> None:
    process = psutil.Process(slow["pid"])
    assert http.get(f"{slow['url']}/health").status_code == 200
    baseline = process.num_fds()

    async def run() -> list[tuple[float | None, bytes]]:
        return await asyncio.gather(*(trickle(slow["port"], KINDS[i][1]) for i in MIX))

    started = time.monotonic()
    results = asyncio.run(run())
    elapsed = time.monotonic() - started
    late = []
    for index, (closed_after, reply) in zip(MIX, results, strict=True):
        kind, _, limit = KINDS[index]
        if closed_after is None or closed_after > limit + SLACK:
            late.append((kind, closed_after))
        if kind == "body":  # a clear answer in the caller's dialect before the close
            assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
            assert b"did not arrive in time" in reply
        if kind == "drain":
            assert reply.startswith(b"HTTP/1.1 200 "), reply[:200]
    assert not late, late[:10]
    assert elapsed < BODY_DEADLINE + SLACK + 5
    # still serving: a normal upload goes through
    reply = http.post(f"{slow['url']}/api/faster-whisper-submit",
                       files={"file": ("clip.wav", slow["clip"], "audio/wav")}, timeout=30)
    assert reply.status_code == 200, reply.text
    # and every socket of those 300 connections is gone
    wait_until(lambda: process.num_fds() <= baseline + 5, 10,
               f"gateway fds back to ~{baseline} (now {process.num_fds()})")


def test_a_slow_but_steady_upload_still_works(slow: dict) -> None:
    """Pauses shorter than the idle limit and a total under the deadline are fine."""
    boundary = "b0undary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"clip.wav\"\r\nContent-Type: audio/wav\r\n\r\n").encode()
    body += slow["clip"] + f"\r\n--{boundary}--\r\n".encode()

    def chunks() -> Iterator[bytes]:
        step = len(body) // 3 + 1
        for start in range(0, len(body), step):
            yield body[start:start + step]
            time.sleep(BODY_IDLE / 2)

    reply = http.post(f"{slow['url']}/api/faster-whisper-submit", content=chunks(),
                       headers={"content-type": f"multipart/form-data; boundary={boundary}"},
                       timeout=30)
    assert reply.status_code == 200, reply.text


def test_uploads_past_the_process_budget_wait_their_turn(tmp_path: Path) -> None:
    """SPEECH_UPLOAD_BUDGET_MIB (1 here): while one client's 0.9 MiB upload streams in, a
    second upload that would take the process past the budget is a 503 `overloaded` with
    Retry-After, refused before its body is read (uploads are held whole: a few large ones
    at once took the process past its memory limit); once the first is gone it passes, and
    a request alone passes whatever its size."""
    server = procs.RedisServer(tmp_path / "redis", appendonly=False).start()
    gateway = procs.gateway(server.url, tmp_path, upload_budget_mib="1",
                            body_timeout_seconds="20").start()
    url = f"{gateway.url}/api/faster-whisper-submit"
    port = int(gateway.url.rsplit(":", 1)[1])

    def upload(size: int) -> int:
        return http.post(url, files={"file": ("x.wav", b"\x01" * size)}, timeout=30).status_code

    def holding(declared: int) -> socket.socket:
        """A client whose upload declares `declared` bytes and has sent a few of them."""
        holder = socket.create_connection(("127.0.0.1", port), timeout=10)
        holder.sendall(_headers("/api/faster-whisper-submit", BODY_START.replace(
            "Content-Length: 100000", f"Content-Length: {declared}")) + b"\x01" * 1000)
        time.sleep(1.0)  # (the gateway reads what was sent)
        return holder

    try:
        # its declared length is held from the start, not what has arrived so far
        holder = holding(950_000)
        refused = http.post(url, files={"file": ("x.wav", b"\x01" * 600_000)}, timeout=30)
        holder.close()
        assert refused.status_code == 503, refused.text
        assert refused.json()["status"] == "FAILED" and int(refused.headers["retry-after"]) > 0
        wait_until(lambda: upload(600_000) != 503, 20, "the budget freed", 0.5)
        assert upload(3 * 2**20) == 400  # alone, past the budget: read (and refused as audio)
        # one alone past the budget: a request with no body (a poll) is never refused
        holder = holding(3 * 2**20)
        try:
            assert http.get(f"{gateway.url}/api/status", params={"taskid": "x"},
                            timeout=30).status_code == 200
            assert upload(1000) == 503
        finally:
            holder.close()
    finally:
        gateway.stop()
        server.stop()


def test_one_key_holds_at_most_half_the_upload_budget(tmp_path: Path) -> None:
    """With keys on, one key's uploads in progress hold at most half of
    SPEECH_UPLOAD_BUDGET_MIB: a key that trickles a large upload or two is refused its next
    (503 with Retry-After), while another key's upload still passes (every other caller's
    upload was refused for as long as the trickle lasted)."""
    keys = {"a": "sk-key-of-the-trickler", "b": "sk-key-of-someone-else"}
    server = procs.RedisServer(tmp_path / "redis", appendonly=False).start()
    gateway = procs.gateway(server.url, tmp_path, upload_budget_mib="1",
                            body_timeout_seconds="20",
                            api_keys=[f"sha256:{digest(key)}" for key in keys.values()]).start()
    url = f"{gateway.url}/api/faster-whisper-submit"
    port = int(gateway.url.rsplit(":", 1)[1])

    def upload(key: str, size: int) -> httpx.Response:
        return http.post(url, files={"file": ("x.wav", b"\x01" * size)}, timeout=30,
                         headers={"Authorization": f"Bearer {keys[key]}"})

    holder = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        holder.sendall(_headers("/api/faster-whisper-submit",
                                f"Authorization: Bearer {keys['a']}\r\n" + BODY_START.replace(
                                    "Content-Length: 100000", "Content-Length: 600000"))
                       + b"\x01" * 1000)
        time.sleep(1.0)  # (the gateway reads what was sent)
        refused = upload("a", 300_000)
        assert refused.status_code == 503 and int(refused.headers["retry-after"]) > 0
        assert "share" in refused.json()["error"], refused.text
        passed = upload("b", 300_000)  # read: refused as audio, not for the budget
        assert passed.status_code == 400, passed.text
    finally:
        holder.close()
        gateway.stop()
        server.stop()


def test_audio_url_downloads_count_in_the_upload_budget_and_wait_for_the_in_flight_cap(
        tmp_path: Path) -> None:
    """A download is in memory as an upload is: it counts in the process's budget and in
    its key's share (a key's concurrent `audio_url` submits took the gateway's memory
    outside any budget), and a key at its most tasks in flight is refused before the
    download (it was refused after it: a loop cost a download a call, for nothing)."""
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    import numpy as np

    from common.audio import encode_wav

    wav = encode_wav(0.1 * np.sin(np.arange(16000 * 9) / 5.0), 16000)  # ~288 KB
    served: list[str] = []

    class Files(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            served.append(self.path)
            self.send_response(200)
            self.send_header("Content-Type", "audio/wav")
            self.send_header("Content-Length", str(len(wav)))
            self.end_headers()
            self.wfile.write(wav)

        def log_message(self, *args: object) -> None:
            pass

    files = ThreadingHTTPServer(("127.0.0.1", 0), Files)
    files.daemon_threads = True
    threading.Thread(target=files.serve_forever, daemon=True).start()
    host = f"127.0.0.1:{files.server_address[1]}"
    keys = {"a": "sk-key-of-the-downloader", "b": "sk-key-of-someone-else",
            "c": "sk-key-with-one-task"}
    entries = [{"key": f"sha256:{digest(keys['a'])}", "name": "a"},
               {"key": f"sha256:{digest(keys['b'])}", "name": "b"},
               {"key": f"sha256:{digest(keys['c'])}", "name": "c", "max_in_flight": 1}]
    server = procs.RedisServer(tmp_path / "redis", appendonly=False).start()
    gateway = procs.gateway(server.url, tmp_path, upload_budget_mib="1",
                            body_timeout_seconds="20", audio_url_hosts=[host],
                            api_keys=entries).start()  # no worker: tasks stay queued
    url = f"{gateway.url}/api/faster-whisper-submit"
    port = int(gateway.url.rsplit(":", 1)[1])

    def fetch(key: str) -> httpx.Response:
        return http.post(url, data={"audio_url": f"http://{host}/clip.wav"}, timeout=30,
                         headers={"Authorization": f"Bearer {keys[key]}"})

    holder = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        assert fetch("c").status_code == 200
        assert len(served) == 1
        refused = fetch("c")
        assert refused.status_code == 429 and "tasks queued or running" in refused.text
        assert len(served) == 1  # not downloaded for a submit that cannot queue
        # a retry with an idempotency key is answered with its task, not refused first
        once = {"Idempotency-Key": "retry-me"}
        c_headers = {"Authorization": f"Bearer {keys['c']}", **once}
        server.client().delete(*server.client().keys("sg:in-flight:*"))  # (its cap: free)
        first = http.post(url, data={"audio_url": f"http://{host}/clip.wav"}, timeout=30,
                          headers=c_headers)
        again = http.post(url, data={"audio_url": f"http://{host}/clip.wav"}, timeout=30,
                          headers=c_headers)
        assert first.status_code == again.status_code == 200, again.text
        assert again.json()["task_id"] == first.json()["task_id"]

        holder.sendall(_headers("/api/faster-whisper-submit",
                                f"Authorization: Bearer {keys['a']}\r\n" + BODY_START.replace(
                                    "Content-Length: 100000", "Content-Length: 400000"))
                       + b"\x01" * 1000)
        time.sleep(1.0)  # (the gateway reads what was sent)
        over = fetch("a")  # 400 KB held + its download: past a's half of the 1 MiB
        assert over.status_code == 503 and int(over.headers["retry-after"]) > 0, over.text
        assert "share" in over.json()["error"], over.text
        assert fetch("b").status_code == 200  # 400 KB + 288 KB: inside the budget
    finally:
        holder.close()
        gateway.stop()
        server.stop()
        files.shutdown()
        files.server_close()


def test_a_reply_its_client_never_reads_is_dropped_after_the_send_timeout(
        tmp_path: Path) -> None:
    """Whole (not streamed) replies too large for the sockets' buffers, to a client that
    pipelines two requests and reads nothing: the second reply's write waited for the
    connection to drain for as long as it stayed open, holding the reply in memory; now it is
    dropped after SPEECH_SEND_TIMEOUT_SECONDS and the connection aborted."""
    from tests.helpers import TCP_ESTABLISHED, tcp_state

    server, gateway, task_id = _big_reply_gateway(tmp_path)
    port = int(gateway.url.rsplit(":", 1)[1])
    silent = socket.socket()
    silent.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect
    try:
        silent.connect(("127.0.0.1", port))
        # two at once: the first reply fills the buffers (its send returns, and a lone one
        # would end at the keep-alive timeout); the second's send then waits on them
        silent.sendall(f"GET /v1/tasks/{task_id} HTTP/1.1\r\nHost: x\r\n\r\n".encode() * 2)
        wait_until(lambda: tcp_state(silent) != TCP_ESTABLISHED, 30,
                   "the unread reply's connection to be aborted", 0.5)
        assert http.get(f"{gateway.url}/v1/tasks/{task_id}", timeout=30).status_code == 200
    finally:
        silent.close()
        gateway.stop()
        server.stop()


def test_a_slow_reader_of_pipelined_replies_gets_them_whole(tmp_path: Path) -> None:
    """The send timeout drops a client that takes nothing, not one that reads slowly: two
    pipelined 3 MB replies read slowly (seconds each), with a 1 s timeout, arrive whole."""
    server, gateway, task_id = _big_reply_gateway(tmp_path)
    port = int(gateway.url.rsplit(":", 1)[1])
    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    try:
        reader.connect(("127.0.0.1", port))
        request = (f"GET /v1/tasks/{task_id} HTTP/1.1\r\nHost: x\r\n\r\n"
                   f"GET /v1/tasks/{task_id} HTTP/1.1\r\nHost: x\r\nConnection: close"
                   "\r\n\r\n").encode()
        reader.sendall(request)
        received = bytearray()
        reader.settimeout(20)
        while chunk := reader.recv(65536):
            received += chunk
            time.sleep(0.005)  # slowly: each reply takes seconds, past the timeout
        assert received.count(b"HTTP/1.1 200 OK") == 2
        assert len(received) > 2 * 3_000_000, len(received)
    finally:
        reader.close()
        gateway.stop()
        server.stop()

def _big_reply_gateway(tmp_path: Path) -> tuple[procs.RedisServer, procs.Service, str]:
    """Redis holding one SUCCEEDED task whose result is ~3 MB (more than both sockets'
    buffers), and a gateway on it with a 1 s send timeout and a 64 KB send buffer."""
    from redis.asyncio import Redis

    from common import keys
    from common.schemas import TaskState
    from common.store import Task, TaskStore, new_task_id

    server = procs.RedisServer(tmp_path / "redis", appendonly=False).start()
    task_id = new_task_id()

    async def big_task() -> None:
        client = Redis.from_url(server.url)
        await TaskStore(client, 600).submit(
            Task(id=task_id, backend="faster-whisper", model="tiny.en",
                 state=TaskState.PENDING), b"\0" * 64)
        await client.hset(keys.task(task_id), mapping={
            "state": TaskState.SUCCEEDED.value,
            "result": json.dumps({"text": "word " * 600_000, "segments": []})})
        await client.aclose()

    asyncio.run(big_task())
    gateway = procs.gateway(server.url, tmp_path, send_timeout_seconds="1",
                            send_buffer_bytes="65536").start()
    return server, gateway, task_id
