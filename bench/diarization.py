"""8. Speaker diarization: DER on the two-voice espeak-ng conversation, and its cost.

In-process, with the worker's own code paths: faster-whisper (bundled tiny.en, word
timestamps on, as a diarized task runs it) transcribes harness/conversation.py's
conversation (en-us+m3 and en-us+f4, six alternating turns, ~25 s), then the bundled
diarizer (workers/diarize.py: silero-vad + Resemblyzer + agglomerative clustering) finds
the turns, with num_speakers=2 and with the count estimated. Per case: the speakers found,
the DER against the conversation's reference turns (0.25 s collar; target <= 0.15), how many
transcript segments got their turn's voice, and diarization time / transcription time
(median of --reps runs after one warm-up). Finishes in well under a minute.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from bench import common as bc  # noqa: E402
from common.audio import decode_audio  # noqa: E402
from common.schemas import DiarizationOptions, TranscriptionOptions  # noqa: E402
from common.settings import Settings  # noqa: E402
from harness import conversation  # noqa: E402
from workers.diarize import Diarizer, Turn, attach, der  # noqa: E402
from workers.engines.base import ModelRef  # noqa: E402
from workers.engines.faster_whisper import FasterWhisperEngine  # noqa: E402

DER_TARGET = 0.15


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    started = bc.machine()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "conversation.wav"
        reference = conversation.build(path)
        audio = decode_audio(path, 16000)
    truth = [Turn(t.start, t.end, t.speaker) for t in reference]
    engine = FasterWhisperEngine(Settings(_env_file=None))  # type: ignore[call-arg]
    model = engine.load(ModelRef("tiny.en", "bundled"), "cpu")
    diarizer = Diarizer()
    with bc.timed() as load:
        handle = diarizer.load()
    options = TranscriptionOptions(language="en", word_timestamps=True)
    rows, cases = [], {}
    for case, asked in (("num_speakers=2", DiarizationOptions(num_speakers=2)),
                        ("estimated", DiarizationOptions())):
        transcribe_s, diarize_s = [], []
        for rep in range(args.reps + 1):  # the first is a warm-up
            t0 = time.perf_counter()
            transcription = engine.transcribe(model, audio, options, lambda _: None)
            t1 = time.perf_counter()
            found = diarizer.diarize(handle, audio, asked)
            t2 = time.perf_counter()
            if rep:
                transcribe_s.append(t1 - t0)
                diarize_s.append(t2 - t1)
        attach(transcription, found)
        mapping: dict[str, set[str]] = {}
        for segment in transcription.segments:
            voice = max(reference, key=lambda t: min(segment.end, t.end)
                        - max(segment.start, t.start)).speaker
            mapping.setdefault(segment.speaker or "", set()).add(voice)
        right = sum(1 for segment in transcription.segments
                    if len(mapping[segment.speaker or ""]) == 1)
        error = der(truth, found.turns)
        strict = der(truth, found.turns, collar=0.0)
        ratio = bc.median(diarize_s) / bc.median(transcribe_s)
        cases[case] = {"speakers": found.speakers, "der": round(error, 4),
                       "der_no_collar": round(strict, 4),
                       "segments": len(transcription.segments), "segments_right": right,
                       "transcribe_s": bc.summary(transcribe_s),
                       "diarize_s": bc.summary(diarize_s), "diarize_over_transcribe": ratio}
        rows.append([case, len(found.speakers), round(error, 4),
                     bc.verdict(error, DER_TARGET, at_most=True), round(strict, 4),
                     f"{right}/{len(transcription.segments)}",
                     bc.median(transcribe_s), bc.median(diarize_s), ratio])
    seconds = len(audio) / 16000
    bc.table(f"Diarization: {seconds:.1f} s, {len(reference)} turns, 2 espeak voices; "
             f"diarizer load {load[0]:.2f} s",
             ["case", "speakers", "DER", f"<= {DER_TARGET}", "DER, no collar", "segments right",
              "transcribe s", "diarize s", "diarize/transcribe"], rows)
    bc.write_json("diarization", {"audio_seconds": seconds, "turns": len(reference),
                                  "diarizer_load_s": load[0], "cases": cases}, started)


if __name__ == "__main__":
    bc.run(main)
