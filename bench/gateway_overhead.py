"""1. Gateway overhead: the same audio, model and settings through the gateway vs the engine
called directly in this process.

Three ways to transcribe one file, interleaved repetition by repetition (so a change in
the machine's background load hits all three alike), in a rotating order:

- direct: `workers.execute.run_engine` with the worker's own engine class and defaults
  (decode with common.audio.decode_audio, then faster-whisper), on the bytes in memory;
- openai: POST /v1/audio/transcriptions, which queues the task and waits for it via
  Redis pub/sub (upload, probe, submit, worker dispatch, run, result, reply);
- sage: POST /api/faster-whisper-submit, then GET /api/status every --poll-ms.

Target: median(openai) / median(direct) <= 1.05 on jfk.flac with tiny.en on CPU. The
Sage ratio is reported too; it includes the poll interval (on average half of it).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import time  # noqa: E402

import httpx  # noqa: E402

from bench import common as bc  # noqa: E402

NAME = "gateway_overhead"
TARGET = 1.05
MODES = ("direct", "openai", "sage")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20, help="measured repetitions of each mode")
    parser.add_argument("--audio", type=Path, default=bc.JFK)
    parser.add_argument("--poll-ms", type=float, default=10.0, help="Sage status poll interval")
    parser.add_argument("--budget", type=float, default=200.0, help="seconds of measuring")
    args = parser.parse_args()
    started = bc.machine()
    budget = bc.Budget(args.budget)
    audio = args.audio.read_bytes()
    seconds = bc.duration(args.audio)
    direct = bc.Direct()
    wall: dict[str, list[float]] = {mode: [] for mode in MODES}
    worker_run: dict[str, list[float]] = {"openai": [], "sage": []}
    dispatch: dict[str, list[float]] = {"openai": [], "sage": []}
    texts: dict[str, set[str]] = {mode: set() for mode in MODES}

    with bc.Stack(NAME) as stack, httpx.Client() as client:
        base = stack.url

        def run_direct() -> tuple[float, str | None]:
            start = time.perf_counter()
            result = direct.transcribe(audio)
            elapsed = time.perf_counter() - start
            texts["direct"].add(result["text"])
            return elapsed, None

        def run_openai() -> tuple[float, str | None]:
            start = time.perf_counter()
            reply = client.post(f"{base}/v1/audio/transcriptions",
                                files={"file": (args.audio.name, audio)},
                                data={"model": "whisper-1", "response_format": "json"},
                                timeout=300)
            elapsed = time.perf_counter() - start
            reply.raise_for_status()
            texts["openai"].add(reply.json()["text"])
            return elapsed, reply.headers["x-task-id"]

        def run_sage() -> tuple[float, str | None]:
            start = time.perf_counter()
            task_id = bc.sage_submit(client, base, audio, args.audio.name)
            final = bc.sage_wait(client, base, task_id, interval=args.poll_ms / 1000)
            elapsed = time.perf_counter() - start
            texts["sage"].add(final["result"]["text"])
            return elapsed, task_id

        runners = {"direct": run_direct, "openai": run_openai, "sage": run_sage}
        for _ in range(2):  # warm-up: the worker loads its model on its first task
            for mode in MODES:
                runners[mode]()
        reps = 0
        for rep in range(args.reps):
            if budget.expired():
                print(f"budget of {args.budget:.0f} s spent after {rep} repetitions", flush=True)
                break
            order = MODES[rep % 3:] + MODES[:rep % 3]
            for mode in order:
                elapsed, task_id = runners[mode]()
                wall[mode].append(elapsed)
                if task_id is not None:
                    view = bc.task_view(client, base, task_id)
                    worker_run[mode].append(view["finished_at"] - view["started_at"])
                    dispatch[mode].append(view["started_at"] - view["created_at"])
            reps += 1
    direct.close()

    base_median = bc.median(wall["direct"])
    rows, modes_out = [], {}
    for mode in MODES:
        median = bc.median(wall[mode])
        ratio = median / base_median
        paired = bc.median([m / d for m, d in zip(wall[mode], wall["direct"], strict=True)])
        run_median = bc.median(worker_run[mode]) if mode in worker_run else None
        rows.append([mode, reps, median * 1000, bc.percentile(wall[mode], 10) * 1000,
                     bc.percentile(wall[mode], 90) * 1000, ratio, paired,
                     None if run_median is None else run_median * 1000,
                     None if mode == "direct" else (median - base_median) * 1000])
        modes_out[mode] = {"wall_ms": bc.summary(wall[mode], 1000), "ratio_of_medians": ratio,
                           "median_paired_ratio": paired,
                           "worker_run_ms": bc.summary(worker_run.get(mode, []), 1000),
                           "queue_dispatch_ms": bc.summary(dispatch.get(mode, []), 1000),
                           "distinct_texts": sorted(texts[mode])}
    bc.table(f"gateway overhead: {args.audio.name} ({seconds:.1f} s), tiny.en, "
             f"{direct.device}, {reps} reps (ms)",
             ["mode", "n", "p50", "p10", "p90", "ratio", "paired", "worker run p50",
              "overhead p50"], rows)
    ratio = modes_out["openai"]["ratio_of_medians"]
    same = texts["direct"] == texts["openai"] == texts["sage"]
    print(f"median end-to-end ratio (openai / direct): {ratio:.3f}  "
          f"target <= {TARGET}: {bc.verdict(ratio, TARGET, at_most=True)}")
    print(f"sage (submit + poll every {args.poll_ms:.0f} ms) / direct: "
          f"{modes_out['sage']['ratio_of_medians']:.3f}")
    print(f"same transcript on every path: {same}")
    bc.write_json(NAME, {
        "audio": args.audio.name, "audio_seconds": seconds, "model": "tiny.en",
        "device": direct.device, "reps": reps, "poll_ms": args.poll_ms, "modes": modes_out,
        "ratio": ratio, "target": TARGET, "target_met": ratio <= TARGET,
        "same_transcript": same}, started)


if __name__ == "__main__":
    bc.run(main)
