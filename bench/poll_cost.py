"""What a status poll costs next to `/health`, measured with a C load generator (wrk).

One gateway process on Redis, no worker. The tasks are written through the task store
(common/store) beforehand: a SUCCEEDED one (a jfk.flac-sized result), a PENDING one at the
head of its queue, and a PENDING one behind 1000 queued tasks; the backend has a measured
rate, so the queued polls compute their estimate as in production. For each case and each
concurrency (8 and 32 connections), wrk runs `--seconds` against one URL; the target is
status ÷ `/health` ≥ 0.8. The cases run in `--rounds` interleaved rounds (each round:
`/health`, then the three polls, at each concurrency), and a case's ratio is the median of its
rounds' ratios to the same round's `/health`: on a shared machine the floor moves by ±15 %
between runs a minute apart, and one pair of runs reads that as a verdict. wrk (Debian's
`wrk`) runs one thread and stays far from the gateway's ceiling (its CPU % is reported with
the gateway's and Redis's).

Then submits (POST /api/faster-whisper-submit of a 1 s WAV upload: parsing, the probe, the
submit script), for their cost next to the polls' (no target). `--profile` also samples the
gateway with py-spy (`--py-spy PATH`; pip install py-spy) during one extra run per case and
prints the frames where its event loop spends its time.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import collections  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

from bench import common as bc  # noqa: E402
from common.audio import decode_audio, encode_wav  # noqa: E402
from common.schemas import TaskState  # noqa: E402
from common.settings import Settings  # noqa: E402
from common.store import Task, TaskStore, new_task_id  # noqa: E402
from common.store import admission as facts  # noqa: E402

NAME = "poll_cost"
CONCURRENCY = (8, 32)
TARGET = 0.8  # status ÷ /health, every case
DEEP = 1000
#: the shape of jfk.flac's result (what a finished poll carries)
RESULT: dict[str, Any] = {
    "text": " And so my fellow Americans, ask not what your country can do for you, ask what "
            "you can do for your country.",
    "language": "en", "duration": 11.0, "usage": {"audio_seconds": 11.0},
    "segments": [{"id": i, "start": 2.5 * i, "end": 2.5 * i + 2.4, "text": text,
                  "avg_logprob": -0.25, "no_speech_prob": 0.01, "compression_ratio": 1.2}
                 for i, text in enumerate([" And so my fellow Americans,",
                                           " ask not what your country can do for you,",
                                           " ask what you can do for your country."])]}


async def _write_tasks(redis_url: str) -> dict[str, str]:
    store = TaskStore.connect(Settings(redis_url=redis_url), client_name="bench")
    try:
        await store.ensure_queue(bc.FW)
        await facts.RateRecorder(store.redis, bc.FW).record("tiny.en", 11.0, 0.8)

        async def submit() -> Task:
            task = Task(id=new_task_id(), backend=bc.FW, model="tiny.en",
                        state=TaskState.PENDING, audio_seconds=1.0)
            await store.submit(task, b"x" * 2000)
            return task

        done = await submit()
        attempt = await store.start(done.id, "bench", 1, bc.FW)
        await store.finish(done, TaskState.SUCCEEDED, attempt=attempt, entry_id=done.entry_id,
                           result=RESULT)
        head = await submit()
        for _ in range(DEEP - 1):
            await submit()
        deep = await submit()
        return {"done": done.id, "queued": head.id, "deep": deep.id}
    finally:
        await store.close()


def wrk(url: str, connections: int, seconds: float, script: Path | None = None
        ) -> dict[str, Any]:
    """One wrk run (`script`: a wrk Lua script shaping the request): requests/s, latency
    p50/p99 (ms), non-2xx replies."""
    proc = subprocess.Popen(["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--latency",
                             *(["-s", str(script)] if script else []), url],
                            stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=seconds + 30)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]

    def latency(label: str) -> float:
        found = re.search(rf"^\s+{label}%\s+([\d.]+)(us|ms|s)", out, re.M)
        if not found:
            return float("nan")
        scale = {"us": 0.001, "ms": 1.0, "s": 1000.0}[found.group(2)]
        return round(float(found.group(1)) * scale, 2)

    errors = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    return {"rps": rps, "p50_ms": latency("50"), "p99_ms": latency("99"),
            "non_2xx": int(errors.group(1)) if errors else 0}


def upload_script(clip: bytes, folder: Path) -> Path:
    """A wrk script POSTing `clip` as a multipart upload (as Sage's client would)."""
    boundary = "sgbench0boundary"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; "
            f"filename=\"clip1s.wav\"\r\nContent-Type: audio/wav\r\n\r\n").encode() + clip + \
        f"\r\n--{boundary}--\r\n".encode()
    (folder / "body.bin").write_bytes(body)
    script = folder / "upload.lua"
    script.write_text(f"""local f = io.open("{folder / 'body.bin'}", "rb")
wrk.body = f:read("*all")
f:close()
wrk.method = "POST"
wrk.headers["Content-Type"] = "multipart/form-data; boundary={boundary}"
""")
    return script


def measured(url: str, connections: int, seconds: float, pids: dict[str, int],
             script: Path | None = None) -> dict[str, Any]:
    before = {name: bc.cpu_seconds(pid) for name, pid in pids.items()}
    start = time.perf_counter()
    result = wrk(url, connections, seconds, script)
    wall = time.perf_counter() - start
    return {**result, **{f"{name}_cpu_pct": round(100 * (bc.cpu_seconds(pid) - before[name])
                                                   / wall, 1) for name, pid in pids.items()}}


def profile(py_spy: str, pid: int, url: str, seconds: float, out: Path,
            script: Path | None = None) -> dict[str, Any]:
    """Where the gateway's event loop spends a poll (wrk c=8 on `url`): frames by inclusive
    share of the loop thread's busy samples (waiting in epoll left out), and how many of
    all samples fell in other threads (FastAPI's thread pool)."""
    spy = subprocess.Popen([py_spy, "record", "-p", str(pid), "-d", f"{seconds + 1:g}", "-r",
                            "250", "-f", "raw", "-o", str(out), "--nonblocking", "--threads"],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    time.sleep(0.5)
    wrk(url, 8, seconds, script)
    spy.wait(timeout=60)
    inclusive: collections.Counter[str] = collections.Counter()
    loop = other = idle = 0
    for line in out.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        samples = int(count)
        frames = stack.split(";")
        if not any("run_forever" in frame for frame in frames):
            other += samples
            continue
        if "select (selectors.py" in frames[-1]:
            idle += samples
            continue
        loop += samples
        for frame in {re.sub(r" \(.*?/(site-packages|wt-[^/]*|main|poll-before)/", " (",
                             frame) for frame in frames}:
            inclusive[frame] += samples
    busy = max(1, loop)
    frames_out = [(frame, round(100 * n / busy, 1)) for frame, n in inclusive.most_common(80)
                  if n < 0.97 * busy][:45]
    total = max(1, loop + other + idle)
    return {"loop_busy_pct": round(100 * loop / total, 1),
            "loop_idle_pct": round(100 * idle / total, 1),
            "other_threads_pct": round(100 * other / total, 1), "frames": frames_out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=5.0, help="each wrk run")
    parser.add_argument("--rounds", type=int, default=3,
                        help="interleaved rounds of every poll case (the ratio: their median)")
    parser.add_argument("--profile", action="store_true", help="sample the gateway too")
    parser.add_argument("--py-spy", default=shutil.which("py-spy") or "py-spy")
    parser.add_argument("--no-submit", dest="submit", action="store_false",
                        help="skip the submit case (POST of a 1 s WAV, no target)")
    args = parser.parse_args()
    if not shutil.which("wrk"):
        raise SystemExit("wrk is not installed (apt-get install wrk)")
    started = bc.machine()
    results: dict[str, Any] = {}
    profiles: dict[str, Any] = {}
    with bc.Stack(NAME, workers=0) as stack, tempfile.TemporaryDirectory() as tmp:
        assert stack.redis is not None
        folder = Path(tmp)
        clip = encode_wav(decode_audio(bc.JFK)[:16000], 16000)  # 1 s; no ffmpeg needed
        upload = upload_script(clip, folder)
        ids = asyncio.run(_write_tasks(stack.redis.url))
        pids = {name: pid for name, pid in stack.pids().items() if name in ("gateway", "redis")}
        urls = {"health": f"{stack.url}/health",
                **{f"status {case}": f"{stack.url}/api/status?taskid={task_id}"
                   for case, task_id in ids.items()}}
        submit_url = f"{stack.url}/api/faster-whisper-submit"
        for url in urls.values():  # warm-up: imports, scripts loaded, connections open
            wrk(url, 8, 1)
        polls = [(case, url, c) for c in CONCURRENCY for case, url in urls.items()]
        runs: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
        for round_ in range(1, args.rounds + 1):
            for case, url, concurrency in polls:  # /health first in each concurrency's round
                result = measured(url, concurrency, args.seconds, pids)
                floor = runs[f"health c={concurrency}"][-1]["rps"] if case != "health" else None
                result["ratio"] = result["rps"] / floor if floor else 1.0
                runs[f"{case} c={concurrency}"].append(result)
                print(f"round {round_} {case:15} c={concurrency:<3} {result['rps']:8.0f} req/s"
                      f"  ÷ health {result['ratio']:.3f}  p99 {result['p99_ms']} ms  gateway "
                      f"{result['gateway_cpu_pct']} %", flush=True)
        for name, found in runs.items():
            case, _, concurrency = name.partition(" c=")
            results[name] = {"case": case, "concurrency": int(concurrency),
                             "rounds": [round(r["ratio"], 3) for r in found],
                             **{key: statistics.median(r[key] for r in found)
                                for key in found[0]}}
        if args.submit:  # last: the tasks it queues go behind every polled one
            for concurrency in CONCURRENCY:
                result = measured(submit_url, concurrency, args.seconds, pids, upload)
                results[f"submit c={concurrency}"] = {"case": "submit",
                                                      "concurrency": concurrency, **result}
                print(f"submit          c={concurrency:<3} {result['rps']:8.0f} req/s  p99 "
                      f"{result['p99_ms']} ms  gateway {result['gateway_cpu_pct']} %",
                      flush=True)
        if args.profile:
            for case, url, _ in polls[:len(urls)]:
                profiles[case] = profile(args.py_spy, pids["gateway"], url, args.seconds,
                                         folder / "spy.txt")
            profiles["submit"] = profile(args.py_spy, pids["gateway"], submit_url,
                                         args.seconds, folder / "spy.txt", upload)
    rows, verdicts = [], []  # a poll's ratio: the median of its rounds' (see the docstring)
    for r in results.values():
        floor = results[f"health c={r['concurrency']}"]["rps"]
        r["ratio"] = round(r.get("ratio", r["rps"] / floor), 3)
        if r["case"] not in ("health", "submit"):
            verdicts.append(f"{r['case']} c={r['concurrency']}: "
                            f"{bc.verdict(r['ratio'], TARGET, at_most=False)}")
        rows.append([r["case"], r["concurrency"], r["rps"], r["ratio"], r["p50_ms"],
                     r["p99_ms"], r["non_2xx"], r["gateway_cpu_pct"], r["redis_cpu_pct"]])
    bc.table(f"status poll vs /health (wrk -t1, one gateway process, {started['cpus']} cores)",
             ["case", "conc", "req/s", "÷ health", "p50 ms", "p99 ms", "non-2xx",
              "gateway cpu %", "redis cpu %"], rows)
    for line in verdicts:
        print(line)
    for case, found in profiles.items():
        print(f"\n-- py-spy, {case}: the event loop busy {found['loop_busy_pct']} % of the "
              f"samples, idle {found['loop_idle_pct']} %, other threads "
              f"{found['other_threads_pct']} %; frames by inclusive % of the busy loop --")
        for frame, share in found["frames"]:
            print(f"{share:6.1f}  {frame}")
    bc.write_json(NAME, {"seconds": args.seconds, "rounds": args.rounds, "target": TARGET,
                         "cases": results, "verdicts": verdicts, "profiles": profiles}, started)


if __name__ == "__main__":
    bc.run(main)
