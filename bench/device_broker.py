"""Device memory broker: how long a task waits for device memory, against its model's load.

Three workers of three backends (faster-whisper's bundled tiny.en, the tiny qwen3 and
vibevoice checkpoints from scripts/make_tiny_models.py; .venvs/hf needed), every model
sized `--mib` MiB by SPEECH_MODEL_MEMORY_MIB, on a cpu budget that fits `--fit` of them
(2 by default: every round of three interleaved tasks evicts). Each round submits one
task to each backend at once and waits for all three. From the workers' histograms
(/metrics): the time loads waited in line for memory (`speech_device_wait_seconds`,
evictions included) and the loads themselves (`speech_model_load_seconds`), per backend,
with their ratio; from the tasks: end to end, and the evictions counted.

    .venvs/core/bin/python bench/device_broker.py [--rounds 5] [--fit 2] [--mib 1000]

`--fit 3` is the baseline: the same traffic with every model resident.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402

from bench import common as bc  # noqa: E402

NAME = "device_broker"
HF_PYTHON = bc.ROOT / ".venvs" / "hf" / "bin" / "python"


def tiny(name: str) -> str:
    """The tiny checkpoint `name` (built once, cached) by scripts/make_tiny_models.py."""
    out = subprocess.run([sys.executable, str(bc.ROOT / "scripts" / "make_tiny_models.py"),
                          name], capture_output=True, text=True, timeout=900, check=True)
    return out.stdout.split()[-1]


def histograms(text: str, metric: str) -> dict[str, tuple[float, float]]:
    """backend -> (sum, count) of one histogram in /metrics' text."""
    found: dict[str, list[float]] = {}
    for part in ("sum", "count"):
        pattern = rf'^speech_{metric}_{part}\{{backend="([^"]+)"\}} (\S+)$'
        for backend, value in re.findall(pattern, text, re.MULTILINE):
            found.setdefault(backend, []).append(float(value))
    return {backend: (values[0], values[1]) for backend, values in found.items()
            if len(values) == 2}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--fit", type=int, default=2, help="models the budget fits")
    parser.add_argument("--mib", type=int, default=1000, help="every model's size")
    parser.add_argument("--budget", type=float, default=280.0, help="wall-clock seconds")
    args = parser.parse_args()
    if not HF_PYTHON.exists():
        sys.exit("needs .venvs/hf (qwen3 and vibevoice workers)")
    started = bc.machine()
    budget = bc.Budget(args.budget)
    models = {bc.FW: {"tiny.en": "bundled"}, "qwen3": {"tiny": tiny("qwen3")},
              "vibevoice": {"tiny": tiny("vibevoice")}}
    sizes = {f"{b}/{m}": args.mib for b, named in models.items() for m in named}
    worker_settings = {"device_memory_mib": {"cpu": args.fit * args.mib},
                       "model_memory_mib": sizes, "device_poll_seconds": "0.1"}
    audio = bc.JFK.read_bytes()
    end_to_end: list[float] = []
    with bc.Stack(NAME, workers=0, models=models, worker_settings=worker_settings) as stack:
        for backend in models:
            stack.add_worker(backend, python=None if backend == bc.FW else HF_PYTHON)
        with httpx.Client(timeout=60) as client:
            for done in range(args.rounds):
                if budget.left() < 30:
                    print(f"budget: stopping after {done} rounds", flush=True)
                    break
                t0 = time.perf_counter()
                ids = [bc.sage_submit(client, stack.url, audio, "jfk.flac", backend=backend)
                       for backend in models]
                for task_id in ids:
                    bc.sage_wait(client, stack.url, task_id, timeout=120)
                    view = bc.task_view(client, stack.url, task_id)
                    assert view["status"] == "SUCCEEDED", view
                    end_to_end.append(view["finished_at"] - view["created_at"])
                print(f"round {done + 1}: {time.perf_counter() - t0:.2f} s", flush=True)
            text = client.get(f"{stack.url}/metrics").text
            devices = client.get(f"{stack.url}/ready").json()["devices"]
    waits = histograms(text, "device_wait_seconds")
    loads = histograms(text, "model_load_seconds")
    rows: list[list[Any]] = []
    totals = [0.0, 0.0, 0.0, 0.0]
    for backend in models:
        wait_sum, wait_n = waits.get(backend, (0.0, 0.0))
        load_sum, load_n = loads.get(backend, (0.0, 0.0))
        totals = [totals[0] + wait_sum, totals[1] + wait_n, totals[2] + load_sum,
                  totals[3] + load_n]
        rows.append([backend, int(load_n), wait_sum / max(wait_n, 1), load_sum / max(load_n, 1),
                     wait_sum / load_sum if load_sum else float("nan")])
    rows.append(["all", int(totals[3]), totals[0] / max(totals[1], 1),
                 totals[2] / max(totals[3], 1),
                 totals[0] / totals[2] if totals[2] else float("nan")])
    bc.table(f"device memory broker: 3 workers, a budget of {args.fit} models "
             f"({args.fit * args.mib} MiB)",
             ["backend", "loads", "mean wait s", "mean load s", "wait/load"], rows)
    (device,) = devices.values()
    e2e = bc.summary(end_to_end)
    print(f"evictions: {device['evictions']}  tasks: {len(end_to_end)}  end to end p50 "
          f"{e2e['p50']:.2f} s, max {e2e['max']:.2f} s", flush=True)
    bc.write_json(NAME, {"rounds": args.rounds, "fit": args.fit, "mib": args.mib,
                         "per_backend": rows, "evictions": device["evictions"],
                         "end_to_end": e2e}, started)


if __name__ == "__main__":
    bc.run(main)
