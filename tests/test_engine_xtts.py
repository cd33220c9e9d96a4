"""XTTS engine: a tiny random XTTS v2 checkpoint through the production load path, in .venvs/xtts.

coqui-tts lives in its own environment, so the engine runs in subprocesses of .venvs/xtts's
Python; the pure-Python helpers (sentence splitting, language codes) are tested here directly.
"""

from __future__ import annotations

import json
import subprocess
import wave
from pathlib import Path

import pytest

from harness.procs import ROOT, TEST_AUDIO
from tests.tiny import tiny_model as build_tiny
from workers.engines import xtts

AUDIO = TEST_AUDIO
XTTS_PYTHON = ROOT / ".venvs" / "xtts" / "bin" / "python"
TINY_DIR = ROOT / "models" / "tiny" / "xtts"
BUILTIN_SPEAKER = "Claribel Dervla"  # one of the speakers scripts/tiny_models/xtts.py writes


@pytest.fixture(scope="module")
def tiny_model() -> Path:
    """The tiny checkpoint directory (scripts/make_tiny_models.py, cached in models/tiny)."""
    return build_tiny("xtts")


def run_xtts(args: list[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([str(XTTS_PYTHON), *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    if check and proc.returncode != 0:
        pytest.fail(f"{args[:2]} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc


def check_cli(model: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run_xtts(["-m", "workers.check", "--backend", "xtts", "--model-source", str(model),
                     *args], check=check)


def last_json(stdout: str) -> dict:
    return json.loads(stdout.strip().splitlines()[-1])


def wav_seconds(path: Path) -> float:
    with wave.open(str(path), "rb") as wav:
        assert wav.getnchannels() == 1
        assert wav.getframerate() == 24000
        assert wav.getsampwidth() == 2
        return wav.getnframes() / wav.getframerate()


def test_reference_clip_gives_a_wav_of_the_reported_length(tiny_model: Path,
                                                           tmp_path: Path) -> None:
    out = tmp_path / "cloned.wav"
    proc = check_cli(tiny_model, "--text", "Hello world. This is a test.", "--out", str(out),
                     str(AUDIO / "jfk.flac"))
    (result,) = last_json(proc.stdout)["results"]
    assert result["sample_rate"] == 24000
    assert result["audio_seconds"] > 0
    assert wav_seconds(out) == pytest.approx(result["audio_seconds"], abs=1e-6)


def test_builtin_speaker_without_reference_speaks_long_text(tiny_model: Path,
                                                            tmp_path: Path) -> None:
    out = tmp_path / "builtin.wav"
    text = ("This first sentence is long enough that, together with the next one, the text "
            "goes past the two hundred and fifty characters XTTS takes per call in English. "
            "So the engine has to split it into sentences, speak each part on its own, and "
            "join the pieces into one clip.")
    assert len(xtts.split_sentences(text, 250)) == 2
    proc = check_cli(tiny_model, "--text", text, "--voice", BUILTIN_SPEAKER, "--out", str(out))
    (result,) = last_json(proc.stdout)["results"]
    assert result["audio_seconds"] > 0
    assert wav_seconds(out) == pytest.approx(result["audio_seconds"], abs=1e-6)


def test_unsupported_language_fails_clearly(tiny_model: Path) -> None:
    proc = check_cli(tiny_model, "--text", "Hallo.", "--language", "xx", "--voice",
                     BUILTIN_SPEAKER, check=False)
    assert proc.returncode != 0
    assert "language 'xx' is not supported by XTTS" in proc.stderr


@pytest.mark.parametrize("files", [(), ("config.json", "vocab.json")])
def test_bad_model_directory_fails_clearly(tmp_path: Path, files: tuple[str, ...]) -> None:
    if not XTTS_PYTHON.exists():
        pytest.skip(".venvs/xtts is missing: run scripts/install.sh xtts")
    for name in files:
        (tmp_path / name).write_text("{}")
    proc = check_cli(tmp_path / "model" if not files else tmp_path, "--text", "Hello.",
                     "--voice", BUILTIN_SPEAKER, check=False)
    assert proc.returncode != 0
    assert "is not an XTTS model directory (missing" in proc.stderr
    assert "model.pth" in proc.stderr


IN_PROCESS_SCRIPT = """
import json, sys
import numpy as np
from common.audio import decode_audio
from common.schemas import Synthesis, SynthesisOptions
from common.settings import Settings
from workers.engines.base import ModelRef
from workers.engines.xtts import XttsEngine

engine = XttsEngine(Settings())
handle = engine.load(ModelRef("tiny", sys.argv[1]), "cpu")
clip = decode_audio(sys.argv[2], engine.sample_rate)
clones = []
clone = engine._clone
engine._clone = lambda handle, clip: clones.append(len(clip)) or clone(handle, clip)


def synthesize(handle, options, reference):
    pieces = list(engine.speak(handle, options, reference))
    return Synthesis(np.concatenate([piece.audio for piece in pieces]), pieces[0].sample_rate)


options = SynthesisOptions(text="Hello there.", language="EN")
first = synthesize(handle, options, clip)
second = synthesize(handle, options, clip.copy())
faster = synthesize(handle, SynthesisOptions(text="Hello there.", speed=2.0), clip)

errors = {}
for name, options, reference in [
    ("unknown_voice", SynthesisOptions(text="Hi.", voice="Nobody"), None),
    ("no_voice", SynthesisOptions(text="Hi."), None),
    ("short_clip", SynthesisOptions(text="Hi."), clip[:2400]),
    ("empty_text", SynthesisOptions(text="  ", voice="Claribel Dervla"), None),
    ("bad_speed", SynthesisOptions(text="Hi.", voice="Claribel Dervla", speed=0), None),
    ("czech_ordinal", SynthesisOptions(text="Ahoj. Narodil se 1. ledna 1990.", language="cs",
                                       voice="Claribel Dervla"), None),
    ("tiny_decimal", SynthesisOptions(text="Il valore è 0,00005 mm.", language="it",
                                      voice="Claribel Dervla"), None),
    ("symbols", SynthesisOptions(text="Hello there. " + "%" * 240, voice="Claribel Dervla"),
     None),
    ("hindi_digits", SynthesisOptions(text="नमस्ते ३.", language="hi",
                                      voice="Claribel Dervla"), None),
]:
    try:
        synthesize(handle, options, reference)
        errors[name] = None
    except ValueError as exc:
        errors[name] = str(exc)
print(json.dumps({
    "clones": clones,
    "cached": len(handle.latents),
    "same": bool(np.array_equal(first.audio, second.audio)),
    "dtype": str(first.audio.dtype),
    "rate": first.sample_rate,
    "seconds": [first.duration, faster.duration],
    "errors": errors,
}))
"""


def test_latents_cached_output_seeded_and_input_errors(tiny_model: Path) -> None:
    proc = run_xtts(["-c", IN_PROCESS_SCRIPT, str(tiny_model), str(AUDIO / "jfk.flac")])
    answer = last_json(proc.stdout)
    assert answer["clones"] == [11 * 24000], "the same clip was cloned more than once"
    assert answer["cached"] == 1
    assert answer["same"], "the same text and voice gave different audio"
    assert answer["dtype"] == "float32" and answer["rate"] == 24000
    normal, faster = answer["seconds"]
    assert 0 < faster < normal
    errors = answer["errors"]
    assert "unknown XTTS voice 'Nobody'" in errors["unknown_voice"]
    assert "Claribel Dervla" in errors["unknown_voice"]
    assert "reference clip or a built-in voice" in errors["no_voice"]
    assert "reference clip is too short" in errors["short_clip"]
    assert errors["empty_text"] == "the text is empty"
    assert errors["bad_speed"] == "speed must be positive"
    # what the engine's text cleaning cannot read is refused before any piece is spoken
    assert "XTTS cannot read the sentence" in errors["czech_ordinal"]
    assert "Narodil se 1." in errors["czech_ordinal"]
    assert "XTTS cannot read the sentence" in errors["tiny_decimal"]
    # symbols spelled out past the GPT's 400 text tokens: refused before "Hello there."
    assert "XTTS text tokens once spelled out" in errors["symbols"], errors["symbols"]
    assert errors["hindi_digits"] is None  # a native digit is not one XTTS spells out


def test_split_sentences_gives_one_piece_per_sentence_cut_at_the_limit() -> None:
    assert xtts.split_sentences("Hello world.  This is\na test.", 250) == [
        "Hello world.", "This is a test."]
    assert xtts.split_sentences("Hello world. This is a test!", 20) == [
        "Hello world.", "This is a test!"]
    assert xtts.split_sentences("One. Two? Three\u2026 Four", 9) == [
        "One.", "Two?", "Three\u2026", "Four"]
    long = xtts.split_sentences(" ".join(["word"] * 60) + ". End.", 50)
    assert all(len(chunk) <= 50 for chunk in long) and long[-1] == "End."
    assert " ".join(long).split() == [*(["word"] * 59), "word.", "End."]
    cjk = "\u4f60\u597d\u3002\u4e16\u754c\uff01"  # two Chinese sentences
    assert xtts.split_sentences(cjk, 82) == [cjk[:3], cjk[3:]]
    assert xtts.split_sentences(cjk, 2) == [cjk[:2], cjk[2], cjk[3:5], cjk[5]]
    assert xtts.split_sentences(" \n ", 250) == []


def test_language_codes() -> None:
    assert len(xtts.SUPPORTED_LANGUAGES) == 17
    assert xtts.normalize_language("EN") == "en"
    assert xtts.normalize_language("zh") == "zh-cn"
    assert xtts.normalize_language("zh_CN") == "zh-cn"
    with pytest.raises(ValueError, match="'klingon' is not supported by XTTS; use one of en, "):
        xtts.normalize_language("klingon")
