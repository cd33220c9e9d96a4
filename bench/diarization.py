"""8. Speaker diarization on the bench's own evaluation set: count, DER, and its cost.

In-process, with the worker's own code paths. harness/diarization_set.py renders its seeded
conversations (24: six each of 2, 3, 4 and 5 espeak-ng speakers, varied accents, variants,
pitch, rate, turn lengths, pauses, a few overlaps), the two-voice conversation of
harness/conversation.py, the set's monologues (12: one voice each), and long recordings
(the first 4 conversations and monologues lengthened to 100 lines, ~8 minutes). On each,
faster-whisper (bundled tiny.en, word timestamps on, as a diarized task runs it)
transcribes, and the bundled diarizer (workers/diarize.py) finds the turns with the count
estimated and with num_speakers given. Reported per speaker count: how often the estimate
found the right count, the mean DER (0.25 s collar, and none) of both cases, and
diarization time / transcription time over the whole set, with the count estimated and told
(a told count runs the estimate as well: workers/diarize.py's `_cluster`).

Targets: count right >= 90 % and DER <= 0.10 with the estimate; DER <= 0.05 with
num_speakers; diarization <= 1.0x the transcription time (the count's over the short
conversations; the monologues' and the long recordings' count right are reported beside it).
Takes ~7-8 minutes on 2 cores (--count N takes the first N conversations, --monologues N,
--long N; --seed S renders another seeded set of the same kind, a held-out check;
--untuned-voices draws the speakers from espeak-ng's other variants, none of which any
threshold was measured on; --real-voices takes harness/real_voices.py's conversations and
monologues of real people instead, fetched once by scripts/real_voices.sh).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from bench import common as bc  # noqa: E402
from common.audio import decode_audio  # noqa: E402
from common.schemas import DiarizationOptions, TranscriptionOptions  # noqa: E402
from common.settings import Settings  # noqa: E402
from harness import conversation, diarization_set, real_voices  # noqa: E402
from workers.diarize import Diarizer, Turn, der  # noqa: E402
from workers.engines.base import ModelRef  # noqa: E402
from workers.engines.faster_whisper import FasterWhisperEngine  # noqa: E402

COUNT_TARGET, DER_TARGET, DER_KNOWN_TARGET, COST_TARGET = 0.90, 0.10, 0.05, 1.0


#: the long recordings: the set's first conversations and monologues, lengthened to this many
#: lines (~8 minutes each)
LONG_LINES = 100


def cases(root: Path, count: int, monologues: int, long: int,
          seed: int = diarization_set.SEED,
          variants: tuple[str, ...] = diarization_set.VARIANTS,
          ) -> list[tuple[str, Path, list[Turn]]]:
    """(name, path, reference turns): the two-voice conversation, the set, its monologues,
    and `long` long conversations and as many long monologues."""
    talk = root / "two-voices.wav"
    found = [("two-voices", talk, [Turn(t.start, t.end, t.speaker)
                                   for t in conversation.build(talk)])]
    built = [("set", item) for item in diarization_set.build(root, range(count), seed, variants)]
    built += [("monologue", item)
              for item in diarization_set.build_monologues(root, range(monologues), seed,
                                                               variants=variants)]
    built += [("long", item)
              for item in diarization_set.build_long(root, range(long), LONG_LINES, seed,
                                                         variants)]
    built += [("long-monologue", item) for item in diarization_set.build_monologues(
        root, range(long), seed, lines=LONG_LINES, variants=variants)]
    for kind, item in built:
        found.append((f"{kind}-{item.spec.index:02d}", item.path,
                      [Turn(t.start, t.end, t.speaker) for t in item.turns]))
    return found


def real_cases(root: Path, seed: int) -> list[tuple[str, Path, list[Turn]]]:
    """(name, path, reference turns) of harness/real_voices.py's set."""
    archive = subprocess.run([str(Path(__file__).resolve().parents[1] / "scripts/real_voices.sh")],
                             check=True, capture_output=True, text=True).stdout.strip()
    return [(f"{'set' if item.speakers > 1 else 'monologue'}-{item.index:02d}", item.path,
             [Turn(t.start, t.end, t.speaker) for t in item.turns])
            for item in real_voices.build(Path(archive), root, seed)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=diarization_set.COUNT)
    parser.add_argument("--monologues", type=int, default=diarization_set.MONOLOGUES)
    parser.add_argument("--long", type=int, default=4)
    parser.add_argument("--seed", type=int, default=None,
                        help=f"default {diarization_set.SEED} ({real_voices.SEED} for the "
                             "real voices)")
    voices = parser.add_mutually_exclusive_group()
    voices.add_argument("--untuned-voices", action="store_true",
                        help="draw the speakers from diarization_set.UNTUNED_VARIANTS")
    voices.add_argument("--real-voices", action="store_true",
                        help="real people's voices (harness/real_voices.py) instead")
    args = parser.parse_args()
    seed = args.seed if args.seed is not None else (
        real_voices.SEED if args.real_voices else diarization_set.SEED)
    started = bc.machine()
    engine = FasterWhisperEngine(Settings(_env_file=None))  # type: ignore[call-arg]
    model = engine.load(ModelRef("tiny.en", "bundled"), "cpu")
    diarizer = Diarizer()
    with bc.timed() as load:
        handle = diarizer.load()
    options = TranscriptionOptions(language="en", word_timestamps=True)
    results = []
    transcribe_s = diarize_s = told_s = audio_s = 0.0
    with tempfile.TemporaryDirectory() as tmp:
        variants = (diarization_set.UNTUNED_VARIANTS if args.untuned_voices
                    else diarization_set.VARIANTS)
        found = (real_cases(Path(tmp), seed) if args.real_voices
                 else cases(Path(tmp), args.count, args.monologues, args.long, seed, variants))
        for name, path, truth in found:
            audio = decode_audio(path, 16000)
            speakers = len({t.speaker for t in truth})
            t0 = time.perf_counter()
            engine.transcribe(model, audio, options, lambda _: None)
            t1 = time.perf_counter()
            estimated = diarizer.diarize(handle, audio, DiarizationOptions())
            t2 = time.perf_counter()
            told = diarizer.diarize(handle, audio, DiarizationOptions(num_speakers=speakers))
            t3 = time.perf_counter()
            transcribe_s += t1 - t0
            diarize_s += t2 - t1
            told_s += t3 - t2
            audio_s += len(audio) / 16000
            results.append({
                "name": name, "speakers": speakers, "found": len(estimated.speakers),
                "der": der(truth, estimated.turns),
                "der_no_collar": der(truth, estimated.turns, 0.0),
                "der_told": der(truth, told.turns),
                "der_told_no_collar": der(truth, told.turns, 0.0)})
            print(f"  {name}: {speakers} speakers, found {len(estimated.speakers)}, "
                  f"DER {results[-1]['der']:.3f} (told {results[-1]['der_told']:.3f})",
                  flush=True)
    rows, groups = [], {}
    def kind(result: dict) -> str:
        return str(result["name"]).rsplit("-", 1)[0]

    short = [r for r in results if not kind(r).startswith("long")]
    for result in sorted(short, key=lambda r: r["speakers"]):
        groups.setdefault(str(result["speakers"]), []).append(result)
    conversations = [r for r in short if r["speakers"] > 1]
    groups["all"] = conversations  # the targets are these; monologues and long ones beside
    for name in ("long", "long-monologue"):
        if found := [r for r in results if kind(r) == name]:
            groups[name] = found
    summary = {}
    for key, group in groups.items():
        def mean(field: str, group: list[dict] = group) -> float:
            return round(sum(r[field] for r in group) / len(group), 4)
        right = sum(r["found"] == r["speakers"] for r in group) / len(group)
        summary[key] = {"conversations": len(group), "count_right": round(right, 3),
                        **{f: mean(f) for f in ("der", "der_no_collar", "der_told",
                                                "der_told_no_collar")}}
        rows.append([key, len(group), f"{right:.0%}", mean("der"), mean("der_no_collar"),
                     mean("der_told"), mean("der_told_no_collar")])
    nan = {"count_right": float("nan")}
    total, alone = summary["all"], summary.get("1", nan)
    long, long_alone = summary.get("long", nan), summary.get("long-monologue", nan)
    ratio, told_ratio = diarize_s / transcribe_s, told_s / transcribe_s
    bc.table(f"Diarization: {len(conversations)} conversations, "
             f"{len(short) - len(conversations)} monologues, {len(results) - len(short)} long "
             f"recordings ({LONG_LINES} lines), {audio_s:.0f} s of audio; diarizer load "
             f"{load[0]:.2f} s; diarize/transcribe {ratio:.2f} "
             f"({diarize_s:.1f} s / {transcribe_s:.1f} s), told {told_ratio:.2f}",
             ["speakers", "recordings", "count right", "DER", "DER, no collar",
              "DER told", "DER told, no collar"], rows)
    verdicts = [["count right", total["count_right"], COUNT_TARGET,
                 bc.verdict(total["count_right"], COUNT_TARGET, at_most=False)],
                ["DER, estimated", total["der"], DER_TARGET,
                 bc.verdict(total["der"], DER_TARGET, at_most=True)],
                ["DER, num_speakers", total["der_told"], DER_KNOWN_TARGET,
                 bc.verdict(total["der_told"], DER_KNOWN_TARGET, at_most=True)],
                *[[f"count right, {name}", group["count_right"], COUNT_TARGET,
                   bc.verdict(group["count_right"], COUNT_TARGET, at_most=False)]
                  for name, group in (("monologues", alone), ("long conversations", long),
                                      ("long monologues", long_alone))],
                ["diarize/transcribe", round(ratio, 3), COST_TARGET,
                 bc.verdict(ratio, COST_TARGET, at_most=True)],
                ["diarize/transcribe, num_speakers", round(told_ratio, 3), COST_TARGET,
                 bc.verdict(told_ratio, COST_TARGET, at_most=True)]]
    bc.table("Targets", ["measure", "value", "target", "verdict"], verdicts)
    # one file per set, so a run on another set leaves the bench's own numbers alone
    name = ("diarization-real-voices" if args.real_voices else
            "diarization-untuned-voices" if args.untuned_voices else "diarization")
    bc.write_json(name, {
        "seed": seed, "untuned_voices": args.untuned_voices, "real_voices": args.real_voices,
        "audio_seconds": audio_s, "diarizer_load_s": load[0], "transcribe_s": transcribe_s,
        "diarize_s": diarize_s, "diarize_over_transcribe": ratio, "told_s": told_s,
        "told_over_transcribe": told_ratio, "by_speakers": summary, "conversations": results,
    }, started)


if __name__ == "__main__":
    bc.run(main)
