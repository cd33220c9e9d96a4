"""1. Gateway overhead: the same audio, model and settings through the gateway vs the engine
called directly in this process.

Four ways to transcribe one file, interleaved repetition by repetition (so a change in
the machine's background load hits all alike), in a rotating order:

- bare: faster-whisper alone in a process of its own with OpenMP's default wait policy, as
  its users run it (bench.common.Bare: WhisperModel, decode_audio, transcribe);
- direct: `workers.execute.run_engine` with the worker's own engine class and defaults
  (decode with common.audio.decode_audio, then faster-whisper), on the bytes in memory, in
  this process, with OMP_WAIT_POLICY=PASSIVE (what workers that share a host run; the
  stack's one worker, alone as in the default stack, keeps the library's own policy:
  workers/openmp.py);
- openai: POST /v1/audio/transcriptions, which queues the task and waits for it via
  Redis pub/sub (upload, probe, submit, worker dispatch, run, result, reply);
- sage: POST /api/faster-whisper-submit, then GET /api/status every --poll-ms, over one
  raw keep-alive socket (bench.common.StatusPoller): Sage polls from its own host, so the
  poll's client CPU must not slow the engine here; httpx's cost a poll is printed beside.
  The gateway paces a RUNNING task's polls (SPEECH_POLL_PACE_SECONDS, 50 ms by default:
  common/store/running_polls.py), so a poll every 10 ms is answered every ~50 ms;
- sage_unpaced (no target): the same through a second gateway process on the same Redis and
  worker with the pace off (SPEECH_POLL_PACE_SECONDS=0), every poll answered at once: what
  the pace saves. Both Sage modes print their polls a task;
- openai_polled (no target): the openai call while another socket polls a finished task
  every --poll-ms: what the same rate of polls costs the engine on these cores when the
  polls are not the caller's own. A finished task's poll reads Redis every time, where the
  sage mode's polls of its RUNNING task are mostly answered from the gateway's kept reply
  (common/store/running_polls.py), so the two modes' worker runs also show what keeping
  saves.

Targets (median of each mode ÷ median of bare, jfk.flac, tiny.en on CPU): openai <= 1.02,
sage <= 1.05 (a poll the pace holds ends at the terminal message, so the end is
seen at once; one between polls, within the client's interval).

Then OMP_WAIT_POLICY both ways (`--omp-seconds`, 0 = skip), bare processes only: one
stream's latency (PASSIVE and default interleaved, --omp-reps each), and throughput with
three busy processes sharing the cores (each transcribing in a loop for --omp-seconds),
under each policy in turn.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import functools  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402

from bench import common as bc  # noqa: E402

NAME = "gateway_overhead"
TARGETS = {"openai": 1.02, "sage": 1.05}  # ÷ bare
MODES = ("bare", "direct", "openai", "sage", "sage_unpaced", "openai_polled")
BUSY = 3  # processes sharing the cores in the throughput case


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=20, help="measured repetitions of each mode")
    parser.add_argument("--audio", type=Path, default=bc.JFK)
    parser.add_argument("--poll-ms", type=float, default=10.0, help="Sage status poll interval")
    parser.add_argument("--budget", type=float, default=200.0, help="seconds of measuring")
    parser.add_argument("--omp-reps", type=int, default=6, help="single-stream reps per policy")
    parser.add_argument("--omp-seconds", type=float, default=20.0,
                        help="throughput run per policy (0: skip the OMP_WAIT_POLICY part)")
    args = parser.parse_args()
    started = bc.machine()
    budget = bc.Budget(args.budget)
    audio = args.audio.read_bytes()
    seconds = bc.duration(args.audio)
    direct = bc.Direct()
    bare = bc.Bare()
    wall: dict[str, list[float]] = {mode: [] for mode in MODES}
    # the modes through the gateway: their task records give the worker's run and dispatch
    worker_run: dict[str, list[float]] = {mode: [] for mode in MODES[2:]}
    dispatch: dict[str, list[float]] = {mode: [] for mode in MODES[2:]}
    texts: dict[str, set[str]] = {mode: set() for mode in MODES}
    polls: dict[str, list[int]] = {"sage": [], "sage_unpaced": []}

    with bc.Stack(NAME) as stack, httpx.Client() as client:
        base = stack.url
        unpaced = stack.add_gateway(poll_pace_seconds=0)
        pollers = {"sage": bc.StatusPoller(base), "sage_unpaced": bc.StatusPoller(unpaced.url)}
        other_poller = bc.StatusPoller(base)
        sage_ids: list[str] = []

        def run_direct() -> tuple[float, str | None]:
            start = time.perf_counter()
            result = direct.transcribe(audio)
            elapsed = time.perf_counter() - start
            texts["direct"].add(result["text"])
            return elapsed, None

        def run_openai(mode: str = "openai") -> tuple[float, str | None]:
            start = time.perf_counter()
            reply = client.post(f"{base}/v1/audio/transcriptions",
                                files={"file": (args.audio.name, audio)},
                                data={"model": "whisper-1", "response_format": "json"},
                                timeout=300)
            elapsed = time.perf_counter() - start
            reply.raise_for_status()
            texts[mode].add(reply.json()["text"])
            return elapsed, reply.headers["x-task-id"]

        def run_sage(mode: str = "sage") -> tuple[float, str | None]:
            poller = pollers[mode]
            start = time.perf_counter()
            task_id = bc.sage_submit(client, poller.base, audio, args.audio.name)
            sent = poller.sent
            final = poller.wait(task_id, interval=args.poll_ms / 1000)
            elapsed = time.perf_counter() - start
            polls[mode].append(poller.sent - sent)
            texts[mode].add(final["result"]["text"])
            sage_ids.append(task_id)
            return elapsed, task_id

        def run_openai_polled() -> tuple[float, str | None]:
            polling = threading.Event()
            thread = threading.Thread(target=poll_other, args=(polling,))
            polling.set()
            thread.start()
            try:
                return run_openai("openai_polled")
            finally:
                polling.clear()
                thread.join()

        def poll_other(polling: threading.Event) -> None:
            while polling.is_set():
                other_poller.status(sage_ids[0])
                time.sleep(args.poll_ms / 1000)

        def run_bare() -> tuple[float, str | None]:
            done = bare.transcribe(args.audio)
            texts["bare"].add(done["text"])
            return done["seconds"], None

        runners = {"bare": run_bare, "direct": run_direct, "openai": run_openai,
                   "sage": run_sage, "sage_unpaced": functools.partial(run_sage, "sage_unpaced"),
                   "openai_polled": run_openai_polled}
        for _ in range(2):  # warm-up: the worker loads its model on its first task
            for mode in MODES:
                runners[mode]()
        reps = 0
        for rep in range(args.reps):
            if budget.expired():
                print(f"budget of {args.budget:.0f} s spent after {rep} repetitions", flush=True)
                break
            order = MODES[rep % len(MODES):] + MODES[:rep % len(MODES)]
            for mode in order:
                elapsed, task_id = runners[mode]()
                wall[mode].append(elapsed)
                if task_id is not None:
                    view = bc.task_view(client, base, task_id)
                    worker_run[mode].append(view["finished_at"] - view["started_at"])
                    dispatch[mode].append(view["started_at"] - view["created_at"])
            reps += 1
        poll_cpu = client_cpu_per_poll(client, pollers["sage"], base, sage_ids[-1])
        for poller in (*pollers.values(), other_poller):
            poller.close()
    direct.close()
    bare.close()
    omp = omp_policies(args.audio, args.omp_reps, args.omp_seconds) if args.omp_seconds else {}

    base_median = bc.median(wall["bare"])
    rows, modes_out = [], {}
    for mode in MODES:
        median = bc.median(wall[mode])
        ratio = median / base_median
        paired = bc.median([m / d for m, d in zip(wall[mode], wall["bare"], strict=True)])
        run_median = bc.median(worker_run[mode]) if mode in worker_run else None
        rows.append([mode, reps, median * 1000, bc.percentile(wall[mode], 10) * 1000,
                     bc.percentile(wall[mode], 90) * 1000, ratio, paired,
                     None if run_median is None else run_median * 1000,
                     None if mode == "bare" else (median - base_median) * 1000])
        modes_out[mode] = {"wall_ms": bc.summary(wall[mode], 1000), "ratio_of_medians": ratio,
                           "median_paired_ratio": paired,
                           "ratio_interval_90": bc.ratio_interval(wall[mode], wall["bare"]),
                           "worker_run_ms": bc.summary(worker_run.get(mode, []), 1000),
                           "queue_dispatch_ms": bc.summary(dispatch.get(mode, []), 1000),
                           "distinct_texts": sorted(texts[mode])}
    bc.table(f"gateway overhead: {args.audio.name} ({seconds:.1f} s), tiny.en, "
             f"{direct.device}, {reps} reps (ms)",
             ["mode", "n", "p50", "p10", "p90", "ratio", "paired", "worker run p50",
              "overhead p50"], rows)
    same = len(set().union(*texts.values())) == 1
    verdicts = {mode: bc.verdict(modes_out[mode]["ratio_of_medians"], target, at_most=True)
                for mode, target in TARGETS.items()}
    for mode, verdict in verdicts.items():
        low, high = modes_out[mode]["ratio_interval_90"]
        print(f"{mode} ÷ bare faster-whisper (default OpenMP policy), median: {verdict}; "
              f"90 % bootstrap interval {low:.3f}-{high:.3f}")
    print(f"direct (in-process, PASSIVE) ÷ bare: {modes_out['direct']['ratio_of_medians']:.3f}")
    polled_run = modes_out["openai_polled"]["worker_run_ms"].get("p50")
    openai_run = modes_out["openai"]["worker_run_ms"].get("p50")
    if polled_run and openai_run:
        print(f"the worker's run while another task is polled every {args.poll_ms:g} ms ÷ "
              f"without: {polled_run / openai_run:.3f} (what those polls cost the engine here)")
    for mode, counts in polls.items():
        print(f"{mode}: polls a task p50 {bc.median(counts):.0f} (min {min(counts)}, "
              f"max {max(counts)})")
    print(f"same transcript on every path: {same}")
    print("client CPU a status poll (ms): " + ", ".join(f"{name} {ms:.3f}"
                                                      for name, ms in poll_cpu.items()))
    if omp:
        bc.table("OMP_WAIT_POLICY, bare faster-whisper processes", ["policy",
                 "one stream p50 ms", "one stream min ms", f"{BUSY} busy: tasks/s",
                 f"{BUSY} busy: p50 ms per task"],
                 [[policy, r["single_ms"]["p50"], r["single_ms"]["min"], r["busy_tasks_per_s"],
                   r["busy_ms"]["p50"]] for policy, r in omp.items()])
    bc.write_json(NAME, {
        "audio": args.audio.name, "audio_seconds": seconds, "model": "tiny.en",
        "device": direct.device, "reps": reps, "poll_ms": args.poll_ms, "modes": modes_out,
        "poll_client_cpu_ms": poll_cpu, "polls_a_task": polls, "targets": TARGETS,
        "verdicts": verdicts,
        "omp_wait_policy": omp,
        "target_met": all(v.startswith("MET") for v in verdicts.values()),
        "same_transcript": same}, started)


def client_cpu_per_poll(client: httpx.Client, poller: bc.StatusPoller, base: str,
                        task_id: str, polls: int = 200) -> dict[str, float]:
    """This process's CPU a poll of a finished task: the bench's raw poller vs httpx."""
    ways = {"raw socket": lambda: poller.status(task_id),
            "httpx": lambda: client.get(f"{base}/api/status", params={"taskid": task_id})}
    found = {}
    for name, poll in ways.items():
        start = time.process_time()
        for _ in range(polls):
            poll()
        found[name] = (time.process_time() - start) * 1000 / polls
    return found


def omp_policies(audio: Path, reps: int, seconds: float) -> dict[str, dict[str, Any]]:
    """One stream's latency under each policy (interleaved), then BUSY processes of one
    policy transcribing in a loop for `seconds` (each policy in turn)."""
    found: dict[str, dict[str, Any]] = {}
    single: dict[str, list[float]] = {"PASSIVE": [], "default": []}
    streams = {policy: bc.Bare("" if policy == "default" else policy) for policy in single}
    try:
        for stream in streams.values():
            stream.transcribe(audio)  # warm-up
        for _ in range(reps):
            for policy, stream in streams.items():
                single[policy].append(stream.transcribe(audio)["seconds"])
    finally:
        for stream in streams.values():
            stream.close()
    for policy in single:
        busy = [bc.Bare("" if policy == "default" else policy) for _ in range(BUSY)]
        try:
            for process in busy:
                process.transcribe(audio)  # warm-up, one at a time
            durations: list[float] = []
            start = time.monotonic()
            until = start + seconds
            bc.parallel([functools.partial(_loop, process, audio, until, durations)
                         for process in busy])
            wall = time.monotonic() - start
        finally:
            for process in busy:
                process.close()
        found[policy] = {"single_ms": bc.summary(single[policy], 1000),
                         "busy_tasks_per_s": round(len(durations) / wall, 3),
                         "busy_ms": bc.summary(durations, 1000), "busy_tasks": len(durations)}
        print(f"OMP_WAIT_POLICY {policy}: one stream p50 "
              f"{found[policy]['single_ms']['p50']:.0f} ms; {BUSY} busy: "
              f"{found[policy]['busy_tasks_per_s']:.2f} tasks/s", flush=True)
    return found


def _loop(process: bc.Bare, audio: Path, until: float, durations: list[float]) -> None:
    while time.monotonic() < until:
        durations.append(process.transcribe(audio)["seconds"])


if __name__ == "__main__":
    bc.run(main)
