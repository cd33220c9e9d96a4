"""7. CPU-seconds per task through the service vs direct, and throughput under concurrency.

Every service measurement is paired with a direct one taken just before it (the machine's
background load drifts; pairs see the same load), --rounds times; the ratios reported
are medians over the rounds. Audio: jfk.flac; model: tiny.en; clients send their next
task when the previous one returned (closed loop), via POST /v1/audio/transcriptions.

- direct: --direct-tasks sequential calls in this process (bench.common.Direct: the
  worker's engine class and code path); CPU = this process's user + system time.
- CPU per task: one client, one worker; CPU = the sum of the gateway's, the worker's
  and Redis's user + system time (psutil, idle loops included; the client's own CPU is
  not counted) ÷ tasks. Target: service / direct <= 1.05.
- throughput: tasks/s of 2 and 4 concurrent clients ÷ tasks/s of the direct sequential
  calls, with one worker (target >= 1.0) and with two worker replicas (target >= 1.5 on
  two cores); shown too, not judged: two replicas with SPEECH_CPU_THREADS=1 each (by
  default each CTranslate2 replica takes every core).
Diagnostic (1 worker, 1 client rounds): the direct batch again with the worker's
after-call `workers.memory.release()` (gc.collect + malloc_trim) after every call.
A configuration that does not fit in what is left of --budget is skipped (and says so).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402

from bench import common as bc  # noqa: E402

NAME = "cpu_per_task"
TARGET_CPU = 1.05
TARGET_ONE_WORKER = 1.0
TARGET_TWO_REPLICAS = 1.5
#: (label, worker replicas, SPEECH_CPU_THREADS or None, clients, target or None)
CONFIGS = (("1 worker, 1 client", 1, None, 1, None),
           ("1 worker, 2 clients", 1, None, 2, TARGET_ONE_WORKER),
           ("1 worker, 4 clients", 1, None, 4, TARGET_ONE_WORKER),
           ("2 workers, 2 clients", 2, None, 2, TARGET_TWO_REPLICAS),
           ("2 workers, 4 clients", 2, None, 4, TARGET_TWO_REPLICAS),
           ("2 workers (cpu_threads=1), 2 clients", 2, "1", 2, None),
           ("2 workers (cpu_threads=1), 4 clients", 2, "1", 4, None))


def direct_batch(direct: bc.Direct, audio: bytes, tasks: int,
                 release: bool = False) -> dict[str, float]:
    """`tasks` in-process calls; with `release`, each followed by what the worker runs after
    every engine call (workers.memory.release: gc.collect() + malloc_trim(0))."""
    from workers import memory

    release_s = 0.0
    cpu = time.process_time()
    start = time.perf_counter()
    for _ in range(tasks):
        direct.transcribe(audio)
        if release:
            mark = time.perf_counter()
            memory.release(False)
            release_s += time.perf_counter() - mark
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu
    return {"tasks": tasks, "wall_s": wall, "cpu_per_task_s": cpu / tasks,
            "tasks_per_s": tasks / wall, "release_wall_per_task_s": release_s / tasks}


def service_batch(stack: bc.Stack, audio: bytes, clients: int, tasks: int) -> dict[str, Any]:
    """`clients` closed-loop clients until `tasks` were sent; CPU of every stack process."""
    lock = threading.Lock()
    sent = 0
    latencies: list[float] = []

    def client_loop() -> None:
        nonlocal sent
        with httpx.Client() as client:
            while True:
                with lock:
                    if sent >= tasks:
                        return
                    sent += 1
                elapsed, _ = bc.transcribe(client, stack.url, audio, bc.JFK.name)
                with lock:
                    latencies.append(elapsed)

    pids = stack.pids()
    before = {name: bc.cpu_seconds(pid) for name, pid in pids.items()}
    start = time.perf_counter()
    bc.parallel([client_loop] * clients)
    wall = time.perf_counter() - start
    used = {name: (bc.cpu_seconds(pid) - before[name]) / tasks for name, pid in pids.items()}
    return {"tasks": tasks, "wall_s": wall, "tasks_per_s": tasks / wall,
            "cpu_per_task_s": sum(used.values()), "cpu_per_task_by_process_s": used,
            "latency_s": bc.summary(latencies)}


def set_workers(stack: bc.Stack, replicas: int, threads: str | None, audio: bytes) -> None:
    """Make the stack run `replicas` workers with `threads`, each with its model loaded."""
    wanted = threads or "0"
    current = [w for w in stack.workers if w.env.get("SPEECH_CPU_THREADS", "0") == wanted]
    if len(current) == replicas == len(stack.workers):
        return
    for running in list(stack.workers):
        stack.stop_worker(running)
    for _ in range(replicas):
        stack.add_worker(**({"cpu_threads": threads} if threads else {}))
    with httpx.Client() as client:  # one task per replica at once: each loads its model
        bc.parallel([lambda: bc.transcribe(client, stack.url, audio)] * replicas)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--direct-tasks", type=int, default=5)
    parser.add_argument("--tasks", type=int, default=8, help="service tasks per round")
    parser.add_argument("--budget", type=float, default=250.0)
    args = parser.parse_args()
    started = bc.machine()
    budget = bc.Budget(args.budget)
    audio = bc.JFK.read_bytes()
    direct = bc.Direct()
    direct.transcribe(audio)  # warm-up
    # what the worker holds in memory, so that gc.collect() below walks a similar heap
    import workers.http
    import workers.runtime  # noqa: F401

    results: dict[str, dict[str, Any]] = {}
    release_rounds: list[dict[str, Any]] = []
    with bc.Stack(NAME, workers=0) as stack:
        for label, replicas, threads, clients, target in CONFIGS:
            # a round: the direct batch plus the service batch at no better than direct speed
            round_s = (args.direct_tasks + args.tasks) / 0.8
            if budget.left() < args.rounds * round_s + 15:
                results[label] = {"skipped": f"{budget.left():.0f} s left of the budget"}
                print(f"{label}: skipped ({results[label]['skipped']})", flush=True)
                continue
            set_workers(stack, replicas, threads, audio)
            rounds = []
            for _ in range(args.rounds):
                base = direct_batch(direct, audio, args.direct_tasks)
                if replicas == clients == 1:  # diagnostic: the worker's per-task release
                    released = direct_batch(direct, audio, args.direct_tasks, release=True)
                    release_rounds.append({"plain": base, "release": released})
                service = service_batch(stack, audio, clients, args.tasks)
                rounds.append({"direct": base, "service": service,
                               "cpu_ratio": service["cpu_per_task_s"] / base["cpu_per_task_s"],
                               "throughput_ratio": service["tasks_per_s"] / base["tasks_per_s"]})
            result = {
                "replicas": replicas, "cpu_threads": threads or "default", "clients": clients,
                "target": target, "rounds": rounds,
                "direct_tasks_per_s": bc.median([r["direct"]["tasks_per_s"] for r in rounds]),
                "tasks_per_s": bc.median([r["service"]["tasks_per_s"] for r in rounds]),
                "direct_cpu_per_task_s": bc.median([r["direct"]["cpu_per_task_s"]
                                                    for r in rounds]),
                "cpu_per_task_s": bc.median([r["service"]["cpu_per_task_s"] for r in rounds]),
                "cpu_ratio": bc.median([r["cpu_ratio"] for r in rounds]),
                "throughput_ratio": bc.median([r["throughput_ratio"] for r in rounds])}
            results[label] = result
            print(f"{label}: throughput x{result['throughput_ratio']:.3f}, cpu "
                  f"x{result['cpu_ratio']:.3f}", flush=True)
    direct.close()

    rows = []
    for label, r in results.items():
        if "skipped" in r:
            rows.append([label] + [None] * 6 + [f"skipped: {r['skipped']}"])
            continue
        rows.append([label, r["direct_tasks_per_s"], r["tasks_per_s"], r["throughput_ratio"],
                     r["direct_cpu_per_task_s"], r["cpu_per_task_s"], r["cpu_ratio"],
                     "" if r["target"] is None else bc.verdict(r["throughput_ratio"],
                                                               r["target"], at_most=False)])
    bc.table(f"CPU per task and throughput vs direct in-process calls, jfk.flac, tiny.en, "
             f"medians of {args.rounds} paired rounds",
             ["configuration", "direct tasks/s", "tasks/s", "throughput ratio",
              "direct cpu s", "cpu s/task", "cpu ratio", "throughput target"], rows)
    single = results.get("1 worker, 1 client", {})
    cpu_ratio = single.get("cpu_ratio", float("nan"))
    if "rounds" in single:
        by_process = {name: bc.median([r["service"]["cpu_per_task_by_process_s"][name]
                                       for r in single["rounds"]])
                      for name in single["rounds"][0]["service"]["cpu_per_task_by_process_s"]}
        print("service CPU per task by process (s): "
              + ", ".join(f"{name} {used:.3f}" for name, used in by_process.items()))
    release: dict[str, float] = {}
    if release_rounds:
        release = {
            "plain_cpu_per_task_s": bc.median([r["plain"]["cpu_per_task_s"]
                                               for r in release_rounds]),
            "with_release_cpu_per_task_s": bc.median([r["release"]["cpu_per_task_s"]
                                                      for r in release_rounds]),
            "release_wall_per_task_s": bc.median([r["release"]["release_wall_per_task_s"]
                                                  for r in release_rounds])}
        print(f"diagnostic, in process: workers.memory.release() after each call takes "
              f"{release['release_wall_per_task_s'] * 1000:.0f} ms; CPU per task "
              f"{release['plain_cpu_per_task_s']:.3f} s -> "
              f"{release['with_release_cpu_per_task_s']:.3f} s with it")
    print(f"CPU-seconds per task, service / direct: {cpu_ratio:.3f}  target <= {TARGET_CPU}: "
          f"{bc.verdict(cpu_ratio, TARGET_CPU, at_most=True)}")
    targets = {"cpu_ratio": {"value": cpu_ratio, "target": TARGET_CPU,
                             "met": cpu_ratio <= TARGET_CPU}}
    for label, r in results.items():
        if r.get("target") is not None:
            targets[label] = {"value": r["throughput_ratio"], "target": r["target"],
                              "met": r["throughput_ratio"] >= r["target"]}
    bc.write_json(NAME, {"rounds": args.rounds, "direct_tasks": args.direct_tasks,
                         "tasks": args.tasks, "configs": results, "cpu_ratio": cpu_ratio,
                         "release_diagnostic": release,
                         "targets": targets}, started)


if __name__ == "__main__":
    bc.run(main)
