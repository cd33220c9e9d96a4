"""voiceprint as an operator runs it, from its row of the table alone: supervisord's generated
program, /api/config, /ready, /metrics, the Sage submit/status path (uploads and allowed
paths, rendered through the Sage templates of its kind), refusals that queue nothing, a
silent clip that fails its task, and the post-deploy smoke test."""

from __future__ import annotations

import json
import subprocess
import wave
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import jinja2
import pytest
import redis

from harness import procs
from harness.conversation import speak_to
from harness.http_client import http
from harness.procs import ROOT, wait_until
from tests.helpers import queue_counts, status, wait_done
from tests.tiny import env_python

TEXT_1 = ("The quick brown fox jumps over the lazy dog near the river bank. Yesterday we walked "
          "along the old railway line and counted the trains that passed.")
TEXT_2 = ("Please call Stella and ask her to bring these things with her from the store. Six "
          "spoons of fresh snow peas, five thick slabs of blue cheese, and a snack for Bob.")
CLIPS = {"us_1": ("en-us", TEXT_1), "us_2": ("en-us", TEXT_2), "f2_2": ("en-us+f2", TEXT_2)}
SAGE = jinja2.Environment(loader=jinja2.FileSystemLoader(ROOT / "deploy" / "sage"),
                          autoescape=False)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if not env_python("voiceprint").exists():
        pytest.skip("the voiceprint environment is missing (scripts/install.sh voiceprint)")
    workdir = tmp_path_factory.mktemp("voiceprint-stack")
    clips = workdir / "clips"
    clips.mkdir()
    for name, (voice, text) in CLIPS.items():
        speak_to(clips / f"{name}.wav", text, voice)
    (clips / "garbage.wav").write_bytes(b"RIFF\x00\x00\x00\x00WAVEnot audio at all")
    port, redis_port = procs.free_port(), procs.free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    env = procs.stack_env(
        SPEECH_RUN_DIR=str(workdir), SPEECH_PORT=str(port), SPEECH_LOCAL_REDIS="true",
        SPEECH_REDIS_PORT=str(redis_port), SPEECH_REDIS_URL=redis_url,
        SPEECH_MODELS={"voiceprint": {"resemblyzer": "bundled"}},
        SPEECH_ALLOWED_ROOTS=[str(clips)], SPEECH_HEARTBEAT_SECONDS="0.5",
        FW_ENABLED="false", VOICEPRINT_ENABLED="true")
    supervisor = procs.Supervisor(workdir, env).start()
    url = f"http://127.0.0.1:{port}"

    def live() -> bool:
        try:
            ready = http.get(f"{url}/ready", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return False
        return bool(ready.get("backends", {}).get("voiceprint", {}).get("live"))

    try:
        wait_until(live, 120, "the voiceprint worker live", 0.5)
        yield {"url": url, "clips": clips, "supervisor": supervisor,
               "redis": redis.Redis.from_url(redis_url, socket_timeout=5)}
    finally:
        supervisor.stop()


def submit(url: str, clips: Path, main: str, reference: str | None = None,
           **params: str) -> httpx.Response:
    files = {"file": (f"{main}.wav", (clips / f"{main}.wav").read_bytes())}
    if reference is not None:
        files["reference"] = (f"{reference}.wav", (clips / f"{reference}.wav").read_bytes())
    return http.post(f"{url}/api/voiceprint-submit", files=files, data=params, timeout=60)


def finished(url: str, reply: httpx.Response) -> dict[str, Any]:
    assert reply.status_code == 200, reply.text
    return wait_done(url, reply.json()["taskid"], timeout=180)


def test_config_ready_and_supervisord_show_it(stack: dict) -> None:
    info = http.get(f"{stack['url']}/api/config").json()["backends"]["voiceprint"]
    assert info["kind"] == "analysis" and info["models"] == ["resemblyzer"]
    assert [clip["name"] for clip in info["inputs"]] == ["file", "reference"]
    assert info["params"][0] | {"doc": ""} == {"name": "threshold", "type": "number",
                                               "default": 0.8, "min": 0.0, "max": 1.0, "doc": ""}
    ready = http.get(f"{stack['url']}/ready").json()["backends"]["voiceprint"]
    assert ready["ready"] and ready["workers"] == 1
    wait_until(lambda: stack["supervisor"].state("voiceprint:voiceprint_00") == "RUNNING",
               30, "supervisord counting the worker as started (startsecs)", 0.5)


def test_sage_scores_voices_deterministically_from_uploads_and_paths(stack: dict) -> None:
    url, clips = stack["url"], stack["clips"]
    same = finished(url, submit(url, clips, "us_1", "us_2"))
    other = finished(url, submit(url, clips, "us_1", "f2_2"))
    assert same["status"] == other["status"] == "SUCCEEDED", (same, other)
    assert same["result"]["score"] > other["result"]["score"] + 0.1
    assert same["result"]["same_speaker"] is True and other["result"]["same_speaker"] is False
    assert same["usage"]["audio_seconds"] > 10 and same["result"]["backend"] == "voiceprint"
    again = finished(url, submit(url, clips, "us_1", "us_2"))
    assert again["result"] == same["result"]  # deterministic
    # the threshold between the two scores separates them just the same
    middle = (same["result"]["score"] + other["result"]["score"]) / 2
    strict = finished(url, submit(url, clips, "us_1", "f2_2", threshold=str(middle)))
    assert strict["result"]["same_speaker"] is False and strict["result"]["threshold"] == middle

    # Sage's own way: allowed paths in a JSON body rendered from the kind's template
    body = json.loads(SAGE.get_template("analysis_submit_request.json.j2").render(
        audio_path=str(clips / "us_1.wav"), params={"reference": str(clips / "us_2.wav")}))
    by_path = finished(url, http.post(f"{url}/api/voiceprint-submit", json=body, timeout=60))
    assert by_path["result"]["score"] == same["result"]["score"]
    rendered = json.loads(SAGE.get_template("analysis_status_response.json.j2").render(**by_path))
    assert rendered["status"] == "SUCCEEDED" and rendered["result"] == by_path["result"]

    alone = finished(url, submit(url, clips, "us_1"))
    assert alone["result"]["embedding"] == same["result"]["embedding"]
    assert "score" not in alone["result"]


def test_refusals_queue_nothing_and_a_silent_clip_fails_its_task(stack: dict) -> None:
    url, clips = stack["url"], stack["clips"]
    before = queue_counts(stack["redis"], "voiceprint")
    refusals = {
        "file": http.post(f"{url}/api/voiceprint-submit", data={"threshold": "0.5"}),
        "threshold": submit(url, clips, "us_1", "us_2", threshold="1.5"),
        "reference": submit(url, clips, "us_1", "garbage"),
    }
    outside = http.post(f"{url}/api/voiceprint-submit", timeout=30,
                         json={"audio_path": str(clips / "us_1.wav"), "reference": "/etc/hostname"})
    refusals["reference (outside the roots)"] = outside
    for param, reply in refusals.items():
        assert reply.status_code == 400, (param, reply.text)
        assert reply.json()["status"] == "FAILED", param
        assert param.split()[0] in reply.json()["error"], (param, reply.text)
    assert queue_counts(stack["redis"], "voiceprint") == before

    with wave.open(str(clips / "silence.wav"), "wb") as out:  # two seconds of silence
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes(bytes(64000))
    failed = finished(url, submit(url, clips, "silence", "us_1"))
    assert failed["status"] == "FAILED" and "no voice in the 'file' clip" in failed["error"]


def test_metrics_and_the_smoke_test_cover_it(stack: dict) -> None:
    smoke = subprocess.run([str(ROOT / "scripts" / "smoke_test.sh"), "--url", stack["url"],
                            "--backends", "voiceprint"], capture_output=True, text=True,
                           timeout=300)
    assert smoke.returncode == 0, smoke.stdout + smoke.stderr
    assert "OK voiceprint worker " in smoke.stdout and "OK voiceprint sage: " in smoke.stdout
    assert "score=1.0" in smoke.stdout  # the same clip on both sides
    metrics = http.get(f"{stack['url']}/metrics").text
    assert 'speech_tasks_total{backend="voiceprint",outcome="SUCCEEDED"}' in metrics
    assert 'speech_queue_waiting{backend="voiceprint"} 0.0' in metrics
    assert status(stack["url"], "no-such-task")["status"] == "FAILED"
