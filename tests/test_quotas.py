"""Quotas and metering per API key (issue 18), on a real redis-server, gateway and
faster-whisper worker (the bundled tiny.en): audio-seconds and characters per UTC day and
month, the 429 past a quota, refunds, `GET /v1/usage`, the per-key Prometheus counters."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from common import keys
from common.settings import Settings
from gateway.auth import digest
from harness import procs
from harness.http_client import http
from tests.audio_fakes import decoded_seconds, lying_matroska, variable_flac
from tests.helpers import JFK, queue_counts, wait_task

KEYS = {name: f"key-{name}-secret" for name in ("a", "b", "c", "d", "e", "f", "g", "h")}
XTTS_MODEL = procs.ROOT / "models" / "tiny" / "xtts"


def entry(name: str, **fields: Any) -> dict[str, Any]:
    return {"key": "sha256:" + digest(KEYS[name]), "name": f"tenant-{name}", **fields}


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A Redis and a gateway with eight keys; tests start (and stop) their own worker."""
    workdir = tmp_path_factory.mktemp("quotas")
    clips = workdir / "clips"
    clips.mkdir()
    server = procs.RedisServer(workdir / "redis").start()
    api_keys = [
        entry("a", quotas={"audio_seconds_per_day": 30, "characters_per_month": 20}),
        entry("b", priority="interactive"),
        entry("c", quotas={"backends": {"faster-whisper": {"audio_seconds_per_day": 12}}}),
        entry("d", quotas={"audio_seconds_per_month": 11.5}),
        entry("e", quotas={"audio_seconds_per_day": 33}),
        entry("g", quotas={"audio_seconds_per_day": 100}),
        entry("h", quotas={"audio_seconds_per_day": 25}),
        digest(KEYS["f"]),  # a plain digest still works: no name, no quotas
    ]
    models = {"faster-whisper": {"tiny.en": "bundled"}, "xtts": {"tiny": str(XTTS_MODEL)},
              "voiceprint": {"resemblyzer": "bundled"}}
    roots = [str(procs.TEST_AUDIO), str(clips)]
    gateway = procs.gateway(server.url, workdir, api_keys=api_keys, models=models,
                            allowed_roots=roots).start()
    yield {"redis": server, "gateway": gateway.url, "workdir": workdir, "clips": clips,
           "roots": roots, "client": server.client()}
    gateway.stop()
    server.stop()


def auth(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[name]}"}


def submit(env: dict[str, Any], key: str, **data: Any) -> httpx.Response:
    with JFK.open("rb") as handle:
        return http.post(f"{env['gateway']}/api/faster-whisper-submit", headers=auth(key),
                          files={"file": ("jfk.flac", handle)}, data=data, timeout=60)


def transcribe(env: dict[str, Any], key: str) -> httpx.Response:
    with JFK.open("rb") as handle:
        return http.post(f"{env['gateway']}/v1/audio/transcriptions", headers=auth(key),
                          files={"file": ("jfk.flac", handle)}, data={"model": "whisper-1"},
                          timeout=60)


def task_id(reply: httpx.Response) -> str:
    assert reply.status_code == 200, reply.text
    return reply.json()["task_id"]


def usage(env: dict[str, Any], key: str) -> dict[str, Any]:
    reply = http.get(f"{env['gateway']}/v1/usage", headers=auth(key), timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()


def start_worker(env: dict[str, Any]) -> procs.Service:
    return procs.worker(env["redis"].url, env["workdir"], idle_unload_seconds="-1",
                        allowed_roots=env["roots"]).start()


def next_midnight() -> datetime:
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return today + timedelta(days=1)


def metric(text: str, name: str, **labels: str) -> float | None:
    wanted = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))  # as rendered
    for line in text.splitlines():
        if line.startswith(f"{name}{{{wanted}}} "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_the_third_jfk_is_refused_by_a_30_second_day_and_another_key_is_unaffected(env):
    first, second = task_id(submit(env, "a")), task_id(submit(env, "a"))
    before = queue_counts(env["client"])
    refused = submit(env, "a")
    assert refused.status_code == 429, refused.text
    body = refused.json()  # Sage's shape, plus when the quota resets
    assert body["status"] == "FAILED" and "quota" in body["error"]
    assert "30 audio-seconds per day" in body["error"], body
    midnight = next_midnight()
    assert body["resets_at"] == midnight.strftime("%Y-%m-%dT%H:%M:%SZ")
    assert body["resets_at"] in body["error"]
    to_midnight = (midnight - datetime.now(UTC)).total_seconds()
    assert abs(int(refused.headers["retry-after"]) - to_midnight) <= 5
    openai = transcribe(env, "a")  # the OpenAI sync route: its own shape, the same refusal
    assert openai.status_code == 429, openai.text
    assert openai.json()["error"]["code"] == "quota_exceeded"
    assert openai.json()["resets_at"] == body["resets_at"]
    assert "retry-after" in openai.headers
    assert queue_counts(env["client"]) == before  # nothing queued by either refusal
    # Sage's status poll of a task of the refused key still answers 200
    status = http.get(f"{env['gateway']}/api/status", params={"task_id": first},
                       headers=auth("a"), timeout=30)
    assert status.status_code == 200 and status.json()["status"] == "PENDING"

    other = task_id(submit(env, "b"))  # another key is unaffected
    report = usage(env, "a")
    assert report["key"] == "tenant-a"
    day = report["day"]["audio_seconds"]
    assert day["used"] == pytest.approx(22, abs=0.1) and day["limit"] == 30
    assert day["remaining"] == pytest.approx(8, abs=0.1)
    assert day["backends"]["faster-whisper"]["used"] == pytest.approx(22, abs=0.1)
    assert report["day"]["resets_at"] == body["resets_at"]
    assert report["month"]["audio_seconds"]["used"] == pytest.approx(22, abs=0.1)
    assert report["month"]["audio_seconds"]["limit"] is None
    assert report["month"]["characters"]["limit"] == 20
    assert usage(env, "b")["day"]["audio_seconds"]["used"] == pytest.approx(11, abs=0.1)

    worker = start_worker(env)
    try:
        done = {tid: wait_task(env["gateway"], tid, auth(key)) for tid, key in
                ((first, "a"), (second, "a"), (other, "b"))}
    finally:
        worker.stop()
    assert all(task["status"] == "SUCCEEDED" for task in done.values()), done
    # settled to the decoded duration of each result, and counted once per success
    decoded = sum(done[tid]["result"]["duration"] for tid in (first, second))
    assert usage(env, "a")["day"]["audio_seconds"]["used"] == pytest.approx(decoded, abs=0.01)
    text = http.get(f"{env['gateway']}/metrics", headers=auth("f"), timeout=30).text
    assert metric(text, "speech_usage_audio_seconds_total", key="tenant-a",
                  backend="faster-whisper") == pytest.approx(decoded, abs=0.01)
    assert metric(text, "speech_usage_audio_seconds_total", key="tenant-b",
                  backend="faster-whisper") == pytest.approx(decoded / 2, abs=0.01)
    assert digest(KEYS["a"]) not in text and digest(KEYS["a"])[:20] not in text
    # still spent for today: a finished task does not give its charge back
    assert submit(env, "a").status_code == 429


def test_a_keys_default_priority_applies_when_the_submit_names_none(env):
    lane = env["client"].hget(keys.task(task_id(submit(env, "b"))), "lane")
    assert lane == b"interactive"  # tenant-b's default, on a route whose default is batch
    lane = env["client"].hget(keys.task(task_id(submit(env, "b", priority="batch"))), "lane")
    assert lane == b"batch"  # the submit's own choice wins
    lane = env["client"].hget(keys.task(task_id(submit(env, "f"))), "lane")
    assert lane == b"batch"  # a key without one: the route's default


def test_a_backend_quota_refuses_and_a_cancelled_task_gives_its_charge_back(env):
    first = task_id(submit(env, "c"))
    refused = submit(env, "c")
    assert refused.status_code == 429
    assert "12 audio-seconds per day on faster-whisper" in refused.json()["error"]
    report = usage(env, "c")["day"]["audio_seconds"]
    assert report["limit"] is None and report["used"] == pytest.approx(11, abs=0.1)
    assert report["backends"]["faster-whisper"]["limit"] == 12
    cancelled = http.delete(f"{env['gateway']}/v1/tasks/{first}", headers=auth("c"), timeout=30)
    assert cancelled.status_code == 200 and cancelled.json()["status"] == "CANCELLED"
    assert usage(env, "c")["day"]["audio_seconds"]["used"] == pytest.approx(0, abs=0.01)
    task_id(submit(env, "c"))  # room again


def test_a_failed_task_gives_its_charge_back(env):
    clip = env["clips"] / "vanishing.flac"
    shutil.copy(JFK, clip)
    first = task_id(submit_path(env, "d", clip))
    assert submit_path(env, "d", clip).status_code == 429  # 11.5 s a month
    clip.unlink()  # the worker cannot open it: the task fails
    worker = start_worker(env)
    try:
        failed = wait_task(env["gateway"], first, auth("d"))
    finally:
        worker.stop()
    assert failed["status"] == "FAILED", failed
    month = usage(env, "d")["month"]["audio_seconds"]
    assert month["used"] == pytest.approx(0, abs=0.01) and month["remaining"] == 11.5
    text = http.get(f"{env['gateway']}/metrics", headers=auth("f"), timeout=30).text
    assert not metric(text, "speech_usage_audio_seconds_total", key="tenant-d",
                      backend="faster-whisper")


def test_audio_its_file_understated_is_charged_when_decoded_and_refused_past_the_quota(env):
    """A variable-block FLAC that the submit's probe measures as 0.03 s decodes to 70 s: the
    worker charges the rest before its engine runs, within the quota (100 s a day); the
    second such file would pass it, and FAILS quota_exceeded, charged nothing."""
    lying = variable_flac(10, 17)
    assert decoded_seconds(lying) == pytest.approx(69.6, abs=0.1)
    ids = []
    for _ in range(2):
        reply = http.post(f"{env['gateway']}/api/faster-whisper-submit", headers=auth("g"),
                          files={"file": ("lying.flac", lying)}, timeout=60)
        ids.append(task_id(reply))
    assert usage(env, "g")["day"]["audio_seconds"]["used"] < 0.1  # what the probe saw
    worker = start_worker(env)
    try:
        first, second = (wait_task(env["gateway"], tid, auth("g")) for tid in ids)
    finally:
        worker.stop()
    assert first["status"] == "SUCCEEDED", first
    assert second["status"] == "FAILED" and second["error_code"] == "quota_exceeded", second
    assert "per day" in second["error"] and "69.6 s" in second["error"], second["error"]
    day = usage(env, "g")["day"]["audio_seconds"]
    assert day["used"] == pytest.approx(first["result"]["duration"], abs=0.01)
    assert day["used"] == pytest.approx(69.6, abs=0.1)


def test_a_voiceprint_is_charged_for_every_clip_it_scores(env):
    """The reference clip is decoded and embedded as the main one is: 11 s of main clip and
    33 s of reference pass a 25 s day, though the main clip alone fits."""
    reference = lying_matroska(JFK, 3, 33.0)  # jfk three times, timestamps honest

    def scores(**clips: bytes) -> httpx.Response:
        files = {"file": ("jfk.flac", JFK.read_bytes())}
        files.update({name: (f"{name}.mka", data) for name, data in clips.items()})
        return http.post(f"{env['gateway']}/api/voiceprint-submit", headers=auth("h"),
                         files=files, timeout=60)

    refused = scores(reference=reference)
    assert refused.status_code == 429 and "25 audio-seconds per day" in refused.json()["error"]
    assert refused.json()["error"].count("44.") == 1, refused.json()  # this task needs 44.x
    task_id(scores())
    assert usage(env, "h")["day"]["audio_seconds"]["used"] == pytest.approx(11, abs=0.1)


def submit_path(env: dict[str, Any], key: str, path: Path) -> httpx.Response:
    return http.post(f"{env['gateway']}/api/faster-whisper-submit", headers=auth(key),
                      data={"audio_path": str(path)}, timeout=60)


def test_concurrent_submits_cannot_overshoot_a_quota(env):
    replies: list[httpx.Response] = []

    def one() -> None:
        replies.append(submit(env, "e"))

    threads = [threading.Thread(target=one) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(reply.status_code for reply in replies) == [200] * 3 + [429] * 5
    assert usage(env, "e")["day"]["audio_seconds"]["used"] == pytest.approx(33, abs=0.1)


def test_characters_are_metered_per_month_for_speech(env):
    """No xtts worker runs: the refusal happens at submit, before any worker."""
    url = f"{env['gateway']}/api/xtts-submit"
    accepted = http.post(url, headers=auth("a"), data={"text": "Hello there."}, timeout=30)
    assert accepted.status_code == 200, accepted.text
    refused = http.post(url, headers=auth("a"), data={"text": "Hello again."}, timeout=30)
    assert refused.status_code == 429, refused.text
    assert "20 characters per month" in refused.json()["error"]
    first_of_next = (datetime.now(UTC).replace(day=1) + timedelta(days=32)).replace(day=1)
    assert refused.json()["resets_at"] == first_of_next.strftime("%Y-%m-01T00:00:00Z")
    openai = http.post(f"{env['gateway']}/v1/audio/speech", headers=auth("a"),
                        json={"model": "tts-1", "input": "Hi there, you.", "voice": "alloy"},
                        timeout=30)
    assert openai.status_code == 429 and openai.json()["error"]["code"] == "quota_exceeded"
    month = usage(env, "a")["month"]["characters"]
    assert month["used"] == 12 and month["remaining"] == 8
    assert month["backends"] == {"xtts": {"used": 12, "limit": None, "remaining": None}}
    # the same characters are the queued task's size for predicted waits (not its 0 s of audio)
    backlog = env["client"].hgetall("sg:backlog:xtts")
    assert float(backlog[b"batch:seconds"]) == 12.0 and int(backlog[b"batch:tasks"]) == 1


def test_usage_without_keys_reports_the_anonymous_callers_with_no_limits(env):
    gateway = procs.gateway(env["redis"].url, env["workdir"], allowed_roots=env["roots"]).start()
    try:
        with JFK.open("rb") as handle:
            reply = http.post(f"{gateway.url}/api/faster-whisper-submit",
                               files={"file": ("jfk.flac", handle)}, timeout=60)
        assert reply.status_code == 200, reply.text
        report = http.get(f"{gateway.url}/v1/usage", timeout=30).json()
    finally:
        gateway.stop()
    assert report["key"] is None
    day = report["day"]["audio_seconds"]
    assert day["used"] == pytest.approx(11, abs=0.1) and day["limit"] is None
    assert day["remaining"] is None


def test_key_entries_are_checked_at_start():
    good = Settings(api_keys=[digest("x"), {"key": "sha256:" + digest("y"), "name": "y"}])
    assert [key.label for key in good.api_keys] == [digest("x")[:16], "y"]
    assert good.api_key(digest("y")[:16]).name == "y"
    bad = [
        (["not-a-digest"], "SHA-256 digest"),
        ([{"key": digest("x"), "quota": {}}], "quota"),  # a typo is an error, not ignored
        ([{"key": digest("x"), "quotas": {"audio_seconds_per_day": -1}}], "greater than"),
        # no Infinity (/v1/usage could not render it), no NaN, no int too large for a float
        ([{"key": digest("x"), "quotas": {"audio_seconds_per_day": "Infinity"}}], "finite"),
        ([{"key": digest("x"), "quotas": {"audio_seconds_per_month": float("nan")}}],
         "finite|greater than"),
        ([{"key": digest("x"), "quotas": {"characters_per_day": 10 ** 400}}], "less than"),
        ([{"key": digest("x"), "quotas": {"backends": {"xtts": {"characters_per_month":
                                                                 10 ** 13}}}}], "less than"),
        ([{"key": digest("x"), "quotas": {"backends": {"whisper": {}}}}], "unknown backends"),
        ([{"key": digest("x"), "priority": "urgent"}], "priority"),
        ([{"key": digest("x"), "name": "a b"}], "key name"),
        ([digest("x"), "sha256:" + digest("x").upper()], "repeat"),
        ([{"key": digest("x"), "name": "n"}, {"key": digest("y"), "name": "n"}], "repeat"),
    ]
    for entries, words in bad:
        with pytest.raises(ValidationError, match=words):
            Settings(api_keys=entries)
