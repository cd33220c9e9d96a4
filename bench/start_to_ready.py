"""6. Start to ready: supervisord start -> gateway ready with a live worker -> first task served.

The deployed stack exactly as scripts/serve.sh runs it (deploy/supervisord.conf with
deploy/defaults.env: Redis under supervisord, one gateway process, one faster-whisper
worker with the bundled tiny.en, no preload), in a temp run dir on free ports. Each
repetition is a cold start of every process (the OS file cache stays warm after the
first one). Times from the moment supervisord is spawned:

- gateway up: GET /health answers 200;
- ready: GET /ready answers 200 and lists a live faster-whisper worker;
- first task: a POST /v1/audio/transcriptions of jfk.flac sent at "ready" has returned
  (includes loading the model, as a first task after a start does).

Target: first task served <= 5 s on CPU with tiny.en.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402

from bench import common as bc  # noqa: E402
from harness import procs  # noqa: E402

NAME = "start_to_ready"
TARGET_SECONDS = 5.0
POLL = 0.01


def one_start(audio: bytes) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="sg-bench-start-"))
    (workdir / "logs").mkdir()
    (workdir / "redis").mkdir()
    port, redis_port = procs.free_port(), procs.free_port()
    env = procs.stack_env(SPEECH_RUN_DIR=str(workdir), SPEECH_PORT=str(port),
                          SPEECH_REDIS_PORT=str(redis_port), SPEECH_LOCAL_REDIS="true",
                          SPEECH_REDIS_URL=f"redis://127.0.0.1:{redis_port}/0")
    url = f"http://127.0.0.1:{port}"
    supervisor = procs.Supervisor(workdir, env)
    marks: dict[str, Any] = {}
    try:
        with httpx.Client(timeout=5) as client:
            t0 = time.perf_counter()
            supervisor.start()
            marks["supervisord_socket_s"] = time.perf_counter() - t0

            def status(path: str) -> httpx.Response | None:
                try:
                    return client.get(url + path)
                except httpx.HTTPError:
                    return None

            def gateway_up() -> bool:
                reply = status("/health")
                return reply is not None and reply.status_code == 200

            def ready() -> bool:
                reply = status("/ready")
                if reply is None or reply.status_code != 200:
                    return False
                return bool(reply.json()["backends"].get(bc.FW, {}).get("live"))

            procs.wait_until(gateway_up, 60, "gateway /health", POLL)
            marks["gateway_up_s"] = time.perf_counter() - t0
            procs.wait_until(ready, 60, "a live faster-whisper worker in /ready", POLL)
            marks["ready_s"] = time.perf_counter() - t0
            elapsed, task_id = bc.transcribe(client, url, audio, "jfk.flac")
            marks["first_task_s"] = time.perf_counter() - t0
            marks["first_task_request_s"] = elapsed
            view = bc.task_view(client, url, task_id)
            marks["first_task_worker_run_s"] = view["finished_at"] - view["started_at"]
    finally:
        supervisor.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    return {k: round(v, 3) for k, v in marks.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--budget", type=float, default=200.0)
    args = parser.parse_args()
    started = bc.machine()
    budget = bc.Budget(args.budget)
    audio = bc.JFK.read_bytes()
    runs: list[dict[str, Any]] = []
    while len(runs) < args.reps:
        if runs and budget.left() < 3 * max(r["first_task_s"] for r in runs) + 20:
            print(f"budget: stopping after {len(runs)} starts", flush=True)
            break
        runs.append(one_start(audio))
        print(f"start {len(runs)}: {runs[-1]}", flush=True)
    keys = ["supervisord_socket_s", "gateway_up_s", "ready_s", "first_task_s",
            "first_task_request_s", "first_task_worker_run_s"]
    stats = {key: bc.summary([r[key] for r in runs]) for key in keys}
    bc.table(f"start to ready: supervisord cold start, {len(runs)} runs (seconds from spawn)",
             ["milestone", "n", "min", "p50", "max"],
             [[key.removesuffix("_s"), s["n"], s["min"], s["p50"], s["max"]]
              for key, s in stats.items()])
    first = stats["first_task_s"]["p50"]
    print(f"supervisord start -> first task served, median: {first:.2f} s  target <= "
          f"{TARGET_SECONDS:.0f} s: {bc.verdict(first, TARGET_SECONDS, at_most=True)} "
          f"(worst {stats['first_task_s']['max']:.2f} s)")
    bc.write_json(NAME, {"runs": runs, "stats": stats, "target_s": TARGET_SECONDS,
                         "target_met": first <= TARGET_SECONDS}, started)


if __name__ == "__main__":
    bc.run(main)
