"""Run every benchmark in sequence, each in its own process, then print the headline numbers.

    .venvs/core/bin/python bench/run_all.py                  # all of them
    .venvs/core/bin/python bench/run_all.py rtf memory       # just these

Each script gets --timeout seconds (default 330): past that it is sent SIGTERM (it stops
every process it started and exits), then SIGKILL a minute later. The summary ends with
every target MISSED (or a script that failed), each on its own line, under a banner; the
exit code is the number of scripts that failed or timed out plus the number of targets
missed.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from bench import common as bc  # noqa: E402

SCRIPTS = ("gateway_overhead", "poll_cost", "dispatch_latency", "throughput", "rtf", "memory",
           "start_to_ready", "cpu_per_task", "diarization", "realtime",
           "tts_first_audio", "redis_wait")


def run_one(name: str, timeout: float) -> tuple[int, float]:
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, str(bc.ROOT / "bench" / f"{name}.py")],
                            cwd=bc.ROOT, start_new_session=True)
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        print(f"{name}: over {timeout:.0f} s, stopping it", flush=True)
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        code = 124
    except BaseException:
        proc.send_signal(signal.SIGTERM)  # Ctrl-C here: the script cleans up after itself
        proc.wait(60)
        raise
    return code, time.perf_counter() - start


def headline(name: str) -> list[str]:
    path = bc.RESULTS / f"{name}.json"
    if not path.exists():
        return ["no results"]
    data: dict[str, Any] = json.loads(path.read_text())
    ok = {True: "met", False: "MISSED"}
    if name == "gateway_overhead":
        lines = [f"{mode} / bare faster-whisper (default OpenMP policy), median: {verdict}"
                 for mode, verdict in data["verdicts"].items()]
        for policy, r in data.get("omp_wait_policy", {}).items():
            lines.append(f"OMP_WAIT_POLICY {policy}: one stream p50 {r['single_ms']['p50']:.0f}"
                         f" ms, 3 busy {r['busy_tasks_per_s']:.2f} tasks/s")
        return lines
    if name == "poll_cost":
        return [f"{line} (status / /health)" for line in data["verdicts"]]
    if name == "dispatch_latency":
        q = data["queue_dispatch_ms"]
        return [f"submit -> worker start p50 {q['p50']:.2f} ms, p99 {q['p99']:.2f} ms "
                f"(target p99 <= 10 ms: {ok[data['target_met']]})"]
    if name == "throughput":
        return [f"{case}: {r['rps']:.0f} req/s, p99 {r['latency_ms']['p99']:.1f} ms"
                for case, r in data["cases"].items()]
    if name == "rtf":
        return [f"{r['backend']} {r['audio']} {r['mode']}: "
                + (f"skipped ({r['skipped']})" if "skipped" in r else
                   f"e2e RTF {r['e2e_rtf']:.3f}, aggregate {r['aggregate_rtf']:.3f}")
                for r in data["cases"]]
    if name == "memory":
        return [f"worker peak / bare peak: jfk {data['peak_ratio']['11 s']:.3f} (target <= 1.3: "
                f"{ok[data['target_met']]}), 60 s {data['peak_ratio']['60 s']:.3f}",
                "RSS after idle unload / fresh worker: " + bc.verdict(
                    data["unload_ratio"], data["unload_target"], at_most=True)]
    if name == "start_to_ready":
        s = data["stats"]
        return [f"ready {s['ready_s']['p50']:.2f} s, first task {s['first_task_s']['p50']:.2f} s"
                f" (target <= 5 s: {ok[data['target_met']]})"]
    if name == "cpu_per_task":
        return [f"{label}: {t['value']:.3f} (target {t['target']}: {ok[t['met']]})"
                for label, t in data["targets"].items()]
    if name == "diarization":
        total = data["by_speakers"]["all"]
        return [f"count right {total['count_right']:.0%} (target >= 90 %: "
                f"{ok[total['count_right'] >= 0.9]}), DER {total['der']:.3f} (<= 0.10: "
                f"{ok[total['der'] <= 0.10]}), told {total['der_told']:.3f} (<= 0.05: "
                f"{ok[total['der_told'] <= 0.05]}), diarize/transcribe "
                f"{data['diarize_over_transcribe']:.2f}"]
    if name == "realtime":
        return [f"{mode}: end of turn -> completed p50 {m['end_to_completed']['p50']:.0f} ms, "
                f"p99 {m['end_to_completed']['p99']:.0f} ms" for mode, m in data["modes"].items()]
    if name == "tts_first_audio":
        if "skipped" in data:
            return [f"skipped ({data['skipped']})"]
        return [f"{case}: first byte {c['first_byte_s']['p50']:.2f} s, whole file "
                f"{c['whole_s']['p50']:.2f} s, ratio {c['ratio']:.3f}"
                for case, c in data["cases"].items()]
    return []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("scripts", nargs="*", metavar="NAME",
                        help=f"some of: {', '.join(SCRIPTS)} (default: all, in that order)")
    parser.add_argument("--timeout", type=float, default=330.0)
    args = parser.parse_args()
    unknown = set(args.scripts) - set(SCRIPTS)
    if unknown:
        parser.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
    args.scripts = args.scripts or list(SCRIPTS)
    outcomes = {}
    for name in args.scripts:
        print(f"=== {name}", flush=True)
        outcomes[name] = run_one(name, args.timeout)
    print("\n=== summary")
    failed, targets_missed, missed = 0, 0, []
    for name, (code, seconds) in outcomes.items():
        failed += code != 0
        status = "ok" if code == 0 else f"FAILED (exit {code})"
        print(f"{name} ({seconds:.0f} s, {status})")
        if code != 0:
            missed.append(f"{name}: the script FAILED (exit {code}): no numbers")
        for line in headline(name) if code == 0 else []:
            marked = "MISSED" in line
            print(f"  {'!!' if marked else '  '} {line}")
            if marked:
                targets_missed += 1
                missed.append(f"{name}: {line}")
    if missed:
        bar = "!" * 78
        print(f"\n{bar}\n!! {len(missed)} TARGET(S) MISSED OR NOT MEASURED\n{bar}")
        for line in missed:
            print(f"!! {line}")
        print(bar)
    else:
        print("\nevery target met")
    sys.exit(failed + targets_missed)


if __name__ == "__main__":
    bc.run(main)
