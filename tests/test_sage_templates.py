"""The Sage llmage templates in deploy/sage/ render real gateway replies, in every state,
to valid JSON (Jinja2 without autoescape, as Sage renders them)."""

from __future__ import annotations

import asyncio
import csv
import json
import shutil
from pathlib import Path
from typing import Any

import jinja2
import pytest

from common.backends import BACKENDS, KINDS
from gateway import errors
from harness.http_client import http
from harness.procs import ROOT, TEST_AUDIO, wait_until
from tests.helpers import JFK, queue_counts, status, submit_file, wait_done

SAGE = ROOT / "deploy" / "sage"
ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(SAGE), autoescape=False,
                         undefined=jinja2.Undefined)


def render(template: str, context: dict[str, Any]) -> dict[str, Any]:
    return json.loads(ENV.get_template(template).render(**context))


def test_llm_api_map_names_existing_templates() -> None:
    with (SAGE / "llm_api_map.csv").open() as handle:
        rows = list(csv.DictReader(handle))
    assert {row["model"] for row in rows} == set(BACKENDS)
    for row in rows:
        kind = KINDS[BACKENDS[row["model"]].kind]
        assert (row["request_template"], row["response_template"]) == (kind.sage_request,
                                                                      kind.sage_response)
        assert (SAGE / row["request_template"]).is_file()
        assert (SAGE / row["response_template"]).is_file()
        assert row["submit_url"].endswith(f"/api/{row['model']}-submit?"
                                          f"{errors.REFUSAL_PARAM}=task")


def test_asr_templates_render_every_state_to_valid_json(stack: dict, allowed_dir: Path) -> None:
    gateway = stack["gateway"]
    request = render("asr_submit_request.json.j2",
                     {"audio_path": str(TEST_AUDIO / "multilingual.mp3"), "language": "en"})
    blocker = http.post(f"{gateway}/api/faster-whisper-submit", json=request).json()["taskid"]
    doomed_path = allowed_dir / "soon-gone \"quoted\" <b>.flac"
    shutil.copy(JFK, doomed_path)
    doomed = http.post(f"{gateway}/api/faster-whisper-submit",
                        json={"audio_path": str(doomed_path)}).json()["taskid"]
    cancelled = submit_file(gateway, JFK).json()["taskid"]
    replies: dict[str, dict] = {"PENDING": status(gateway, doomed)}
    doomed_path.unlink()  # the worker will find it gone: a real FAILED task
    http.delete(f"{gateway}/v1/tasks/{cancelled}")
    replies["RUNNING"] = wait_until(
        lambda: (r := status(gateway, blocker))["status"] == "RUNNING" and r, 60, "RUNNING", 0.02)
    replies["SUCCEEDED"] = wait_done(gateway, blocker, timeout=180)
    replies["FAILED"] = wait_done(gateway, doomed, timeout=60)
    replies["CANCELLED"] = status(gateway, cancelled)
    replies["UNKNOWN"] = status(gateway, "no-such-task")
    assert replies["PENDING"]["status"] == "PENDING"
    assert replies["FAILED"]["status"] == "FAILED" and replies["FAILED"]["error"]

    for state, reply in replies.items():
        rendered = render("asr_status_response.json.j2", reply)
        assert rendered["status"] == reply["status"], state
        assert rendered["taskid"] == reply.get("taskid", reply.get("task_id")), state
        if state == "SUCCEEDED":
            assert rendered["text"] == reply["result"]["text"] and rendered["segments"]
            assert rendered["usage"]["audio_seconds"] == pytest.approx(59.9, abs=0.2)
        else:
            assert rendered["text"] is None and rendered["usage"] is None, state
        if reply["status"] == "FAILED":
            assert rendered["error"] == reply["error"], state
    legacy = status(gateway, blocker, format="fastwhisper")
    assert render("asr_status_response.json.j2", legacy)["text"] == legacy["result"]["content"]


def test_a_refused_sage_submit_shows_its_reason_through_the_templates(
        stack: dict, tmp_path: Path) -> None:
    """Sage's client raises on any non-2xx submit without reading it: through the map's
    submit URL (`refusal=task`) a refusal is HTTP 200 with a task FAILED from the start, and
    both the submit's reply and the status poll render the reason; nothing is enqueued."""
    with (SAGE / "llm_api_map.csv").open() as handle:
        row = next(r for r in csv.DictReader(handle) if r["model"] == "faster-whisper")
    submit_url = row["submit_url"].replace("{gateway}", stack["gateway"])
    status_url = row["status_url"].replace("{gateway}", stack["gateway"])
    garbage = tmp_path / "garbage.flac"
    garbage.write_bytes(b"\x00not audio at all\xff" * 64)
    outside = tmp_path / "outside.flac"  # not under an allowed root
    shutil.copy(JFK, outside)
    attempts = {
        "garbage upload": lambda: http.post(submit_url, files={"file": garbage.open("rb")},
                                             timeout=60),
        "path outside the roots": lambda: http.post(submit_url, timeout=60, json=render(
            "asr_submit_request.json.j2", {"audio_path": str(outside)})),
        # through the template, as Sage passes media
        "audio_url refused": lambda: http.post(submit_url, timeout=60, json=render(
            "asr_submit_request.json.j2", {"audio_url": "http://files.example/jfk.flac"})),
    }
    before = queue_counts(stack["redis"])
    for what, attempt in attempts.items():
        reply = attempt()
        assert reply.status_code == 200, (what, reply.text)
        body = reply.json()
        assert body["status"] == "FAILED" and 400 <= body["http_status"] < 500, (what, body)
        assert body["error"] and body["taskid"].startswith("refused."), (what, body)
        assert len(body["taskid"]) <= 64 and body["taskid"] == body["task_id"]  # SPEC §3
        shown = render("asr_status_response.json.j2", body)
        assert shown["status"] == "FAILED" and shown["error"] == body["error"], what
        polled = http.get(status_url, params={"taskid": body["taskid"]}, timeout=30)
        assert polled.status_code == 200, (what, polled.text)
        assert render("asr_status_response.json.j2", polled.json()) == shown, what
    assert queue_counts(stack["redis"]) == before  # nothing enqueued, no record written
    refusal = attempts["garbage upload"]().json()
    garbage_reason = refusal["error"]
    assert "audio" in garbage_reason.lower(), garbage_reason
    assert refusal["taskid"] != attempts["garbage upload"]().json()["taskid"]  # unique
    # a refusal listing every language code is long; its id is not
    long = http.post(submit_url, files={"file": JFK.read_bytes()}, data={"language": "xx"},
                     timeout=60).json()
    assert len(long["error"]) > 200 and len(long["taskid"]) <= 64, long
    polled = http.get(status_url, params={"taskid": long["taskid"]}, timeout=30).json()
    assert polled["status"] == "FAILED" and polled["error"] == long["error"]
    # an id nobody was given says only what it holds: no message of the caller's making
    made_up = "refused.400.invalid_audio.AAAAAAAAAAAAAAAA"
    polled = http.get(status_url, params={"taskid": made_up}, timeout=30).json()
    assert polled["status"] == "FAILED" and polled["code"] == "invalid_audio"
    assert "not kept" in polled["error"], polled
    audio_url_reason = attempts["audio_url refused"]().json()["error"]
    assert "audio_url" in audio_url_reason, audio_url_reason

    # without the map's parameter, and on the OpenAI route, a refusal keeps its 4xx
    plain = http.post(f"{stack['gateway']}/api/faster-whisper-submit",
                       files={"file": garbage.open("rb")}, timeout=60)
    assert plain.status_code == 400 and plain.json() == {"status": "FAILED",
                                                         "error": garbage_reason}
    openai = http.post(f"{stack['gateway']}/v1/audio/transcriptions?refusal=task",
                        files={"file": garbage.open("rb")}, data={"model": "whisper-1"},
                        timeout=60)
    assert openai.status_code == 400 and openai.json()["error"]["message"] == garbage_reason


def test_a_body_refused_before_routing_is_a_failed_task_for_sage() -> None:
    """The body limits answer outside the app (common/body_limit.py): the same rule; with
    no store to keep the reason (Redis down) the poll says what the id holds."""
    sage = {"type": "http", "path": "/api/xtts-submit", "query_string": b"refusal=task"}

    async def scenario() -> None:
        status, body = await errors.refusal_reply(sage, 413, "the upload is over 1 MiB",
                                                  "too_large")
        assert status == 200 and body["status"] == "FAILED" and body["http_status"] == 413
        assert render("tts_status_response.json.j2", body)["error"] == "the upload is over 1 MiB"
        polled = await errors.refusal_of(body["taskid"], None)
        assert polled is not None and polled["code"] == "too_large"
        assert polled["http_status"] == 413 and "HTTP 413" in polled["error"]
        for scope in ({**sage, "query_string": b""}, {**sage, "path": "/v1/audio/speech"}):
            assert (await errors.refusal_reply(scope, 413, "over", "too_large"))[0] == 413
        for not_one in ("refused.not-base64-json!", "refused.200.ok.AAAAAAAAAAAAAAAA",
                        "refused.400.invalid_audio.AAAA"):
            assert await errors.refusal_of(not_one, None) is None

    asyncio.run(scenario())


def test_the_reasons_kept_for_one_owners_refusals_are_bounded(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A loop of refused submits costs its key nothing: past MAX_KEPT_PER_OWNER reasons in a
    retention window none more is kept for that owner (the ids still poll FAILED, from their
    status and code), and another owner's are kept as before."""
    from redis.asyncio import Redis

    from common import keys
    from common.store import refusals
    from harness import procs

    monkeypatch.setattr(refusals, "MAX_KEPT_PER_OWNER", 3)
    server = procs.RedisServer(tmp_path / "redis").start()

    async def scenario() -> None:
        redis = Redis.from_url(server.url)
        kept = refusals.Refusals(redis, 600)
        for index in range(5):
            await kept.remember(f"a{index}", f"reason {index}", "owner-a")
        await kept.remember("b0", "reason of b", "owner-b")
        assert [await kept.recall(f"a{index}") for index in range(5)] == [
            "reason 0", "reason 1", "reason 2", None, None]
        assert await kept.recall("b0") == "reason of b"
        assert 0 < await redis.ttl(keys.refusals_kept("owner-a")) <= 600
        for index in range(5):  # keys off: one trusted caller, nothing counted
            await kept.remember(f"o{index}", f"open {index}", "")
        assert await kept.recall("o4") == "open 4"
        assert not await redis.exists(keys.refusals_kept(""))
        await redis.aclose()

    try:
        asyncio.run(scenario())
    finally:
        server.stop()
