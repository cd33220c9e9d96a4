"""Parakeet engine: a tiny random `.nemo` through the production load path, in .venvs/nemo.

NeMo lives in its own environment, so the engine runs in subprocesses of .venvs/nemo's
Python; the pure-Python helpers (time re-basing, the OOM mapping) are tested here directly.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from harness.procs import ROOT, TEST_AUDIO
from tests.tiny import tiny_model as build_tiny
from workers.engines import parakeet

AUDIO = TEST_AUDIO
NEMO_PYTHON = ROOT / ".venvs" / "nemo" / "bin" / "python"


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    return build_tiny("parakeet")


def run_nemo(args: list[str], env: dict[str, str] | None = None,
             check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(NEMO_PYTHON), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, **(env or {})})
    if check and proc.returncode != 0:
        pytest.fail(f"{args[:2]} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def last_json(stdout: str) -> dict:
    # NeMo logs INFO lines to stdout; the JSON answer is the last line.
    return json.loads(stdout.strip().splitlines()[-1])


def assert_monotonic(segments: list[dict], duration: float) -> None:
    times = []
    for expected_id, segment in enumerate(segments):
        assert segment["id"] == expected_id
        assert 0 <= segment["start"] <= segment["end"] <= duration
        times += [segment["start"], segment["end"]]
        for word in segment.get("words") or []:
            assert segment["start"] <= word["start"] <= word["end"] <= duration
    assert times == sorted(times), "segment times go backwards"
    words = [(w["start"], w["end"]) for s in segments for w in s.get("words") or []]
    assert words == sorted(words), "word times go backwards"


def test_check_cli_end_to_end_and_deterministic(tiny_model: Path) -> None:
    proc = run_nemo(["-m", "workers.check", "--backend", "parakeet", "--model-source",
                     str(tiny_model), str(AUDIO / "jfk.flac"), "--repeat", "2",
                     "--word-timestamps"])
    first, second = last_json(proc.stdout)["results"]
    assert first["text"].strip()
    assert first["duration"] == pytest.approx(11.0, abs=0.05)
    assert first["usage"]["audio_seconds"] == pytest.approx(11.0, abs=0.05)
    assert first["backend"] == "parakeet"
    assert first["segments"] and all(s["words"] for s in first["segments"])
    assert " ".join(s["text"] for s in first["segments"]).split() == first["text"].split()
    assert_monotonic(first["segments"], first["duration"])
    first.pop("seconds"), second.pop("seconds")
    assert first == second, "the same file decoded twice gave different text or timestamps"


WINDOWS_SCRIPT = """
import json, sys
from common.audio import decode_audio
from common.schemas import TranscriptionOptions
from common.settings import get_settings
from workers.engines import parakeet
from workers.engines.base import ModelRef

windows = []
forward = parakeet._forward
def counting_forward(handle, audio):
    hypothesis = forward(handle, audio)
    windows.append({"seconds": len(audio) / 16000, "text": hypothesis.text.strip()})
    return hypothesis
parakeet._forward = counting_forward

engine = parakeet.ParakeetEngine(get_settings())  # window from SPEECH_PARAKEET_WINDOW_SECONDS
handle = engine.load(ModelRef("tiny", sys.argv[1]), "cpu")
audio = decode_audio(sys.argv[2], 16000)
result = engine.transcribe(handle, audio, TranscriptionOptions(word_timestamps=True),
                           lambda segment: None)
print(json.dumps({"windows": windows,
                  "result": result.to_result("parakeet", "tiny", with_words=True)}))
"""


def test_long_audio_is_decoded_in_windows(tiny_model: Path) -> None:
    proc = run_nemo(["-c", WINDOWS_SCRIPT, str(tiny_model), str(AUDIO / "multilingual.mp3")],
                    env={"SPEECH_PARAKEET_WINDOW_SECONDS": "20",
                         "SPEECH_PARAKEET_WARMUP_SECONDS": "[]"})
    answer = last_json(proc.stdout)
    windows, result = answer["windows"], answer["result"]
    assert len(windows) >= 3
    assert all(w["seconds"] <= 20 for w in windows)
    assert sum(w["seconds"] for w in windows) == pytest.approx(result["duration"], abs=0.01)
    assert result["duration"] == pytest.approx(60.0, abs=0.5)
    assert result["text"] == " ".join(w["text"] for w in windows if w["text"])
    assert_monotonic(result["segments"], result["duration"])
    # times were re-based: the last window's words sit in the last window
    assert result["segments"][-1]["end"] > result["duration"] - 20


CAST_ORDER_SCRIPT = """
import json, sys
import numpy as np, torch
from common.schemas import TranscriptionOptions
from workers.engines.base import ModelRef
from common.settings import Settings
from workers.engines.parakeet import LOCAL_ATTENTION, ParakeetEngine

engine = ParakeetEngine(Settings(), dtype="bfloat16", warmup_seconds=[1])  # bf16, as on CUDA
handle = engine.load(ModelRef("tiny", sys.argv[1]), "cpu")
engine.warm_up(handle)
asr = handle.model
islands = [f"{part}.{name}" for part in ("encoder", "decoder", "joint")
           for name, t in [*getattr(asr, part).named_parameters(),
                           *getattr(asr, part).named_buffers()]
           if t.is_floating_point() and t.dtype != torch.bfloat16]
audio = np.random.default_rng(0).normal(0, 0.1, 16000 * 5).astype(np.float32)
texts = [engine.transcribe(handle, audio, TranscriptionOptions(), lambda s: None).text
         for _ in range(2)]

# The counterfactual the comment in load() is about: cast first, then change attention.
from nemo.collections.asr.models import ASRModel
naive = ASRModel.restore_from(sys.argv[1], map_location="cpu")
naive.encoder.to(torch.bfloat16)
naive.change_attention_model(*LOCAL_ATTENTION)
naive_islands = [n for n, p in naive.encoder.named_parameters() if p.dtype == torch.float32]

print(json.dumps({
    "islands": islands,
    "attention": asr.encoder.self_attention_model,
    "context": list(asr.encoder.att_context_size),
    "layer_attention": sorted({type(layer.self_attn).__name__ for layer in asr.encoder.layers}),
    "training": [name for name, m in asr.named_modules() if m.training],
    "preprocessor_dtypes": sorted({str(t.dtype) for t in asr.preprocessor.buffers()}),
    "dither": asr.preprocessor.featurizer.dither,
    "texts": texts,
    "naive_islands": naive_islands,
}))
"""


def test_bf16_cast_after_local_attention_leaves_no_fp32_islands(tiny_model: Path) -> None:
    proc = run_nemo(["-c", CAST_ORDER_SCRIPT, str(tiny_model)])
    answer = last_json(proc.stdout)
    assert answer["islands"] == []
    assert answer["attention"] == "rel_pos_local_attn"
    assert answer["context"] == [128, 128]
    assert answer["layer_attention"] == ["RelPositionMultiHeadAttentionLongformer"]
    assert answer["training"] == [], "modules left in training mode: dropout is on"
    assert answer["preprocessor_dtypes"] == ["torch.float32"]
    assert answer["dither"] == 0.0
    assert answer["texts"][0] and answer["texts"][0] == answer["texts"][1]
    # If NeMo stops rebuilding attention in fp32, the ordering comment in load() is stale.
    assert any(".self_attn." in name for name in answer["naive_islands"])


BAD_PATHS_SCRIPT = """
import json, sys
from common.settings import Settings
from workers.engines.base import ModelRef
from workers.engines.parakeet import ParakeetEngine

errors = []
for source in sys.argv[1:]:
    try:
        ParakeetEngine(Settings()).load(ModelRef("bad", source), "cpu")
        errors.append(None)
    except Exception as exc:
        errors.append(f"{type(exc).__name__}: {exc}")
print(json.dumps({"errors": errors, "nemo_imported": "nemo" in sys.modules}))
"""


def test_bad_model_paths_fail_clearly(tiny_model: Path, tmp_path: Path) -> None:
    garbage = tmp_path / "garbage.nemo"
    shutil.copy(AUDIO / "jfk.flac", garbage)
    proc = run_nemo(["-c", BAD_PATHS_SCRIPT, str(tmp_path / "missing.nemo"), str(garbage)])
    answer = last_json(proc.stdout)
    missing, not_nemo = answer["errors"]
    assert missing.startswith("FileNotFoundError: Parakeet model file not found")
    assert not_nemo.startswith("ValueError: not a .nemo checkpoint")
    assert not answer["nemo_imported"], "a file that is no archive waited for NeMo's import"


def test_times_are_rebased_and_clamped_to_the_window() -> None:
    stamps = {
        "word": [{"word": "a", "start": 0.0, "end": 0.4}, {"word": "b.", "start": 0.5, "end": 1.0},
                 {"word": "c", "start": 1.2, "end": 20.3}],
        "segment": [{"segment": "a b.", "start": 0.0, "end": 1.0},
                    {"segment": "c", "start": 1.2, "end": 20.3}],
    }
    hypothesis = SimpleNamespace(text="a b. c", timestamp=stamps)
    segments = parakeet._segments(hypothesis, offset=40.0, limit=60.0, with_words=True)
    assert [(s.start, s.end, s.text) for s in segments] == [(40.0, 41.0, "a b."),
                                                            (41.2, 60.0, "c")]
    assert [[w.word for w in s.words or []] for s in segments] == [["a", "b."], ["c"]]
    assert segments[1].words and segments[1].words[0].end == 60.0
    assert all(s.words is None for s in parakeet._segments(hypothesis, 0, 30, with_words=False))
