"""With API keys on, every route of the real app but /health and /ready refuses a request
without a key (a WebSocket: close code 1008); the routes are read from the app itself, so a
new one cannot be forgotten."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import websockets
from starlette.routing import WebSocketRoute

from common.settings import Settings
from gateway.app import create_app
from gateway.auth import METRICS_ROUTE, PUBLIC_ROUTES, SIGNED_AUDIO_ROUTE, digest
from gateway.errors import SAGE_STATUS_ROUTES
from harness import procs
from harness.http_client import http

KEY = "route-walk-key-0123456789"
METRICS_TOKEN = "scraper-token-9876543210"
PATH_VALUES = {"backend": "faster-whisper", "model": "tiny.en", "task_id": "no-such-task",
               "name": "app.js", "consent_id": "cons_none", "voice_id": "voice_none"}
WEBSOCKET = "WEBSOCKET"  # a WebSocket route's "method" in the walk


def app_routes() -> list[tuple[str, str]]:
    """(path template, method) of every route the gateway app serves."""
    found: list[tuple[str, str]] = []

    def walk(routes: list[Any]) -> None:
        for route in routes:
            if hasattr(route, "effective_route_contexts"):  # FastAPI's included routers
                for context in route.effective_route_contexts():
                    if isinstance(context.original_route, WebSocketRoute):
                        found.append((context.original_route.path, WEBSOCKET))
                        continue
                    found.extend((context.path, m) for m in context.methods or {"GET"})
            elif hasattr(route, "routes"):  # a mount
                walk(route.routes)
            elif isinstance(route, WebSocketRoute):
                found.append((route.path, WEBSOCKET))
            elif getattr(route, "path", None):
                found.extend((route.path, m) for m in getattr(route, "methods", None) or {"GET"})

    walk(create_app(Settings()).routes)
    return sorted(set(found))


async def websocket_close_code(url: str) -> int | None:
    async with websockets.connect(url.replace("http://", "ws://")) as socket:
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await socket.recv()
    return closed.value.rcvd.code if closed.value.rcvd else None


def concrete(path: str) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: PATH_VALUES[m.group(1)], path)


@pytest.fixture(scope="module")
def keyed_gateway(stack: dict, redis_server: procs.RedisServer, workdir: Path) -> Iterator[str]:
    """Keys on and a metrics token, on the session's Redis (whose worker /ready lists)."""
    service = procs.gateway(redis_server.url, workdir, api_keys=[f"sha256:{digest(KEY)}"],
                            metrics_token=METRICS_TOKEN).start()
    yield service.url
    service.stop()


def test_every_route_but_the_public_ones_needs_a_key(keyed_gateway: str) -> None:
    routes = app_routes()
    paths = {path for path, _ in routes}
    assert {"/api/submit", "/v1/audio/transcriptions", "/api/config", "/metrics", "/docs",
            "/openapi.json", "/redoc", "/v1/models", "/v1/realtime"} <= paths, paths
    checked = 0
    for path, method in routes:
        url = keyed_gateway + concrete(path)
        if method == WEBSOCKET:  # accepted, then closed with 1008 before any event is read
            assert path not in PUBLIC_ROUTES
            assert asyncio.run(websocket_close_code(url)) == 1008, path
            checked += 1
            continue
        reply = http.request(method, url, timeout=30)
        where = (method, path, reply.status_code, reply.text[:200])
        if path in PUBLIC_ROUTES:
            assert reply.status_code == 200, where
        elif path in SAGE_STATUS_ROUTES:  # Sage polls: HTTP 200 JSON with a status
            assert reply.status_code == 200, where
            if method != "HEAD":
                assert reply.json()["status"] == "FAILED" and "API key" in reply.json()["error"]
        else:
            assert reply.status_code == 401, where
            if method != "HEAD":
                body = reply.json()
                message = body["error"]["message"] if path.startswith("/v1/") else body["error"]
                assert "key" in message or "token" in message, where
            checked += 1
    assert checked >= 15
    # a wrong key is no better than none
    reply = http.get(f"{keyed_gateway}/api/config", headers={"x-api-key": "wrong"})
    assert reply.status_code == 401


def test_the_right_key_opens_them(keyed_gateway: str) -> None:
    auth = {"Authorization": f"Bearer {KEY}"}
    for path in ("/api/config", "/metrics", "/docs", "/redoc", "/openapi.json", "/v1/models"):
        reply = http.get(keyed_gateway + path, headers=auth, timeout=30)
        assert reply.status_code == 200, (path, reply.text[:200])
    assert "/v1/audio/transcriptions" in http.get(f"{keyed_gateway}/openapi.json",
                                                   headers=auth).json()["paths"]


def test_metrics_token_and_signed_audio_are_their_own_credentials(keyed_gateway: str,
                                                                  stack: dict,
                                                                  workdir: Path) -> None:
    assert METRICS_ROUTE == "/metrics"
    scraper = http.get(f"{keyed_gateway}/metrics",
                        headers={"Authorization": f"Bearer {METRICS_TOKEN}"})
    assert scraper.status_code == 200 and "speech_redis_up 1.0" in scraper.text
    assert http.get(f"{keyed_gateway}/metrics",
                     headers={"Authorization": "Bearer nope"}).status_code == 401
    # the metrics token opens nothing else
    assert http.get(f"{keyed_gateway}/api/config",
                     headers={"Authorization": f"Bearer {METRICS_TOKEN}"}).status_code == 401
    # a signed audio URL needs no key: a wrong token reads as an unknown task
    audio = concrete(SIGNED_AUDIO_ROUTE)
    assert http.get(f"{keyed_gateway}{audio}", params={"token": "0" * 32}).status_code == 404
    # keys off but a metrics token set: /metrics still needs the token
    redis_url = stack["worker_service"].env["SPEECH_REDIS_URL"]
    open_gateway = procs.gateway(redis_url, workdir, metrics_token=METRICS_TOKEN).start()
    try:
        assert http.get(f"{open_gateway.url}/metrics").status_code == 401
        assert http.get(f"{open_gateway.url}/metrics",
                         headers={"Authorization": f"Bearer {METRICS_TOKEN}"}).status_code == 200
        assert http.get(f"{open_gateway.url}/api/config").status_code == 200
    finally:
        open_gateway.stop()


def test_ready_shows_worker_addresses_only_with_a_key(keyed_gateway: str) -> None:
    public = http.get(f"{keyed_gateway}/ready").json()
    live = [w for b in public["backends"].values() for w in b["live"]]
    assert live, public
    assert all("url" not in w and "pid" not in w and w["consumer"] for w in live), live
    private = http.get(f"{keyed_gateway}/ready", headers={"x-api-key": KEY}).json()
    live = [w for b in private["backends"].values() for w in b["live"]]
    assert all(w["url"].startswith("http://") and w["pid"] for w in live), live


def test_a_refused_sage_submit_writes_nothing_for_a_caller_without_a_key(
        keyed_gateway: str, redis_server: procs.RedisServer) -> None:
    """`?refusal=task` (every row of deploy/sage/llm_api_map.csv) answers a refusal HTTP 200
    with a refusal id; the reason is kept only for a caller the key check passed: a client
    with no key or a wrong one writes nothing to Redis (a scanner looping over the URL would
    fill it for the retention), and its id's poll still says FAILED invalid_api_key."""
    client = redis_server.client()
    submit = f"{keyed_gateway}/api/faster-whisper-submit?refusal=task"
    before = {key for key in client.scan_iter(match="sg:refusal:*", count=500)}
    for headers in ({}, {"Authorization": "Bearer not-the-key"}):
        for _ in range(3):
            reply = http.post(submit, headers=headers, data={"audio_path": "x.wav"}, timeout=30)
            assert reply.status_code == 200 and reply.json()["http_status"] == 401, reply.text
    assert {key for key in client.scan_iter(match="sg:refusal:*", count=500)} == before
    polled = http.get(f"{keyed_gateway}/api/status", params={"taskid": reply.json()["taskid"]},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert (polled["status"], polled["code"]) == ("FAILED", "invalid_api_key"), polled
    # a caller with the key has its reason kept, as before
    kept = http.post(submit, headers={"Authorization": f"Bearer {KEY}"},
                     data={"audio_path": "/nowhere/x.wav"}, timeout=30).json()
    assert kept["status"] == "FAILED" and kept["http_status"] == 400, kept
    polled = http.get(f"{keyed_gateway}/api/status", params={"taskid": kept["taskid"]},
                      headers={"Authorization": f"Bearer {KEY}"}, timeout=30).json()
    assert polled["error"] == kept["error"], polled
