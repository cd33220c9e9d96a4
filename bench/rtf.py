"""4. Real-time factor per backend and per audio length, serial and with 2 concurrent tasks.

RTF = processing seconds / audio seconds (lower is faster; 0.1 = ten times real time).
Each backend runs --replicas worker processes behind one gateway; every task goes
through POST /v1/audio/transcriptions. Per case:

- serial: one task at a time (--reps of the 11 s and 60 s clips, one 10 min task);
  e2e RTF = median client latency / audio seconds, worker RTF = median
  (finished_at - started_at) / audio seconds (decode + inference + result write);
- 2 concurrent: two tasks submitted at once (one per replica when --replicas >= 2);
  aggregate RTF = wall time for both / total audio seconds, e2e = median per task.

Backends: faster-whisper (bundled tiny.en) always; qwen3, vibevoice (.venvs/hf) and
parakeet (.venvs/nemo) on the tiny checkpoints of scripts/make_tiny_models.py when their
environment exists. Those checkpoints are random or barely trained: their RTF shows the
pipeline's cost on this CPU, not the real models'. The 10 min case (multilingual.mp3
concatenated) runs for faster-whisper only, last. A case whose estimated time (from the
backend's RTF measured so far) does not fit in what is left of --budget is skipped, and
the table says so.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import os  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402

from bench import common as bc  # noqa: E402
from harness import procs  # noqa: E402

NAME = "rtf"
#: backend -> (environment, tiny model name for scripts/make_tiny_models.py)
OTHER_BACKENDS = {"qwen3": ("hf", "qwen3"), "vibevoice": ("hf", "vibevoice"),
                  "parakeet": ("nemo", "parakeet")}
MISSING_ENVIRONMENT = 3
STOP_RESERVE_SECONDS = 20.0  # stopping workers, gateway and Redis; writing results
SAFETY = 1.3
LONG = "long"  # estimates are scaled by this before comparing with the time left


def tiny_model(name: str, timeout: float) -> tuple[Path | None, str]:
    """(path of the tiny checkpoint, "") or (None, why it is unavailable). A checkpoint
    whose builder changed is rebuilt by make_tiny_models.py; past `timeout` that build is
    stopped (its whole process group) and the backend skipped."""
    proc = subprocess.Popen([sys.executable, str(bc.ROOT / "scripts" / "make_tiny_models.py"),
                             name], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        return None, (f"building the tiny {name} model takes over {timeout:.0f} s: run "
                      f"scripts/make_tiny_models.py {name} first")
    except BaseException:  # SIGTERM or Ctrl-C: the build goes too
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    if proc.returncode == MISSING_ENVIRONMENT:
        return None, err.strip().splitlines()[-1] if err.strip() else "no environment"
    if proc.returncode != 0 or not out.split():
        return None, f"make_tiny_models.py {name} failed: {err.strip()[-300:]}"
    return Path(out.split()[-1]), ""


class Runner:
    def __init__(self, stack: bc.Stack, client: httpx.Client, budget: bc.Budget) -> None:
        self.stack, self.client, self.budget = stack, client, budget
        self.rows: list[dict[str, Any]] = []
        self.rtf_estimate: dict[str, float] = {}

    def one(self, model: str, audio: bytes, name: str) -> dict[str, Any]:
        elapsed, task_id = bc.transcribe(self.client, self.stack.url, audio, name, model=model)
        view = bc.task_view(self.client, self.stack.url, task_id)
        return {"e2e": elapsed, "run": view["finished_at"] - view["started_at"],
                "worker": view["worker"]}

    def fits(self, backend: str, seconds: float, factor: float) -> tuple[bool, float]:
        estimate = self.rtf_estimate[backend] * seconds * factor * SAFETY
        return estimate < self.budget.left() - STOP_RESERVE_SECONDS, estimate

    def case(self, backend: str, model: str, label: str, path: Path, seconds: float,
             mode: str, reps: int) -> None:
        row: dict[str, Any] = {"backend": backend, "audio": label, "audio_seconds": seconds,
                               "mode": mode}
        factor = reps if mode == "serial" else 2  # worst case: no parallel speed-up
        ok, estimate = self.fits(backend, seconds, factor)
        if not ok:
            row["skipped"] = (f"estimated {estimate:.0f} s > {self.budget.left():.0f} s left "
                              "of the budget")
            print(f"{backend} {label} {mode}: skipped ({row['skipped']})", flush=True)
            self.rows.append(row)
            return
        audio = path.read_bytes()
        start = time.perf_counter()
        if mode == "serial":
            tasks = [self.one(model, audio, path.name) for _ in range(reps)]
        else:
            tasks = bc.parallel([lambda: self.one(model, audio, path.name)] * 2)
        wall = time.perf_counter() - start
        e2e = [t["e2e"] for t in tasks]
        run = [t["run"] for t in tasks]
        row.update(tasks=len(tasks), wall_s=round(wall, 3),
                   e2e_rtf=round(bc.median(e2e) / seconds, 4),
                   worker_rtf=round(bc.median(run) / seconds, 4),
                   aggregate_rtf=round(wall / (seconds * len(tasks)), 4),
                   workers_used=len({t["worker"] for t in tasks}),
                   e2e_s=[round(v, 3) for v in e2e], worker_run_s=[round(v, 3) for v in run])
        if mode == "serial":  # the latest (longest) serial RTF predicts the next cases
            self.rtf_estimate[backend] = row["e2e_rtf"]
        print(f"{backend} {label} {mode}: e2e RTF {row['e2e_rtf']:.3f}, aggregate "
              f"{row['aggregate_rtf']:.3f} ({wall:.1f} s)", flush=True)
        self.rows.append(row)

    def warm_up(self, backend: str, model: str) -> None:
        """One task per replica, all at once (each idle replica takes one and loads its
        model); the slowest one's RTF, load included, seeds the estimate."""
        seconds = bc.duration(bc.JFK)
        audio = bc.JFK.read_bytes()
        replicas = sum(1 for w in self.stack.workers if w.env["SPEECH_BACKEND"] == backend)
        first = bc.parallel([lambda: self.one(model, audio, bc.JFK.name)] * replicas)
        self.rtf_estimate[backend] = max(t["run"] for t in first) / seconds
        print(f"{backend}: warm-up done (first-task worker RTF "
              f"{self.rtf_estimate[backend]:.3f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=280.0, help="seconds for everything")
    parser.add_argument("--replicas", type=int, default=2, help="workers per backend")
    parser.add_argument("--reps", type=int, default=3, help="serial repetitions of 11 s/60 s")
    parser.add_argument("--long-seconds", type=float, default=600.0)
    parser.add_argument("--backends", default="faster-whisper,qwen3,vibevoice,parakeet")
    args = parser.parse_args()
    started = bc.machine()
    budget = bc.Budget(args.budget)
    wanted = args.backends.split(",")
    skipped_backends: dict[str, str] = {}
    models: dict[str, dict[str, str]] = {bc.FW: {"tiny.en": "bundled"}}
    for backend, (env, tiny) in OTHER_BACKENDS.items():
        if backend not in wanted:
            continue
        if not (bc.ROOT / ".venvs" / env / "bin" / "python").exists():
            skipped_backends[backend] = f".venvs/{env} is not installed"
            continue
        path, why = tiny_model(tiny, timeout=max(10.0, min(60.0, budget.left() / 4)))
        if path is None:
            skipped_backends[backend] = why
        else:
            models[backend] = {"tiny": str(path)}
    tmp = tempfile.TemporaryDirectory(prefix="sg-bench-audio-")
    long_path = bc.make_long(args.long_seconds, Path(tmp.name) / "long.flac")
    long_label = f"{args.long_seconds / 60:g} min"
    lengths = {"11 s": (bc.JFK, bc.duration(bc.JFK)),
               "60 s": (bc.MULTILINGUAL, bc.duration(bc.MULTILINGUAL)),
               LONG: (long_path, bc.duration(long_path))}
    worker_extra: dict[str, dict[str, Any]] = {"parakeet": {"parakeet_warmup_seconds": [1]}}
    try:
        with bc.Stack(NAME, workers=0, models=models) as stack, httpx.Client() as client:
            runner = Runner(stack, client, budget)
            fw_model = f"{bc.FW}/tiny.en"
            for _ in range(args.replicas):
                stack.add_worker()
            runner.warm_up(bc.FW, fw_model)
            for label in ("11 s", "60 s"):
                path, seconds = lengths[label]
                runner.case(bc.FW, fw_model, label, path, seconds, "serial",
                            args.reps if label == "11 s" else max(1, args.reps - 1))
                runner.case(bc.FW, fw_model, label, path, seconds, "2 concurrent", 2)
            for backend in [b for b in OTHER_BACKENDS if b in models]:
                if budget.left() < 90:
                    skipped_backends[backend] = (f"only {budget.left():.0f} s of the budget left"
                                                 " (a worker start takes ~10-30 s)")
                    continue
                env = OTHER_BACKENDS[backend][0]
                python = procs.VENVS / env / "bin" / "python"
                started_workers: list[procs.Service] = []
                model = f"{backend}/tiny"
                try:
                    try:
                        for _ in range(args.replicas):
                            started_workers.append(stack.add_worker(
                                backend=backend, python=python, **worker_extra.get(backend, {})))
                    except (RuntimeError, TimeoutError) as exc:
                        last = [line for line in str(exc).splitlines() if line.strip()][-3:]
                        skipped_backends[backend] = "worker did not start: " + " | ".join(last)
                        print(f"{backend}: {skipped_backends[backend]}", flush=True)
                        continue
                    runner.warm_up(backend, model)
                    for label in ("11 s", "60 s"):
                        path, seconds = lengths[label]
                        runner.case(backend, model, label, path, seconds, "serial",
                                    args.reps if label == "11 s" else max(1, args.reps - 1))
                        runner.case(backend, model, label, path, seconds, "2 concurrent", 2)
                finally:
                    for service in started_workers:
                        stack.stop_worker(service)
            path, seconds = lengths[LONG]
            runner.case(bc.FW, fw_model, long_label, path, seconds, "serial", 1)
            runner.case(bc.FW, fw_model, long_label, path, seconds, "2 concurrent", 2)
    finally:
        tmp.cleanup()
    rows = runner.rows
    bc.table(f"real-time factor (lower is faster), {args.replicas} worker replicas per backend, "
             f"CPU, tiny models",
             ["backend", "audio", "mode", "tasks", "e2e RTF", "worker RTF", "aggregate RTF",
              "wall s", "replicas used", "note"],
             [[r["backend"], r["audio"], r["mode"], r.get("tasks"), r.get("e2e_rtf"),
               r.get("worker_rtf"), r.get("aggregate_rtf"), r.get("wall_s"),
               r.get("workers_used"), r.get("skipped", "")] for r in rows]
             + [[b, "-", "-", None, None, None, None, None, None, f"backend skipped: {why}"]
                for b, why in skipped_backends.items()])
    bc.write_json(NAME, {"replicas": args.replicas, "budget_s": args.budget,
                         "elapsed_s": round(budget.elapsed(), 1), "cases": rows,
                         "skipped_backends": skipped_backends,
                         "models": {b: next(iter(m.values())) for b, m in models.items()}},
                  started)


if __name__ == "__main__":
    bc.run(main)
