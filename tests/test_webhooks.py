"""Signed webhooks (issue 18): real redis-server, gateways and a faster-whisper worker (tiny.en),
and a real HTTP receiver on 127.0.0.1 whose answers each test scripts. Signatures are checked
by the `openai` SDK (an independent implementation of Standard Webhooks) and by the plain
hmac snippet of docs/operations.md."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import OpenAI
from pydantic import ValidationError
from redis.asyncio import Redis

from common import keys
from common.schemas import TaskState
from common.settings import Settings
from common.store import Task
from common.store.webhooks import Owed, WebhookStore
from gateway.app import create_app
from gateway.jobs.deliverer import Deliverer
from harness import procs
from harness.http_client import http
from harness.procs import wait_until
from tests.helpers import queue_counts, wait_task

KEY, OTHER_KEY = "webhook-test-key", "someone-else"
SECRET_NEW = "whsec_" + base64.b64encode(b"n" * 32).decode()
SECRET_OLD = "whsec_" + base64.b64encode(b"o" * 32).decode()
#: the first signs as the current key; the second is a receiver still on the old one
SECRETS = {"k2": SECRET_NEW, "k1": SECRET_OLD}
HANG = "hang"  # hold the request until released, then answer 500


def digest(key: str) -> str:
    return "sha256:" + hashlib.sha256(key.encode()).hexdigest()


def auth(key: str = KEY) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@dataclass
class Hit:
    path: str
    headers: dict[str, str]
    body: bytes
    answer: int | str


class Receiver:
    """A webhook receiver: each path answers its script in turn (then 200), and every
    request is kept."""

    def __init__(self) -> None:
        self.scripts: dict[str, list[int | str]] = {}
        self.hits: list[Hit] = []
        self.release = threading.Event()
        self.lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                with receiver.lock:
                    script = receiver.scripts.setdefault(self.path, [])
                    answer = script.pop(0) if script else 200
                    receiver.hits.append(Hit(self.path, {k.lower(): v for k, v in
                                                         self.headers.items()}, body, answer))
                if answer == HANG:
                    receiver.release.wait(30)
                    answer = 500
                try:
                    self.send_response(int(answer))
                    if answer == 302:
                        self.send_header("location", "/hook/redirected")
                    self.send_header("content-length", "2")
                    self.end_headers()
                    self.wfile.write(b"ok")
                except OSError:
                    pass  # the gateway that sent it was killed

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.host = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def url(self, name: str, script: list[int | str] | None = None) -> str:
        with self.lock:
            self.scripts[f"/hook/{name}"] = list(script or [])
        return f"http://{self.host}/hook/{name}"

    def at(self, name: str) -> list[Hit]:
        with self.lock:
            return [hit for hit in self.hits if hit.path == f"/hook/{name}"]

    def wait(self, name: str, count: int, timeout: float = 30) -> list[Hit]:
        wait_until(lambda: len(self.at(name)) >= count, timeout, f"{count} hits on {name}")
        return self.at(name)

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def gateway_settings(receiver: Receiver, **overrides: Any) -> dict[str, Any]:
    return {"api_keys": [digest(KEY), digest(OTHER_KEY)],
            "callback_url_hosts": [receiver.host], "webhook_secrets": SECRETS,
            "webhook_timeout_seconds": "2", "webhook_retry_seconds": "0.3",
            "webhook_retry_factor": "2", "webhook_retry_max_seconds": "1",
            "webhook_give_up_seconds": "4", "webhook_poll_seconds": "0.1", **overrides}


@pytest.fixture(scope="module")
def receiver() -> Iterator[Receiver]:
    server = Receiver()
    yield server
    server.close()


@pytest.fixture(scope="module")
def hooks(tmp_path_factory: pytest.TempPathFactory, receiver: Receiver,
          speech_clip: Path) -> Iterator[dict[str, Any]]:
    """A Redis, a gateway that sends webhooks and a faster-whisper worker."""
    workdir = tmp_path_factory.mktemp("webhooks")
    server = procs.RedisServer(workdir / "redis").start()
    gateway = procs.gateway(server.url, workdir, **gateway_settings(receiver)).start()
    worker = procs.worker(server.url, workdir, idle_unload_seconds="-1", preload="true").start()
    yield {"gateway": gateway.url, "redis": server.client(), "clip": speech_clip}
    worker.stop()
    gateway.stop()
    server.stop()


def sage_submit(base: str, clip: Path, key: str = KEY, **params: str) -> httpx.Response:
    with clip.open("rb") as handle:
        return http.post(f"{base}/api/faster-whisper-submit", headers=auth(key),
                          files={"file": (clip.name, handle)}, data=params, timeout=60)


def verify_plain(hit: Hit, secret: str) -> bool:
    """The verification snippet of docs/operations.md, as a receiver would write it."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    signed = f"{hit.headers['webhook-id']}.{hit.headers['webhook-timestamp']}.".encode() + hit.body
    expected = base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()
    return any(hmac.compare_digest(f"v1,{expected}", part)
               for part in hit.headers["webhook-signature"].split())


def assert_signed(hit: Hit) -> None:
    sdk = OpenAI(api_key="unused", base_url="http://127.0.0.1:9")  # never called
    for secret in SECRETS.values():  # a receiver on either secret verifies it
        sdk.webhooks.verify_signature(hit.body, hit.headers, secret=secret)
        assert verify_plain(hit, secret)
    assert hit.headers["webhook-key-id"] == "k2 k1"
    assert abs(int(hit.headers["webhook-timestamp"]) - time.time()) < 60
    forged = Hit(hit.path, hit.headers, hit.body.replace(b'"status"', b'"statuz"'), hit.answer)
    assert not verify_plain(forged, SECRET_NEW)
    with pytest.raises(Exception, match="signature"):
        sdk.webhooks.verify_signature(forged.body, forged.headers, secret=SECRET_NEW)


def deliveries(base: str, task_id: str, key: str = KEY) -> httpx.Response:
    return http.get(f"{base}/v1/tasks/{task_id}/deliveries", headers=auth(key), timeout=30)


def redeliver(base: str, task_id: str, key: str = KEY) -> httpx.Response:
    return http.post(f"{base}/v1/tasks/{task_id}/redeliver", headers=auth(key), timeout=30)


def webhook_metric(base: str, outcome: str) -> float:
    text = http.get(f"{base}/metrics", headers=auth(), timeout=30).text
    line = f'speech_webhook_deliveries_total{{outcome="{outcome}"}} '
    return float(next(row for row in text.splitlines() if row.startswith(line)).split()[-1])


def test_a_receiver_failing_three_times_gets_exactly_one_verified_delivery(
        hooks: dict[str, Any], receiver: Receiver) -> None:
    base = hooks["gateway"]
    reply = sage_submit(base, hooks["clip"], callback_url=receiver.url("flaky", [500] * 3))
    assert reply.status_code == 200, reply.text
    task_id = reply.json()["task_id"]
    task = wait_task(base, task_id, auth())
    assert task["status"] == "SUCCEEDED" and "hello" in task["result"]["text"].lower()
    receiver.wait("flaky", 4)
    time.sleep(1.5)  # longer than any retry delay: nothing follows a 2xx
    hits = receiver.at("flaky")
    assert [hit.answer for hit in hits] == [500, 500, 500, 200]
    for hit in hits:  # every attempt: the same event, the task's status reply, signed
        assert hit.headers["webhook-id"] == f"evt_{task_id}_succeeded"
        # the task's status reply, and whose task it is (its key's name; here its owner id)
        assert json.loads(hit.body) == {**task, "owner": digest(KEY)[len("sha256:"):][:16]}
        assert hit.headers["content-type"] == "application/json"
        assert_signed(hit)
    view = deliveries(base, task_id).json()
    assert view["state"] == "delivered" and view["next_attempt_at"] is None
    assert view["event_id"] == f"evt_{task_id}_succeeded"
    assert [(a["outcome"], a["status"]) for a in view["attempts"]] == \
        [("failed", 500)] * 3 + [("delivered", 200)]
    assert all(a["duration"] >= 0 and a["at"] > task["finished_at"] - 1 for a in view["attempts"])
    gaps = [b["at"] - a["at"] for a, b in zip(view["attempts"], view["attempts"][1:],
                                              strict=False)]
    assert all(gap >= 0.25 for gap in gaps), gaps  # backed off, not hammered
    assert webhook_metric(base, "delivered") >= 1 and webhook_metric(base, "failed") >= 3
    assert hooks["redis"].zscore(keys.webhooks_due(), task_id) is None


def test_openai_submit_redeliver_and_owner_scoped_routes(hooks: dict[str, Any],
                                                        receiver: Receiver) -> None:
    base = hooks["gateway"]
    with hooks["clip"].open("rb") as handle:
        reply = http.post(f"{base}/v1/audio/transcriptions", headers=auth(),
                           files={"file": ("hello.wav", handle)},
                           data={"model": "whisper-1", "callback_url": receiver.url("again")},
                           timeout=120)
    assert reply.status_code == 200, reply.text
    task_id = reply.headers["x-task-id"]
    first = receiver.wait("again", 1)[0]
    assert json.loads(first.body)["id"] == task_id
    wait_until(lambda: deliveries(base, task_id).json()["state"] == "delivered", 10, "record")

    again = redeliver(base, task_id)
    assert again.status_code == 202, again.text
    assert again.json()["state"] == "scheduled"
    second = receiver.wait("again", 2)[1]
    assert second.headers["webhook-id"] == first.headers["webhook-id"]  # receivers dedupe on it
    assert second.body == first.body
    assert_signed(second)
    wait_until(lambda: len(deliveries(base, task_id).json()["attempts"]) == 2, 10, "2 attempts")

    # another key's task is as unknown as a missing one
    for call in (deliveries, redeliver):
        for tid, key in ((task_id, OTHER_KEY), ("no-such-task", KEY)):
            refused = call(base, tid, key)
            assert refused.status_code == 404, refused.text
            assert refused.json()["error"]["code"] == "task_not_found"
    # a task without a callback_url owes no webhook: never due, and both routes say so
    plain = sage_submit(base, hooks["clip"]).json()["task_id"]
    assert wait_task(base, plain, auth())["status"] == "SUCCEEDED"
    assert hooks["redis"].zscore(keys.webhooks_due(), plain) is None
    for call in (deliveries, redeliver):
        refused = call(base, plain)
        assert refused.status_code == 409, refused.text
        assert refused.json()["error"]["code"] == "no_callback_url"
    assert len(receiver.at("again")) == 2


def test_a_receiver_that_never_accepts_is_given_up_and_redirects_are_not_followed(
        hooks: dict[str, Any], receiver: Receiver) -> None:
    base = hooks["gateway"]
    given_up = webhook_metric(base, "gave_up")
    reply = sage_submit(base, hooks["clip"], callback_url=receiver.url("moved", [302] * 50))
    task_id = reply.json()["task_id"]
    wait_until(lambda: deliveries(base, task_id).json()["state"] == "gave_up", 30, "giving up")
    view = deliveries(base, task_id).json()
    attempts = view["attempts"]
    assert [a["outcome"] for a in attempts] == ["failed"] * (len(attempts) - 1) + ["gave_up"]
    assert all(a["status"] == 302 and "redirect" in a["error"] for a in attempts)
    assert attempts[-1]["at"] - attempts[0]["at"] <= 4.5  # SPEECH_WEBHOOK_GIVE_UP_SECONDS
    assert len(receiver.at("moved")) == len(attempts) >= 4
    assert receiver.at("redirected") == []
    assert view["next_attempt_at"] is None
    assert hooks["redis"].zscore(keys.webhooks_due(), task_id) is None
    assert webhook_metric(base, "gave_up") == given_up + 1


def test_callback_urls_off_the_allow_list_are_refused_and_queue_nothing(
        hooks: dict[str, Any], receiver: Receiver, redis_server: procs.RedisServer) -> None:
    base, port = hooks["gateway"], receiver.host.rsplit(":", 1)[1]
    before = queue_counts(hooks["redis"])
    cases = {
        f"http://localhost:{port}/hook/x": "not allowed",  # the same server, another name
        f"http://127.0.0.1:{procs.free_port()}/hook/x": "not allowed",  # another port
        f"http://127.0.0.1:{redis_server.port}/": "not allowed",  # Redis on the same host
        "http://127.0.0.1/hook/x": "not allowed",  # port 80: not listed
        f"ftp://{receiver.host}/hook/x": "http(s) URL",
        f"http://127.0.0.1:{port}x/hook/x": "http(s) URL",
        f"http://{receiver.host}/" + "x" * 2100: "longer than",
        f"http://{receiver.host}/hook/x\r\nx-evil: 1": "control characters",
        f"http://{receiver.host}/hook/x y": "without spaces",
        f"http://user:secret@{receiver.host}/hook/x": "credentials",
        f"http://{receiver.host}@{receiver.host}/hook/x": "credentials",
        f"http://evil.example\\@{receiver.host}/hook/x": "credentials",
        "http://127.0.0.1:0/hook/x": "http(s) URL",  # no port: not "the default port"
        "http://127.0.0.1:99999/hook/x": "http(s) URL",
        f"http://127.0.0.1.:{port}/hook/x": "not allowed",  # trailing dot: another name
        f"http://[::1]:{port}/hook/x": "not allowed",
        "http://[abc/hook/x": "http(s) URL",
        "http://\uff20a/hook/x": "http(s) URL",
    }
    for url, message in cases.items():
        sage = sage_submit(base, hooks["clip"], callback_url=url)
        assert sage.status_code == 400, (url, sage.text)
        assert sage.json()["status"] == "FAILED" and message in sage.json()["error"]
        with hooks["clip"].open("rb") as handle:
            openai = http.post(f"{base}/v1/audio/transcriptions", headers=auth(),
                                files={"file": ("hello.wav", handle)},
                                data={"model": "whisper-1", "callback_url": url}, timeout=60)
        assert openai.status_code == 400, (url, openai.text)
        error = openai.json()["error"]
        assert message in error["message"] and error["param"] == "callback_url"
        if message == "not allowed":
            assert error["code"] == "callback_url_not_allowed"
    assert queue_counts(hooks["redis"]) == before
    assert receiver.at("x") == []


def test_webhook_settings_are_checked_at_start() -> None:
    with pytest.raises(ValidationError, match="whsec_"):
        Settings(webhook_secrets={"k1": "plain-text"})
    with pytest.raises(ValidationError, match="at least 24"):
        Settings(webhook_secrets={"k1": "whsec_" + base64.b64encode(b"short").decode()})
    with pytest.raises(ValidationError, match="key id"):
        Settings(webhook_secrets={"two words": SECRET_NEW})
    with pytest.raises(RuntimeError, match="SPEECH_WEBHOOK_SECRETS"):
        create_app(Settings(callback_url_hosts=["example.com"]))


def kill(service: procs.Service) -> None:
    """SIGKILL: no shutdown, no cleanup, its claim left as it was."""
    os.kill(service.pid, signal.SIGKILL)
    service.stop()


def test_gateways_killed_between_and_during_attempts_lose_nothing(
        tmp_path_factory: pytest.TempPathFactory, receiver: Receiver, speech_clip: Path) -> None:
    """No worker here: the task ends by cancel (another terminal write through close())."""
    workdir = tmp_path_factory.mktemp("webhook-kill")
    server = procs.RedisServer(workdir / "redis").start()
    settings = gateway_settings(receiver, webhook_retry_seconds="1", webhook_retry_factor="1",
                                webhook_give_up_seconds="600")

    def start() -> procs.Service:
        return procs.gateway(server.url, workdir, **settings).start()

    first = start()
    try:
        base = first.url
        url = receiver.url("kill", [500, HANG, 200])
        task_id = sage_submit(base, speech_clip, callback_url=url).json()["task_id"]
        # a task not yet finished owes nothing yet: it cannot be sent again
        assert deliveries(base, task_id).json()["state"] == "waiting"
        refused = redeliver(base, task_id)
        assert refused.status_code == 409 and refused.json()["error"]["code"] == \
            "task_not_finished"
        assert http.delete(f"{base}/v1/tasks/{task_id}", headers=auth(),
                            timeout=30).status_code == 200
        receiver.wait("kill", 1)
        wait_until(lambda: deliveries(base, task_id).json()["attempts"], 10, "the first record")
        kill(first)  # between attempts: the retry is due in 1 s, and no gateway is left
        time.sleep(2.0)
        assert len(receiver.at("kill")) == 1  # nobody sent it ...
        second = start()  # ... until a gateway runs again
        receiver.wait("kill", 2)  # the receiver holds this attempt
        kill(second)  # during an attempt: its claim lapses after 2 x the timeout
        receiver.release.set()
        third = start()
        try:
            hits = receiver.wait("kill", 3)
            time.sleep(2.5)  # past the retry delay: a delivered event is not sent again
            hits = receiver.at("kill")
            assert [hit.answer for hit in hits] == [500, HANG, 200]
            assert len({hit.headers["webhook-id"] for hit in hits}) == 1
            for hit in hits:
                assert_signed(hit)
                assert json.loads(hit.body)["status"] == "CANCELLED"
            view = deliveries(third.url, task_id).json()
            assert view["state"] == "delivered"
            # the killed attempt left no record (the receiver saw it): at-least-once
            assert [a["status"] for a in view["attempts"]] == [500, 200]
        finally:
            third.stop()
    finally:
        first.stop()
        receiver.release.clear()
        server.stop()


def test_a_long_series_of_failures_still_backs_off_and_gives_up() -> None:
    """Past some 1024 failures a factor of 2 overflows a float: the delay stays at its
    most, and the series still ends at the give-up time (judge reads no store)."""
    settings = Settings(webhook_retry_seconds=1, webhook_retry_factor=2,
                        webhook_retry_max_seconds=10, webhook_give_up_seconds=8 * 3600)
    deliverer = Deliverer(WebhookStore(Redis.from_url("redis://127.0.0.1:1")), settings)
    task = Task(id="t" * 20, backend="faster-whisper", model="tiny.en",
                state=TaskState.FAILED)
    now = time.time()
    _, due = deliverer.judge(Owed(task, 2000, now - 60), now, None, "HTTP 500")
    assert due is not None and now + 9 < due <= time.time() + 10
    _, due = deliverer.judge(Owed(task, 2000, now - 9 * 3600), now, None, "HTTP 500")
    assert due is None
    asyncio.run(deliverer.client.aclose())


def test_one_keys_flood_of_due_webhooks_does_not_hold_up_another_keys(
        redis_server: procs.RedisServer) -> None:
    """300 due deliveries of one key (a submit-and-cancel loop makes them at no cost), all
    older than another key's one: the first pass claims that key's share and the other key's
    delivery (it used to take the oldest 64, all the flood's, and the other key's waited a
    pass per 64 of them); the flood's surplus is spread over the passes its share takes."""
    async def scenario() -> tuple[list[str], dict[str, float], float]:
        redis = Redis.from_url(redis_server.url)
        store = WebhookStore(redis)
        now = time.time() * 1000
        flood = [f"flood-task-{i:04d}" for i in range(300)]
        for i, task_id in enumerate(flood):
            await redis.hset(keys.task(task_id), "owner", "flooder")
            await redis.zadd(keys.webhooks_due(), {task_id: now - 60_000 + i})
        await redis.hset(keys.task("tenant-task"), "owner", "tenant")
        await redis.zadd(keys.webhooks_due(), {"tenant-task": now - 1_000})
        claims = await store.claim(64, 30.0, per_key=4, pass_seconds=1.0)
        scores = {task_id.decode(): score for task_id, score in await redis.zrange(
            keys.webhooks_due(), 0, -1, withscores=True)}
        await redis.delete(keys.webhooks_due(), *(keys.task(t) for t in [*flood, "tenant-task"]))
        await redis.aclose()
        return [claim.task_id for claim in claims], scores, now

    claimed, scores, now = asyncio.run(scenario())
    assert "tenant-task" in claimed and len(claimed) == 5, claimed
    assert sorted(claimed)[:4] == [f"flood-task-{i:04d}" for i in range(4)]
    # the rest: 4 a pass, over the 74 passes they take (not due again all at once)
    spread = sorted(score for task_id, score in scores.items() if task_id not in claimed)
    assert len(spread) == 296 and spread[0] >= now + 1000
    assert spread[-1] >= now + 70_000 and spread[3] < spread[4]
