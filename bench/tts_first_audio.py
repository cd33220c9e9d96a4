"""9. TTS first audio: time to the first streamed audio byte vs whole-file synthesis.

One gateway and one XTTS worker (.venvs/xtts; the tiny checkpoint of
scripts/make_tiny_models.py unless --model names a real XTTS v2 directory), model preloaded.
For texts of 3, 6 and 12 sentences, alternately:

- streamed: `POST /v1/audio/speech` with `stream_format=audio`, `response_format=pcm`:
  seconds from sending the request to the first body byte, and to the last;
- whole: the same request without `stream_format` (`response_format=wav`): seconds to the
  whole reply.

The ratio first byte / whole says how much sooner a listener hears something; it should
fall roughly as 1 / sentences (the first sentence is spoken, stored and sent while the others
are still being synthesized). Seeded sampling makes both requests speak the same audio.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402

from bench import common as bc  # noqa: E402
from bench.rtf import tiny_model  # noqa: E402

NAME = "tts_first_audio"
XTTS_PYTHON = bc.ROOT / ".venvs" / "xtts" / "bin" / "python"
SENTENCES = ["The first sentence is here.", "A second one follows it.",
             "Then comes a third sentence.", "The fourth one is next.",
             "A fifth is in the middle.", "The sixth one is short.",
             "Here is the seventh sentence.", "An eighth one comes after.",
             "The ninth is nearly done.", "A tenth keeps it going.",
             "The eleventh is the last but one.", "And the twelfth ends it."]
SIZES = (3, 6, 12)


def streamed(client: httpx.Client, url: str, text: str) -> tuple[float, float, int]:
    """(seconds to the first body byte, to the last, bytes)."""
    body = {"model": "tts-1", "input": text, "voice": "alloy", "response_format": "pcm",
            "stream_format": "audio"}
    start = time.perf_counter()
    first, size = 0.0, 0
    with client.stream("POST", f"{url}/v1/audio/speech", json=body) as reply:
        reply.raise_for_status()
        for data in reply.iter_raw():
            if data and not size:
                first = time.perf_counter() - start
            size += len(data)
    return first, time.perf_counter() - start, size


def whole(client: httpx.Client, url: str, text: str) -> tuple[float, int]:
    body = {"model": "tts-1", "input": text, "voice": "alloy", "response_format": "wav"}
    start = time.perf_counter()
    reply = client.post(f"{url}/v1/audio/speech", json=body)
    reply.raise_for_status()
    return time.perf_counter() - start, len(reply.content)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, help="an XTTS v2 model directory (default: the "
                                                   "tiny random checkpoint)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--budget", type=float, default=240.0)
    args = parser.parse_args()
    started = bc.machine()
    budget = bc.Budget(args.budget)
    model, why = (args.model, "") if args.model else tiny_model("xtts", 120)
    if model is None or not XTTS_PYTHON.exists():
        why = why or ".venvs/xtts is missing: run scripts/install.sh xtts"
        print(f"skipped: {why}")
        bc.write_json(NAME, {"skipped": why}, started)
        return
    models = {"xtts": {"bench": str(model)}}
    cases: dict[str, Any] = {}
    with bc.Stack(NAME, workers=0, backend="xtts", python=XTTS_PYTHON, models=models,
                  gateway_settings={"voices": {"alloy": "speaker:Claribel Dervla"}},
                  worker_settings={"device": args.device, "preload": "true"}) as stack, \
            httpx.Client(timeout=600) as client:
        stack.add_worker()
        whole(client, stack.url, SENTENCES[0])  # warm: first-call costs out of the numbers
        for size in SIZES:
            text = " ".join(SENTENCES[:size])
            runs: list[dict[str, float]] = []
            for _ in range(args.reps):
                if runs and budget.left() < 3 * runs[-1]["whole_s"] + 20:
                    break
                first, last, pcm_bytes = streamed(client, stack.url, text)
                whole_s, wav_bytes = whole(client, stack.url, text)
                runs.append({"first_byte_s": first, "stream_end_s": last, "whole_s": whole_s,
                             "audio_s": pcm_bytes / 2 / 24000,
                             "same_length": wav_bytes - 44 == pcm_bytes})
                print(f"{size} sentences: {runs[-1]}", flush=True)
            if not runs:
                break
            first_p50 = bc.median([r["first_byte_s"] for r in runs])
            whole_p50 = bc.median([r["whole_s"] for r in runs])
            cases[f"{size} sentences"] = {
                "runs": runs, "first_byte_s": bc.summary([r["first_byte_s"] for r in runs]),
                "stream_end_s": bc.summary([r["stream_end_s"] for r in runs]),
                "whole_s": bc.summary([r["whole_s"] for r in runs]),
                "ratio": round(first_p50 / whole_p50, 3) if whole_p50 else None}
    bc.table(f"TTS first audio ({'tiny checkpoint' if not args.model else model}, "
             f"{args.device}; medians, seconds)",
             ["text", "runs", "first byte", "stream end", "whole file", "first/whole"],
             [[name, len(c["runs"]), c["first_byte_s"]["p50"], c["stream_end_s"]["p50"],
               c["whole_s"]["p50"], c["ratio"]] for name, c in cases.items()])
    bc.write_json(NAME, {"model": "tiny" if not args.model else str(model),
                         "device": args.device, "cases": cases}, started)


if __name__ == "__main__":
    bc.run(main)
