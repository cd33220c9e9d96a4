"""Qwen3-ASR and VibeVoice-ASR engines: tiny checkpoints through the production load path.

transformers lives in .venvs/hf, so the engines run in subprocesses of its Python. The tiny
checkpoints come from scripts/make_tiny_models.py (built once, rebuilt when a builder changes).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from harness.procs import ROOT, TEST_AUDIO
from tests.tiny import tiny_model

JFK = TEST_AUDIO / "jfk.flac"
HF_PYTHON = ROOT / ".venvs" / "hf" / "bin" / "python"
# What the taught checkpoints answer for JFK's clip (scripts/tiny_models/hf_tiny.py).
JFK_TEXT = ("And so, my fellow Americans, ask not what your country can do for you, "
            "ask what you can do for your country.")


def run_hf(args: list[str], timeout: float = 300) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(HF_PYTHON), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    if proc.returncode != 0:
        pytest.fail(f"{args[:2]} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def check(backend: str, model: Path, *extra: str) -> list[dict[str, Any]]:
    """`python -m workers.check` on JFK's clip, twice in one process: the two results."""
    proc = run_hf(["-m", "workers.check", "--backend", backend, "--model-source", str(model),
                   str(JFK), "--repeat", "2", *extra])
    results = json.loads(proc.stdout.strip().splitlines()[-1])["results"]
    for result in results:
        result.pop("seconds")
    return results


def assert_well_formed(result: dict[str, Any], backend: str) -> None:
    assert result["backend"] == backend
    assert result["duration"] == pytest.approx(11.0, abs=0.05)
    assert result["usage"]["audio_seconds"] == pytest.approx(11.0, abs=0.05)
    previous_end = 0.0
    for expected_id, segment in enumerate(result["segments"]):
        assert segment["id"] == expected_id
        assert previous_end <= segment["start"] <= segment["end"] <= result["duration"]
        assert segment["text"].strip()
        previous_end = segment["end"]
    assert result["text"] == " ".join(segment["text"] for segment in result["segments"])


@pytest.fixture(scope="module")
def qwen3_model() -> Path:
    return tiny_model("qwen3")


@pytest.fixture(scope="module")
def vibevoice_model() -> Path:
    return tiny_model("vibevoice")


def test_qwen3_end_to_end_and_deterministic(qwen3_model: Path) -> None:
    first, second = check("qwen3", qwen3_model)
    assert_well_formed(first, "qwen3")
    assert first["text"] == JFK_TEXT
    assert first["language"] == "en"  # detected: the model answered "language English"
    assert [(s["start"], s["end"], s["speaker"]) for s in first["segments"]] == [(0.0, 11.0, None)]
    assert first == second, "the same file decoded twice gave different results"


def test_vibevoice_end_to_end_and_deterministic(vibevoice_model: Path) -> None:
    first, second = check("vibevoice", vibevoice_model)
    assert_well_formed(first, "vibevoice")
    assert first["text"] == JFK_TEXT
    assert [(s["start"], s["end"], s["speaker"]) for s in first["segments"]] == [
        (0.0, 7.2, "0"), (7.2, 11.0, "1")]
    assert first == second, "the same file decoded twice gave different results"


def test_vibevoice_random_weights_give_a_well_formed_deterministic_result() -> None:
    """An untrained model rambles until max_new_tokens: the answer is not JSON, yet the task
    succeeds, and without feature noise both decodes of the file agree."""
    model = tiny_model("vibevoice-random")
    first, second = check("vibevoice", model)
    assert_well_formed(first, "vibevoice")
    assert len(first["segments"]) <= 1
    assert first == second, "decoding is not deterministic (noise on the audio features?)"


PROBE_SCRIPT = """
import json, sys
from common.audio import decode_audio
from common.schemas import TranscriptionOptions
from common.settings import Settings
from workers.engines.base import ModelRef
from workers.engines.qwen3 import Qwen3Engine
from workers.engines.vibevoice import VibeVoiceEngine

qwen3_dir, missing, empty, clip = sys.argv[1:]
settings = Settings()

def error(call):
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return None

answer = {
    "missing": error(lambda: Qwen3Engine(settings).load(ModelRef("bad", missing), "cpu")),
    "empty": error(lambda: VibeVoiceEngine(settings).load(ModelRef("bad", empty), "cpu")),
    "wrong_family": error(lambda: VibeVoiceEngine(settings).load(ModelRef("bad", qwen3_dir),
                                                                 "cpu")),
}
engine = Qwen3Engine(settings)
handle = engine.load(ModelRef("tiny", qwen3_dir), "cpu")
audio = decode_audio(clip, engine.sample_rate)
def transcribe(**options):
    return engine.transcribe(handle, audio, TranscriptionOptions(**options), lambda s: None)
answer["bad_language"] = error(lambda: transcribe(language="xx"))
answer["translate"] = error(lambda: transcribe(task="translate"))
answer["forced_language"] = transcribe(language="ko").language
print(json.dumps(answer))
"""


def test_bad_directories_and_options_fail_clearly(qwen3_model: Path, tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    proc = run_hf(["-c", PROBE_SCRIPT, str(qwen3_model), str(tmp_path / "missing"),
                   str(tmp_path / "empty"), str(JFK)])
    answer = json.loads(proc.stdout.strip().splitlines()[-1])
    assert answer["missing"].startswith("FileNotFoundError: no model checkpoint (config.json)")
    assert answer["empty"].startswith("FileNotFoundError: no model checkpoint (config.json)")
    assert answer["wrong_family"].startswith("ValueError:")
    assert "holds a 'qwen3_asr' checkpoint, not 'vibevoice_asr'" in answer["wrong_family"]
    assert answer["bad_language"].startswith("ValueError: language 'xx' is not supported")
    assert answer["translate"] == "ValueError: qwen3 does not support task='translate'"
    assert answer["forced_language"] == "ko"
