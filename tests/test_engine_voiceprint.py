"""The voiceprint engine in its own environment on Resemblyzer's real encoder (the weights its
package ships), called through `python -m workers.check`: the worker's own decode and
params path, no Redis. Speakers are espeak-ng voices."""

from __future__ import annotations

import json
import math
import subprocess
import wave
from pathlib import Path
from typing import Any

import pytest

from harness.procs import ROOT
from tests.tiny import env_python

PYTHON = env_python("voiceprint")
TEXT_1 = ("The quick brown fox jumps over the lazy dog near the river bank. Yesterday we walked "
          "along the old railway line and counted the trains that passed.")
TEXT_2 = ("Please call Stella and ask her to bring these things with her from the store. Six "
          "spoons of fresh snow peas, five thick slabs of blue cheese, and a snack for Bob.")
#: clip -> (espeak-ng voice, text): one voice reads both texts, another voice the second one,
#: so only the voice, never the words, can make a pair score higher
CLIPS = {"us_1": ("en-us", TEXT_1), "us_2": ("en-us", TEXT_2), "f2_2": ("en-us+f2", TEXT_2)}


@pytest.fixture(scope="module")
def voices(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    if not PYTHON.exists():
        pytest.skip("the voiceprint environment is missing (scripts/install.sh voiceprint)")
    workdir = tmp_path_factory.mktemp("voices")
    paths = {}
    for name, (voice, text) in CLIPS.items():
        paths[name] = workdir / f"{name}.wav"
        subprocess.run(["espeak-ng", "-v", voice, "-w", str(paths[name]), text], check=True,
                       capture_output=True)
    return paths


def run_check(*args: str | Path, source: str = "bundled") -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(PYTHON), "-m", "workers.check", "--backend", "voiceprint",
                           "--model-source", source, *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def results(*args: str | Path) -> list[dict[str, Any]]:
    proc = run_check(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    outputs = json.loads(proc.stdout)["results"]
    for output in outputs:
        output.pop("seconds")  # the call's own timing
    return outputs


def test_same_voice_scores_higher_than_another_voice_and_every_run_alike(voices: dict) -> None:
    first, second = results(voices["us_1"], "--clip", f"reference={voices['us_2']}",
                            "--repeat", "2")
    (other,) = results(voices["us_1"], "--clip", f"reference={voices['f2_2']}")
    assert first == second  # deterministic, to the last digit
    assert first["score"] > other["score"] + 0.1, (first["score"], other["score"])
    # at the documented default threshold (0.8) these two synthetic voices are told apart
    assert first["threshold"] == other["threshold"] == 0.8
    assert first["same_speaker"] is True and other["same_speaker"] is False
    embedding = first["embedding"]
    assert first["dimensions"] == len(embedding) == 256
    assert math.isclose(math.hypot(*embedding), 1.0, abs_tol=1e-4) and min(embedding) >= 0
    assert first["embedding"] == other["embedding"]  # the same clip, the same voiceprint
    assert first["backend"] == "voiceprint" and first["model"] == "check"
    assert first["usage"]["audio_seconds"] > first["duration"] > 5


def test_a_clip_partly_of_another_voice_scores_low_on_its_parts(voices: dict,
                                                                tmp_path: Path) -> None:
    """The lowest part (3 s of voice) of a clip that is one voice then another scores like
    the other voice, where the whole clip scores between the two."""
    mixed = tmp_path / "mixed.wav"
    with wave.open(str(voices["us_2"]), "rb") as one, wave.open(str(voices["f2_2"]), "rb") as two:
        frames = one.readframes(one.getnframes()) + two.readframes(two.getnframes())
        with wave.open(str(mixed), "wb") as out:
            out.setparams(one.getparams())
            out.writeframes(frames)
    (same,) = results(voices["us_2"], "--clip", f"reference={voices['us_1']}")
    (other,) = results(voices["f2_2"], "--clip", f"reference={voices['us_1']}")
    (both,) = results(mixed, "--clip", f"reference={voices['us_1']}")
    assert same["parts"] > 1 and both["parts"] > same["parts"]
    assert same["lowest_part_score"] > other["score"] + 0.05, (same, other)
    assert both["lowest_part_score"] < both["score"] - 0.05, both
    assert both["lowest_part_score"] <= other["lowest_part_score"] + 0.05, (both, other)


def test_one_clip_gives_its_embedding_and_the_threshold_is_a_param(voices: dict) -> None:
    (alone,) = results(voices["us_1"])
    assert "score" not in alone and "same_speaker" not in alone
    assert alone["usage"]["audio_seconds"] == alone["duration"]
    (strict,) = results(voices["us_1"], "--clip", f"reference={voices['us_2']}",
                        "--param", "threshold=0.99")
    assert strict["embedding"] == alone["embedding"]
    assert strict["threshold"] == 0.99 and strict["same_speaker"] is False
    refused = run_check(voices["us_1"], "--param", "threshold=1.5")
    assert refused.returncode != 0
    assert "threshold must be a number from 0 to 1" in refused.stderr


def test_silence_and_a_foreign_checkpoint_are_refused_in_plain_words(
        voices: dict, tmp_path: Path) -> None:
    silence = tmp_path / "silence.wav"
    with wave.open(str(silence), "wb") as out:  # two seconds of digital silence
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes(bytes(2 * 32000))
    silent = run_check(silence, "--clip", f"reference={voices['us_1']}")
    assert silent.returncode != 0 and "no voice in the 'file' clip" in silent.stderr
    foreign = run_check(voices["us_1"], source=str(voices["us_2"]))
    assert foreign.returncode != 0
    assert "is not a Resemblyzer voice encoder checkpoint" in foreign.stderr
    missing = run_check(voices["us_1"], source=str(tmp_path / "nothing.pt"))
    assert missing.returncode != 0 and "is neither" in missing.stderr
