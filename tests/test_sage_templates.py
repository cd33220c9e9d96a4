"""The Sage llmage templates in deploy/sage/ render real gateway replies, in every state,
to valid JSON (Jinja2 without autoescape, as Sage renders them)."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import jinja2
import pytest

from common.backends import BACKENDS, KINDS
from harness.procs import ROOT, TEST_AUDIO, wait_until
from tests.helpers import JFK, status, submit_file, wait_done

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
        assert row["submit_url"].endswith(f"/api/{row['model']}-submit")


def test_asr_templates_render_every_state_to_valid_json(stack: dict, allowed_dir: Path) -> None:
    gateway = stack["gateway"]
    request = render("asr_submit_request.json.j2",
                     {"audio_path": str(TEST_AUDIO / "multilingual.mp3"), "language": "en"})
    blocker = httpx.post(f"{gateway}/api/faster-whisper-submit", json=request).json()["taskid"]
    doomed_path = allowed_dir / "soon-gone \"quoted\" <b>.flac"
    shutil.copy(JFK, doomed_path)
    doomed = httpx.post(f"{gateway}/api/faster-whisper-submit",
                        json={"audio_path": str(doomed_path)}).json()["taskid"]
    cancelled = submit_file(gateway, JFK).json()["taskid"]
    replies: dict[str, dict] = {"PENDING": status(gateway, doomed)}
    doomed_path.unlink()  # the worker will find it gone: a real FAILED task
    httpx.delete(f"{gateway}/v1/tasks/{cancelled}")
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
