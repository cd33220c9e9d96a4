"""Submit -> Redis -> faster-whisper worker -> status, against real processes (issue 2)."""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from common import keys
from harness.http_client import http
from harness.procs import TEST_AUDIO, wait_until
from tests.helpers import (
    JFK,
    JFK_TEXT,
    pending_count,
    queue_counts,
    status,
    submit_file,
    wait_done,
    wer,
)


def test_jfk_upload_goes_pending_running_succeeded(stack: dict) -> None:
    reply = submit_file(stack["gateway"], JFK)
    assert reply.status_code == 200
    body = reply.json()
    assert body["status"] == "PENDING" and body["task_id"] == body["taskid"]
    assert len(body["task_id"]) <= 64
    seen: list[str] = ["PENDING"]
    final = wait_done(stack["gateway"], body["taskid"], seen=seen)
    assert seen == ["PENDING", "RUNNING", "SUCCEEDED"], seen
    result = final["result"]
    assert wer(JFK_TEXT, result["text"]) <= 0.10, result["text"]
    assert final["usage"]["audio_seconds"] == pytest.approx(11.0, abs=0.1)
    assert result["usage"]["audio_seconds"] == pytest.approx(11.0, abs=0.1)
    assert result["backend"] == "faster-whisper" and result["model"] == "tiny.en"
    assert result["language"] == "en" and isinstance(result["duration"], float)
    segment = result["segments"][0]
    assert {"id", "start", "end", "text", "speaker"} <= set(segment)
    assert "words" not in segment  # only when asked


def test_word_timestamps_and_legacy_format(stack: dict) -> None:
    task_id = submit_file(stack["gateway"], JFK, word_timestamps="true").json()["taskid"]
    final = wait_done(stack["gateway"], task_id)
    words = [w for s in final["result"]["segments"] for w in s["words"]]
    assert len(words) >= 20
    assert all(w["start"] <= w["end"] and 0 <= w["probability"] <= 1 for w in words)
    legacy = status(stack["gateway"], task_id, format="fastwhisper")["result"]
    assert legacy["content"] == final["result"]["text"]
    start, end, text, legacy_words = legacy["segments"][0]
    assert start < end and text and legacy_words[0][2] == words[0]["word"]


@pytest.mark.parametrize("name", ["jfk.flac", "hotwords.mp3", "stereo_16k.wav",
                                  "multilingual.mp3"])
def test_audio_path_input_in_every_format(stack: dict, name: str) -> None:
    reply = http.post(f"{stack['gateway']}/api/submit",
                       json={"backend": "faster-whisper", "audio_path": str(TEST_AUDIO / name)})
    assert reply.status_code == 200, reply.text
    final = wait_done(stack["gateway"], reply.json()["taskid"], timeout=180)
    assert final["status"] == "SUCCEEDED", final
    expected = {"jfk.flac": 11.0, "hotwords.mp3": 4.0, "stereo_16k.wav": 5.0,
                "multilingual.mp3": 59.9}[name]
    assert final["usage"]["audio_seconds"] == pytest.approx(expected, abs=0.2)
    if name == "jfk.flac":
        assert wer(JFK_TEXT, final["result"]["text"]) <= 0.10


def test_get_submit_with_relative_path_and_query_params(stack: dict) -> None:
    reply = http.get(f"{stack['gateway']}/api/faster-whisper-submit",
                      params={"audio_file": "jfk.flac", "language": "en"})
    assert reply.status_code == 200, reply.text
    final = wait_done(stack["gateway"], reply.json()["task_id"])
    assert final["status"] == "SUCCEEDED"


def test_get_takes_its_params_from_a_json_or_form_body_too(stack: dict) -> None:
    """SPEC: GET and POST both accepted, params from the query string, a form or a JSON
    body: a GET submit and a GET status poll whose params are in the body."""
    base = stack["gateway"]
    submitted = http.request("GET", f"{base}/api/faster-whisper-submit",
                             json={"audio_file": "jfk.flac", "language": "en"})
    assert submitted.status_code == 200, submitted.text
    task_id = submitted.json()["task_id"]
    wait_done(base, task_id)
    polls = [http.request("GET", f"{base}/api/faster-whisper-status", json={"taskid": task_id}),
             http.request("GET", f"{base}/api/status", data={"task_id": task_id})]
    for reply in polls:
        assert reply.status_code == 200 and reply.json()["status"] == "SUCCEEDED", reply.text
        assert reply.json()["task_id"] == task_id


def test_unknown_task_is_200_failed(stack: dict) -> None:
    for url in ("/api/status", "/api/faster-whisper-status"):
        reply = http.post(stack["gateway"] + url, data={"task_id": "no-such-task"})
        assert reply.status_code == 200
        assert reply.json() == {"task_id": "no-such-task", "taskid": "no-such-task",
                                "status": "FAILED", "error": "unknown or expired task"}
    reply = http.get(stack["gateway"] + "/api/status")
    assert reply.status_code == 200 and reply.json()["status"] == "FAILED"
    for body in (b"{not json", b"[1, 2]"):  # a broken body is still a 200 with a status
        reply = http.post(stack["gateway"] + "/api/status", content=body,
                           headers={"content-type": "application/json"})
        assert reply.status_code == 200 and reply.json()["status"] == "FAILED", body


def _bad_inputs(tmp: Path, allowed: Path) -> list[tuple[str, dict]]:
    (tmp / "empty.wav").write_bytes(b"")
    (tmp / "random.wav").write_bytes(os.urandom(20000))
    (tmp / "text.wav").write_text("this is not audio\n" * 100)
    escape = allowed / "escape.flac"
    if not escape.exists():
        escape.symlink_to("/etc/hostname")
    (allowed / "folder").mkdir(exist_ok=True)
    return [
        ("empty file", {"upload": tmp / "empty.wav"}),
        ("random bytes", {"upload": tmp / "random.wav"}),
        ("text named .wav", {"upload": tmp / "text.wav"}),
        ("unknown backend", {"upload": JFK, "backend": "no-such-backend"}),
        ("unknown model", {"upload": JFK, "model": "large-v9"}),
        ("bad task", {"upload": JFK, "task": "summarise"}),
        ("path outside roots", {"data": {"audio_path": "/etc/hostname"}}),
        ("dot-dot escape", {"data": {"audio_path": f"{TEST_AUDIO}/../../etc/hostname"}}),
        ("symlink escape", {"data": {"audio_path": str(escape)}}),
        ("NUL byte", {"data": {"audio_path": f"{TEST_AUDIO}/jfk.flac\x00.txt"}}),
        ("directory", {"data": {"audio_path": str(allowed / "folder")}}),
        ("missing file", {"data": {"audio_path": str(allowed / "nope.wav")}}),
        ("missing file field", {"data": {"language": "en"}}),
        ("audio_url disabled", {"data": {"audio_url": "http://127.0.0.1:9/x.wav"}}),
        ("bad flag", {"upload": JFK, "word_timestamps": "maybe"}),
    ]


def test_bad_input_is_a_clear_4xx_and_enqueues_nothing(stack: dict, tmp_path: Path,
                                                       allowed_dir: Path) -> None:
    redis = stack["redis"]
    before = queue_counts(redis)
    for label, case in _bad_inputs(tmp_path, allowed_dir):
        backend = case.get("backend", "faster-whisper")
        fields = {k: v for k, v in case.items() if k not in ("upload", "backend", "data")}
        fields.update(case.get("data", {}))
        files = None
        if "upload" in case:
            files = {"file": (case["upload"].name, case["upload"].read_bytes())}
        reply = http.post(f"{stack['gateway']}/api/{backend}-submit", data=fields, files=files)
        assert 400 <= reply.status_code < 500, (label, reply.status_code, reply.text)
        body = reply.json()
        assert body["status"] == "FAILED" and len(body["error"]) > 5, (label, body)
        assert queue_counts(redis) == before, label
    assert http.get(f"{stack['gateway']}/health").json() == {"status": "ok"}
    reply = submit_file(stack["gateway"], JFK)  # still serving
    assert wait_done(stack["gateway"], reply.json()["taskid"])["status"] == "SUCCEEDED"


def test_fifty_concurrent_submits_each_run_exactly_once(stack: dict, speech_clip: Path) -> None:
    gateway, redis = stack["gateway"], stack["redis"]
    done_before = http.get(f"{stack['worker']}/health").json()["tasks_done"]
    with ThreadPoolExecutor(16) as pool:
        replies = list(pool.map(lambda _: submit_file(gateway, speech_clip), range(50)))
    task_ids = [r.json()["taskid"] for r in replies]
    assert len(set(task_ids)) == 50
    finals = [wait_done(gateway, task_id, timeout=300) for task_id in task_ids]
    assert all(f["status"] == "SUCCEEDED" for f in finals)
    assert all("hello world" in f["result"]["text"].lower() for f in finals)
    for task_id in task_ids:  # one attempt each: nothing ran twice
        assert http.get(f"{gateway}/v1/tasks/{task_id}").json()["attempts"] == 1
    assert pending_count(redis) == 0
    health = http.get(f"{stack['worker']}/health").json()
    assert health["tasks_done"] - done_before == 50


def test_cancel_pending_task_never_runs(stack: dict, speech_clip: Path) -> None:
    gateway = stack["gateway"]
    blocker = submit_file(gateway, TEST_AUDIO / "multilingual.mp3").json()["taskid"]
    # the worker busy with the blocker first: otherwise it may take both in one batch
    wait_until(lambda: status(gateway, blocker)["status"] == "RUNNING", 60, "the blocker", 0.02)
    victim = submit_file(gateway, speech_clip).json()["taskid"]
    reply = http.delete(f"{gateway}/v1/tasks/{victim}")
    assert reply.status_code == 200 and reply.json()["status"] == "CANCELLED"
    again = http.delete(f"{gateway}/v1/tasks/{victim}")  # idempotent
    assert again.status_code == 200 and again.json()["status"] == "CANCELLED"
    wait_done(gateway, blocker, timeout=180)
    time.sleep(1.0)
    view = http.get(f"{gateway}/v1/tasks/{victim}").json()
    assert view["status"] == "CANCELLED" and view["attempts"] == 0 and view["started_at"] is None
    sage = status(gateway, victim)  # Sage stops only on FAILED: a cancel must read as one
    assert sage["status"] == "FAILED" and sage["state"] == "CANCELLED"
    assert pending_count(stack["redis"]) == 0


def test_rest_view_and_cancel_errors(stack: dict) -> None:
    gateway = stack["gateway"]
    assert http.get(f"{gateway}/v1/tasks/nope").status_code == 404
    assert http.get(f"{gateway}/v1/tasks/nope").json()["error"]["message"]
    assert http.delete(f"{gateway}/v1/tasks/nope").status_code == 404
    task_id = submit_file(gateway, JFK).json()["taskid"]
    wait_done(gateway, task_id)
    view = http.get(f"{gateway}/v1/tasks/{task_id}").json()
    assert view["status"] == "SUCCEEDED" and view["result"]["text"]
    assert http.delete(f"{gateway}/v1/tasks/{task_id}").status_code == 409


def test_pending_reply_has_queue_position(stack: dict, speech_clip: Path) -> None:
    gateway = stack["gateway"]
    ids = [submit_file(gateway, TEST_AUDIO / "multilingual.mp3").json()["taskid"]]
    # the worker busy with the blocker first: after a burst (an earlier test's) it waits a
    # batch window for company and would take the three below with it (position 0)
    wait_until(lambda: status(gateway, ids[0])["status"] == "RUNNING", 60, "the blocker", 0.02)
    try:
        ids += [submit_file(gateway, speech_clip).json()["taskid"] for _ in range(3)]
        replies = [status(gateway, task_id) for task_id in ids[1:]]
        assert [r["status"] for r in replies] == ["PENDING"] * 3, replies
        assert [r["queue_position"] for r in replies] == [1, 2, 3]
        views = [http.get(f"{gateway}/v1/tasks/{task_id}", timeout=30).json()
                 for task_id in ids[1:]]  # the REST view says where it stands too (SPEC)
        assert [(v["status"], v["queue_position"]) for v in views] == [
            ("PENDING", 1), ("PENDING", 2), ("PENDING", 3)], views
    finally:  # the next test finds the worker idle even when this one fails
        for task_id in ids:
            wait_done(gateway, task_id, timeout=180)


def test_ready_and_config(stack: dict) -> None:
    ready = http.get(f"{stack['gateway']}/ready").json()
    assert ready["ready"] and ready["backends"]["faster-whisper"]["workers"] >= 1
    config = http.get(f"{stack['gateway']}/api/config").json()
    assert config["backends"]["faster-whisper"]["default_model"] == "tiny.en"
    assert config["aliases"]["whisper-1"] == "faster-whisper/tiny.en"
    # every alias the config lists is a model name the Sage submit takes where it names
    # that backend (built-in ones too), and another kind's is no model of it
    for alias, target in config["aliases"].items():
        backend, model = target.split("/", 1)
        if backend == "faster-whisper":
            reply = submit_file(stack["gateway"], JFK, model=alias)
            assert reply.status_code == 200, (alias, reply.text)
            final = wait_done(stack["gateway"], reply.json()["taskid"])
            assert final["result"]["model"] == model, (alias, final)
    refused = submit_file(stack["gateway"], JFK, model="tts-1")
    assert refused.status_code == 404 and "tts-1" in refused.json()["error"], refused.text


def test_worker_direct_transcribe_and_health(stack: dict) -> None:
    with JFK.open("rb") as handle:
        reply = http.post(f"{stack['worker']}/transcribe", files={"file": handle}, timeout=60)
    assert reply.status_code == 200, reply.text
    assert wer(JFK_TEXT, reply.json()["text"]) <= 0.10
    reply = http.post(f"{stack['worker']}/transcribe", files={"file": ("x.wav", b"garbage")})
    assert reply.status_code == 400 and "error" in reply.json()
    health = http.get(f"{stack['worker']}/health").json()
    assert health["loaded_models"] == ["tiny.en"] and health["state"] in ("ready", "busy")
    assert health["pid"] == stack["worker_service"].pid and health["memory"]["rss_mib"] > 0
    heartbeat = stack["redis"].get(keys.heartbeat("faster-whisper", health["consumer"]))
    assert heartbeat is not None
