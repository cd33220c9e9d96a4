"""Fair webhook deliveries (issue 30, finding 5): a real redis-server, gateway and
faster-whisper worker, and the real receiver of tests/test_webhooks.py. One key whose receiver
hangs holds at most its own delivery slots (in every gateway process together), so another
key's webhook goes out at once; a
key's redeliveries per minute are capped; a key can have its own signing secret; the body
names the owner."""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from openai import OpenAI

from harness import procs
from harness.http_client import http
from tests.helpers import wait_task
from tests.test_webhooks import HANG, SECRETS, Receiver, digest

pytestmark = pytest.mark.timeout(300)
SLOW, FAST = "slow-tenant-key", "fast-tenant-key"
FAST_SECRET = "whsec_" + base64.b64encode(b"f" * 32).decode()
TIMEOUT = 5.0  # one attempt on a hanging receiver holds its slot this long
PER_KEY = 2


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory, speech_clip: Path) -> Iterator[dict[str, Any]]:
    receiver = Receiver()
    workdir = tmp_path_factory.mktemp("fair-webhooks")
    server = procs.RedisServer(workdir / "redis").start()
    keys = [{"key": digest(SLOW), "name": "slow"},
            {"key": digest(FAST), "name": "fast", "webhook_secrets": {"f1": FAST_SECRET}}]
    # two gateway processes deliver: a key's slots are counted across both
    gateway, second = (procs.gateway(
        server.url, workdir, api_keys=keys, callback_url_hosts=[receiver.host],
        webhook_secrets=SECRETS, webhook_timeout_seconds=str(TIMEOUT),
        webhook_retry_seconds="60", webhook_poll_seconds="0.1",
        webhook_concurrency_per_key=str(PER_KEY), webhook_redeliveries_per_minute="5").start()
        for _ in range(2))
    worker = procs.worker(server.url, workdir, idle_unload_seconds="-1", preload="true").start()
    yield {"gateway": gateway.url, "receiver": receiver, "clip": speech_clip}
    worker.stop()
    second.stop()
    gateway.stop()
    server.stop()
    receiver.close()


def submit(env: dict[str, Any], key: str, url: str) -> str:
    with env["clip"].open("rb") as handle:
        reply = http.post(f"{env['gateway']}/api/faster-whisper-submit", headers=auth(key),
                           files={"file": ("a.wav", handle)}, data={"callback_url": url},
                           timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()["task_id"]


def test_a_hanging_receiver_delays_only_its_own_key(env: dict[str, Any]) -> None:
    receiver, base = env["receiver"], env["gateway"]
    slow_url = receiver.url("hang", [HANG] * 40)
    slow = [submit(env, SLOW, slow_url) for _ in range(8)]
    for task_id in slow:
        wait_task(base, task_id, headers=auth(SLOW), timeout=60)
    receiver.wait("hang", PER_KEY, timeout=10)
    fast_id = submit(env, FAST, receiver.url("fast"))
    fast_task = wait_task(base, fast_id, headers=auth(FAST), timeout=60)
    (hit,) = receiver.wait("fast", 1, timeout=30)
    arrived = time.time()
    # sent at once, not after a pass of the slow key's hanging deliveries (5 s each)
    assert arrived - fast_task["finished_at"] < 2.0, arrived - fast_task["finished_at"]
    body = json.loads(hit.body)
    assert body["id"] == fast_id and body["owner"] == "fast"
    # signed with the fast key's own secret only, which the openai SDK verifies
    assert hit.headers["webhook-key-id"] == "f1"
    OpenAI(api_key="unused", webhook_secret=FAST_SECRET).webhooks.verify_signature(
        hit.body.decode(), hit.headers)
    # the slow key never had more than its slots on the way at once, in both gateways
    hits = receiver.at("hang")
    arrivals = sorted(h.headers["webhook-timestamp"] for h in hits)
    stamps = [int(stamp) for stamp in arrivals]
    for index, stamp in enumerate(stamps):
        window = [s for s in stamps[:index + 1] if stamp - s < TIMEOUT - 1.5]
        assert len(window) <= PER_KEY, stamps
    assert json.loads(hits[0].body)["owner"] == "slow"


def test_redeliveries_per_key_are_capped(env: dict[str, Any]) -> None:
    receiver, base = env["receiver"], env["gateway"]
    task_id = submit(env, SLOW, receiver.url("again"))
    wait_task(base, task_id, headers=auth(SLOW), timeout=60)
    answers = [http.post(f"{base}/v1/tasks/{task_id}/redeliver", headers=auth(SLOW),
                          timeout=30) for _ in range(7)]
    codes = [reply.status_code for reply in answers]
    assert codes.count(202) == 5 and codes[5:] == [429, 429], codes
    assert answers[-1].headers["retry-after"] == "60"
    assert answers[-1].json()["error"]["code"] == "too_many_redeliveries"
