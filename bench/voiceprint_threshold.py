"""The voiceprint threshold of the voice-consent check (SPEECH_VOICE_MATCH_THRESHOLD): the
same-speaker and different-speaker scores of the voiceprint engine (Resemblyzer, bundled
encoder) on varied espeak-ng voices reading two different texts, and on the real clips in
tests/audio (two halves of one recording are the same speaker; clips of different
recordings, or a recording against a synthetic voice, are not; multilingual.mp3 has two
readers, one per half).

    .venvs/voiceprint/bin/python bench/voiceprint_threshold.py
    .venvs/voiceprint/bin/python bench/voiceprint_threshold.py --parts "$(scripts/real_voices.sh)"

Prints both distributions and the widest gap between them; writes
bench/results/voiceprint_threshold.json. With `--parts ARCHIVE` (the real voices of
harness/real_voices.py): the whole and lowest-part scores (the engine's parts) of each
speaker's sample from another meeting against a 6 s consent, of other speakers' samples,
and of mixtures (the consent's own 6 s, then 24 s of another speaker), and how many pass
at each part threshold.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from common.audio import decode_audio  # noqa: E402
from workers.engines.base import ModelRef  # noqa: E402
from workers.engines.voiceprint import BUNDLED, VoiceprintEngine  # noqa: E402

#: the consent phrase (en) and a sample text: a consent and a voice sample never share a text
TEXTS = ("I consent to my voice being recorded and used to create a synthetic voice.",
         "Please call Stella and ask her to bring these things with her from the store: six "
         "spoons of fresh snow peas and a snack for her brother Bob.")
VOICES = ("en-us", "en-us+f2", "en-us+m3", "en-us+f4", "en-gb-scotland", "en-029",
          "en-us+Andy", "en-us+Annie", "en-gb-x-rp+m7", "en-us+klatt2")
AUDIO = ROOT / "tests" / "audio"


def espeak(voice: str, text: str, out: Path) -> np.ndarray:
    subprocess.run(["espeak-ng", "-v", voice, "-w", str(out), text], check=True,
                   capture_output=True)
    return decode_audio(out, 16000)


def main() -> None:
    engine = VoiceprintEngine()
    handle = engine.load(ModelRef("resemblyzer", BUNDLED), "cpu")

    def embed(audio: np.ndarray) -> np.ndarray:
        return engine._embed(handle, audio, "clip")

    same: list[tuple[str, float]] = []
    different: list[tuple[str, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        synth = {(v, i): embed(espeak(v, t, Path(tmp) / f"{i}.wav"))
                 for v in VOICES for i, t in enumerate(TEXTS)}
    for voice in VOICES:
        same.append((f"espeak {voice}", float(synth[voice, 0] @ synth[voice, 1])))
    for a, b in itertools.permutations(VOICES, 2):
        different.append((f"espeak {a} / {b}", float(synth[a, 0] @ synth[b, 1])))
    jfk = decode_audio(AUDIO / "jfk.flac", 16000)
    long = decode_audio(AUDIO / "multilingual.mp3", 16000)
    half = len(jfk) // 2
    real = {"jfk 1st half": embed(jfk[:half]), "jfk 2nd half": embed(jfk[half:])}
    for i in range(4):
        real[f"multilingual {i * 15}-{i * 15 + 15} s"] = embed(long[i * 240000:(i + 1) * 240000])
    same.append(("jfk halves", float(real["jfk 1st half"] @ real["jfk 2nd half"])))
    # multilingual.mp3 is two readers: the first 30 s one, the last 30 s another
    parts = [name for name in real if name.startswith("multilingual")]
    for a, b in itertools.combinations(parts, 2):
        one_reader = (parts.index(a) < 2) == (parts.index(b) < 2)
        (same if one_reader else different).append((f"{a} / {b}", float(real[a] @ real[b])))
    for a in ("jfk 1st half", "jfk 2nd half", *parts):
        if a.startswith("jfk"):
            for b in parts:
                different.append((f"{a} / {b}", float(real[a] @ real[b])))
        for voice in VOICES:
            different.append((f"{a} / espeak {voice}", float(real[a] @ synth[voice, 1])))
    # espeak's en-us, en-029 and en-gb-scotland are one formant voice with other accents:
    # reported apart, as neither clearly one speaker nor two
    alike = {"en-us", "en-029", "en-gb-scotland"}
    accents = [pair for pair in different if pair[0].startswith("espeak")
               and set(pair[0].removeprefix("espeak ").split(" / ")) <= alike]
    different = [pair for pair in different if pair not in accents]
    low_same = min(score for _, score in same)
    high_different = max(score for _, score in different)
    print(f"same speaker ({len(same)} pairs): min {low_same:.3f}, median "
          f"{np.median([s for _, s in same]):.3f}")
    for name, score in sorted(same, key=lambda x: x[1])[:6]:
        print(f"  {score:.3f}  {name}")
    print(f"different speakers ({len(different)} pairs): max {high_different:.3f}, median "
          f"{np.median([s for _, s in different]):.3f}")
    for name, score in sorted(different, key=lambda x: -x[1])[:6]:
        print(f"  {score:.3f}  {name}")
    print(f"gap: {high_different:.3f} .. {low_same:.3f}")
    print("one espeak voice, other accents: " + ", ".join(f"{s:.3f}" for _, s in accents))
    out = ROOT / "bench" / "results"
    out.mkdir(exist_ok=True)
    (out / "voiceprint_threshold.json").write_text(json.dumps(
        {"same": same, "different": different, "accents": accents, "min_same": low_same,
         "max_different": high_different}, indent=1))


def parts(archive: Path) -> None:
    engine = VoiceprintEngine()
    handle = engine.load(ModelRef("resemblyzer", BUNDLED), "cpu")
    rate = engine.sample_rate
    speakers: dict[str, list[tuple[str, np.ndarray]]] = collections.defaultdict(list)
    with zipfile.ZipFile(archive) as bundle:
        for name in sorted(bundle.namelist()):
            if name.endswith(".wav") and len(name.split("/")) == 3:
                meeting, person, _ = name.split("/")
                audio = decode_audio(bundle.read(name), rate)
                if len(audio) > 4 * rate:
                    speakers[person].append((meeting, audio))

    def scored(sample: np.ndarray, consent: np.ndarray) -> tuple[float, float]:
        result = engine.analyze(handle, {"file": sample, "reference": consent},
                                {"threshold": 0.75})
        return result["score"], result["lowest_part_score"]

    def in_another_meeting(person: str) -> tuple[np.ndarray, np.ndarray] | None:
        (meeting, first), *rest = speakers[person]
        other = next((audio for where, audio in rest if where != meeting), None)
        return None if other is None else (first[:6 * rate], other[:30 * rate])

    pairs = {person: found for person in sorted(speakers)
             if (found := in_another_meeting(person)) is not None}
    same, different, mixed = [], [], []
    for person, (consent, sample) in pairs.items():
        same.append(scored(sample, consent))
        for other, (_, theirs) in pairs.items():
            if other != person:
                different.append(scored(theirs, consent))
                mixed.append(scored(np.concatenate([consent, theirs[:24 * rate]]), consent))
    for label, found in (("same speaker", same), ("different speakers", different),
                         ("consent + another speaker", mixed)):
        wholes, lowest = (np.array(column) for column in zip(*found, strict=True))
        print(f"{label} ({len(found)}): whole {wholes.min():.3f}-{wholes.max():.3f}, lowest "
              f"part {lowest.min():.3f}-{lowest.max():.3f}, pass the whole threshold 0.75: "
              f"{int((wholes >= 0.75).sum())}")
        for threshold in (0.65, 0.70, 0.75):
            passing = int(((wholes >= 0.75) & (lowest >= threshold)).sum())
            print(f"    and every part >= {threshold:.2f}: {passing}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--parts", type=Path, help="the real voices' archive")
    parsed = parser.parse_args()
    if parsed.parts:
        parts(parsed.parts)
    else:
        main()
