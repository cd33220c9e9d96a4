"""Sage's plain status poll is answered without h11 (gateway/process/fast_poll.py), and every
other form of the same request still through h11: both give the same reply, keep-alive and
pipelining still work, and what the fast path declines is still answered."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from common.uvicorn_server import QuietServer
from gateway.auth import digest
from gateway.process import fast_poll
from gateway.process.slow_clients import SlowClientProtocol
from harness import procs
from harness.http_client import http

KEY = "fast-poll-key-0123456789"
AUTH = f"Authorization: Bearer {KEY}\r\n"


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory, speech_clip: Path) -> Iterator[dict]:
    """A keyed gateway with no worker: a submitted task stays queued."""
    workdir = tmp_path_factory.mktemp("fast-poll")
    server = procs.RedisServer(workdir / "redis", appendonly=False).start()
    service = procs.gateway(server.url, workdir, api_keys=[f"sha256:{digest(KEY)}"]).start()
    reply = http.post(f"{service.url}/api/faster-whisper-submit",
                      files={"file": ("clip.wav", speech_clip.read_bytes())},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=60)
    assert reply.status_code == 200, reply.text
    yield {"port": int(service.url.rsplit(":", 1)[1]), "url": service.url,
           "task": reply.json()["task_id"], "pid": service.pid}
    service.stop()
    server.stop()


def _poll(task: str, extra: str = "", version: str = "1.1") -> bytes:
    return f"GET /api/status?taskid={task} HTTP/{version}\r\nHost: x\r\n{extra}\r\n".encode()


def _replies(port: int, pieces: list[bytes], count: int) -> tuple[list[tuple[str, dict, bytes]],
                                                                 bool]:
    """Send `pieces` (each its own send, 50 ms apart, so that the server reads them apart) on
    one connection and read `count` replies: (status line, headers, body) each, and whether
    the server then closed the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for index, piece in enumerate(pieces):
            if index:
                time.sleep(0.05)
            sock.sendall(piece)
        buffer, replies = b"", []
        while len(replies) < count:
            while b"\r\n\r\n" not in buffer:
                data = sock.recv(65536)
                assert data, f"closed after {len(replies)} replies"
                buffer += data
            head, _, buffer = buffer.partition(b"\r\n\r\n")
            status, *lines = head.decode().split("\r\n")
            headers = {k.lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
            if "content-length" not in headers:  # h11's own 400: the body ends at the close
                while data := sock.recv(65536):
                    buffer += data
                return [*replies, (status, headers, buffer)], True
            size = int(headers["content-length"])
            while len(buffer) < size:
                data = sock.recv(65536)
                assert data, "closed inside a body"
                buffer += data
            replies.append((status, headers, buffer[:size]))
            buffer = buffer[size:]
        sock.settimeout(0.5)
        try:
            closed = sock.recv(1) == b""
        except TimeoutError:
            closed = False
    return replies, closed


def test_the_plain_poll_parses_and_every_other_form_is_declined() -> None:
    head = fast_poll.parse(b"GET /api/faster-whisper-status?taskid=a1 HTTP/1.1\r\n"
                           b"Host: x\r\nAuthorization: Bearer k\r\nContent-Length: 0\r\n"
                           b"Connection: Keep-Alive\r\n\r\n")
    assert head is not None
    assert head.raw_path == b"/api/faster-whisper-status" and head.query_string == b"taskid=a1"
    assert (b"authorization", b"Bearer k") in head.headers
    declined = [
        b"GET /api/status?taskid=a HTTP/1.1\r\nHost: x\r\n",  # the head is not complete
        b"GET /api/status?taskid=a HTTP/1.0\r\nHost: x\r\n\r\n",
        b"HEAD /api/status?taskid=a HTTP/1.1\r\nHost: x\r\n\r\n",
        b"POST /api/status HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /api/%73tatus?taskid=a HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /api/tasks?taskid=a HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /api/status?taskid=a HTTP/1.1\r\n\r\n",  # no Host
        b"GET /api/status?taskid=a HTTP/1.1\r\nHost: x\r\nHost: y\r\n\r\n",
        b"GET /api/status?taskid=a HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        b"GET /api/status?taskid=a HTTP/1.1\r\nHost: x\r\nConnection: keep-alive, x\r\n\r\n",
        b"GET /api/status?taskid=a HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\nabc",
        b"GET /api/status?taskid=a HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n\r\n",
        b"GET /api/status?taskid=a HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n",
        b"GET /api/status?taskid=a HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n\r\n",
        b"GET /api/status?taskid=a HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\n\r\n",
        b"GET /api/status?taskid=a HTTP/1.1\r\nHost: x\r\n folded\r\n\r\n",
        b"GET /api/status?taskid=a HTTP/1.1\r\nHost: \xc3\xa9\r\n\r\n",
        b"GET /api/status?taskid=a HTTP/1.1\r\nHost: x\r\n\r\n"  # pipelined: two heads
        b"GET /api/status?taskid=a HTTP/1.1\r\nHost: x\r\n\r\n",
        b"GET /api/status?taskid=a HTTP/1.1\r\nHost: x\r\nX: " + b"a" * 9000 + b"\r\n\r\n",
    ]
    for data in declined:
        assert fast_poll.parse(data) is None, data


def test_a_poll_reads_the_same_with_or_without_h11(gateway: dict) -> None:
    """The same poll whole (the fast path) and with its head split over two sends (h11): the
    same status, headers and body; a refused key reads alike too (HTTP 200, Sage's form)."""
    for extra in (AUTH, "Authorization: Bearer wrong-key-0123456789\r\n"):
        request = _poll(gateway["task"], extra)
        (fast,), _ = _replies(gateway["port"], [request], 1)
        (slow,), _ = _replies(gateway["port"], [request[:20], request[20:]], 1)
        assert fast[0] == slow[0] == "HTTP/1.1 200 OK"
        assert fast[2] == slow[2]
        assert set(fast[1]) == set(slow[1]), (fast[1], slow[1])
        assert fast[1]["content-type"] == "application/json"
    body = json.loads(fast[2])
    assert body["status"] == "FAILED" and "key" in json.dumps(body).lower(), body
    (mine,), _ = _replies(gateway["port"], [_poll(gateway["task"], AUTH)], 1)
    pending = json.loads(mine[2])
    assert pending["status"] == "PENDING" and pending["queue_position"] == 1, pending


def test_keep_alive_and_pipelining_go_on_across_both_paths(gateway: dict) -> None:
    task = gateway["task"]
    polls = [_poll(task, AUTH)] * 3
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    # one connection: three polls each its own send, a /health (h11), a poll again; then
    # two polls in one send (h11 reads both) and a poll sent while the one before is out
    replies, closed = _replies(gateway["port"], [*polls, health, polls[0]], 5)
    assert [r[0] for r in replies] == ["HTTP/1.1 200 OK"] * 5 and not closed
    assert json.loads(replies[3][2]) == {"status": "ok"}
    assert all(json.loads(r[2])["status"] == "PENDING" for r in replies[:3] + replies[4:])
    replies, closed = _replies(gateway["port"], [polls[0] + polls[0], polls[0], health], 4)
    assert [json.loads(r[2]).get("task_id") for r in replies] == [task, task, task, None]
    assert not closed


def test_what_the_fast_path_declines_is_still_answered(gateway: dict) -> None:
    task = gateway["task"]
    (reply,), closed = _replies(gateway["port"], [_poll(task, AUTH, version="1.0")], 1)
    assert json.loads(reply[2])["status"] == "PENDING" and closed
    (reply,), closed = _replies(gateway["port"], [_poll(task, AUTH + "Connection: close\r\n")],
                                1)
    assert json.loads(reply[2])["status"] == "PENDING" and closed
    escaped = _poll(task, AUTH).replace(b"/api/status", b"/api/%73tatus")
    (reply,), _ = _replies(gateway["port"], [escaped], 1)
    assert json.loads(reply[2])["status"] == "PENDING"
    (reply,), closed = _replies(gateway["port"], [b"GET /api/status HTTP/1.1\r\n\r\n"], 1)
    assert reply[0].startswith("HTTP/1.1 400") and closed  # h11: no Host
    replies, _ = _replies(gateway["port"], [_poll("nope", AUTH)], 1)
    assert json.loads(replies[0][2])["status"] == "FAILED"


def test_mangled_polls_get_an_http_answer_or_a_close_and_the_gateway_serves_on(
        gateway: dict) -> None:
    """200 seeded mutations of a plain poll (bytes flipped, CR/LF and NUL dropped in,
    cut short, a header doubled, a body announced), 50 at a time: every connection gets an
    HTTP/1.1 reply, is closed, or (a head never finished) waits; the gateway stays up, and
    the plain poll still reads right."""
    import asyncio
    import random

    import psutil

    rng = random.Random(40)
    base = _poll(gateway["task"], AUTH)

    def mangled() -> bytes:
        data = bytearray(base)
        kind = rng.randrange(6)
        if kind == 0:
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif kind == 1:
            at = rng.randrange(len(data))
            data[at:at] = rng.choice([b"\r", b"\n", b"\x00", b"\r\n", b" ", b"\t"])
        elif kind == 2:
            del data[rng.randrange(len(data)):]
        elif kind == 3:
            data[-2:-2] = rng.choice([b"Host: y\r\n", b"Content-Length: 5\r\n", AUTH.encode()])
        elif kind == 4:
            data += rng.choice([b"hello", base, base[:30]])
        else:
            data = data.replace(b"HTTP/1.1", rng.choice([b"HTTP/1.0", b"HTTP/2", b"HTTP/1.1 x"]))
        return bytes(data)

    async def one(data: bytes) -> str:
        reader, writer = await asyncio.open_connection("127.0.0.1", gateway["port"])
        try:
            writer.write(data)
            await writer.drain()
            first = await asyncio.wait_for(reader.read(9), 3.0)
            if not first:
                return "closed"
            assert first == b"HTTP/1.1 ", (data, first)
            return "answered"
        except TimeoutError:
            return "waiting"
        except ConnectionError:
            return "closed"
        finally:
            writer.close()

    async def all_of(cases: list[bytes]) -> list[str]:
        outcomes: list[str] = []
        for start in range(0, len(cases), 50):
            outcomes += await asyncio.gather(*(one(data) for data in cases[start:start + 50]))
        return outcomes

    outcomes = asyncio.run(all_of([mangled() for _ in range(200)]))
    assert outcomes.count("answered") > 100, outcomes
    assert psutil.pid_exists(gateway["pid"])
    (reply,), _ = _replies(gateway["port"], [_poll(gateway["task"], AUTH)], 1)
    assert json.loads(reply[2])["status"] == "PENDING"


@pytest.mark.parametrize("root_path", ["", "/speech"])
def test_the_fast_path_builds_the_scope_h11_builds(root_path: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """`fast_poll.scope_of` copies how uvicorn's h11 protocol builds a request's scope. An app
    served by the gateway's protocol class (the launcher's options) records the scope of one
    poll sent whole (the fast path) and split over two sends (h11): the two are equal, so a
    uvicorn that builds its scope differently fails here, not in a deployment. The
    X-Forwarded-For header makes uvicorn's proxy-headers wrapper (which trusts loopback) set
    the same client on both connections."""
    scopes: list[dict] = []
    fast_scopes: list[dict] = []  # built by the fast path (the rest by h11)
    built = fast_poll.scope_of
    monkeypatch.setattr(fast_poll, "scope_of", lambda head, protocol: fast_scopes.append(
        built(head, protocol)) or fast_scopes[-1])

    async def app(scope: dict, receive: object, send: object) -> None:
        if scope["type"] != "http":
            return
        scopes.append(scope)
        await send({"type": "http.response.start", "status": 200,  # type: ignore[operator]
                    "headers": [(b"content-type", b"text/plain"), (b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})  # type: ignore[operator]

    port = procs.free_port()
    server = QuietServer(uvicorn.Config(app, host="127.0.0.1", port=port, lifespan="off",
                                        log_level="warning", http=SlowClientProtocol,
                                        root_path=root_path))
    thread = procs.serve_in_thread(server)
    try:
        request = _poll("a-task-id&format=fastwhisper", "X-Forwarded-For: 10.1.2.3\r\n"
                        "Authorization: Bearer k\r\n")
        assert fast_poll.parse(request) is not None
        for pieces in ([request], [request[:20], request[20:]]):
            (reply,), _ = _replies(port, pieces, 1)
            assert reply[0] == "HTTP/1.1 200 OK" and reply[2] == b"ok"
    finally:
        server.stop()
        thread.join(timeout=30)
    assert len(fast_scopes) == 1, "the whole poll took h11, or the split one the fast path"
    fast, slow = scopes
    assert fast["client"] == ("10.1.2.3", 0)
    assert fast == slow
