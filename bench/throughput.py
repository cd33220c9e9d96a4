"""3. Status-poll and submit throughput under concurrency: requests/s and latency p50/p99.

httpx async clients at concurrency 1, 8 and 32 (one keep-alive connection each) against
one gateway process on Redis; each case stops at --count requests or --seconds, whichever
comes first, after a short warm-up. Cases:

- health: GET /health (no Redis): the HTTP stack's own ceiling on this machine;
- status done: GET /api/status of a SUCCEEDED task (result included, jfk.flac's);
- status pending: GET /api/status of a PENDING task (adds the queue-position lookup);
- submit: POST /api/faster-whisper-submit of a 1 s FLAC clip (multipart upload, probe,
  atomic submit). No worker runs during this case, so submitted tasks just queue;
- status deep queue: GET /api/status of a PENDING task submitted after the submit case,
  with every task that case queued ahead of it (queue_position counts up to 1000).

The client runs in this process on the same cores as the gateway; its CPU share is
reported (client cpu %, of one core), as it competes with the gateway for the 2 cores,
next to the gateway's and Redis's (100 % = one core busy for the whole case).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Awaitable, Callable  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402

from bench import common as bc  # noqa: E402

NAME = "throughput"
CONCURRENCY = (1, 8, 32)


async def load(make_request: Callable[[httpx.AsyncClient], Awaitable[httpx.Response]],
               concurrency: int, count: int, seconds: float, check: Callable[[Any], bool],
               server_pids: dict[str, int]) -> dict[str, Any]:
    # One client (one connection) per simulated user: a single AsyncClient shared by many
    # coroutines spends most of its time in its own pool bookkeeping (encode/httpx#3215),
    # which would measure the client instead of the gateway.
    clients = [httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=1))
               for _ in range(concurrency)]
    try:
        for _ in range(min(10, count)):  # warm-up: open the connections, fill caches
            await asyncio.gather(*(make_request(client) for client in clients))
        latencies: list[float] = []
        failures = 0
        issued = 0
        deadline = time.monotonic() + seconds

        async def user(client: httpx.AsyncClient) -> None:
            nonlocal issued, failures
            while issued < count and time.monotonic() < deadline:
                issued += 1
                start = time.perf_counter()
                reply = await make_request(client)
                latencies.append(time.perf_counter() - start)
                if reply.status_code != 200 or not check(reply):
                    failures += 1

        server_cpu = {name: bc.cpu_seconds(pid) for name, pid in server_pids.items()}
        cpu = time.process_time()
        start = time.perf_counter()
        await asyncio.gather(*(user(client) for client in clients))
        wall = time.perf_counter() - start
        cpu = time.process_time() - cpu
        server_cpu = {name: bc.cpu_seconds(pid) - server_cpu[name]
                      for name, pid in server_pids.items()}
    finally:
        await asyncio.gather(*(client.aclose() for client in clients))
    return {"requests": len(latencies), "failures": failures, "seconds": round(wall, 3),
            "rps": round(len(latencies) / wall, 1), "latency_ms": bc.summary(latencies, 1000),
            "client_cpu_pct": round(100 * cpu / wall, 1),
            **{f"{name}_cpu_pct": round(100 * used / wall, 1)
               for name, used in server_cpu.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=3000, help="most requests per case")
    parser.add_argument("--seconds", type=float, default=8.0, help="longest run per case")
    args = parser.parse_args()
    started = bc.machine()
    with tempfile.TemporaryDirectory(prefix="sg-bench-audio-") as tmp:
        clip = bc.make_clip(bc.JFK, 1.0, Path(tmp) / "clip1s.flac").read_bytes()
    results: dict[str, dict[str, Any]] = {}
    with bc.Stack(NAME) as stack, httpx.Client() as sync:
        base = stack.url
        done_id = bc.sage_submit(sync, base, bc.JFK.read_bytes(), "jfk.flac")
        bc.sage_wait(sync, base, done_id, interval=0.05)
        stack.stop_worker(stack.workers[0])  # from here on, submitted tasks stay PENDING
        pending_id = bc.sage_submit(sync, base, clip, "clip1s.flac")
        servers = {name: pid for name, pid in stack.pids().items() if name in ("gateway", "redis")}

        def status_of(task_id: str) -> Callable[[httpx.AsyncClient], Awaitable[httpx.Response]]:
            return lambda client: client.get(f"{base}/api/status", params={"taskid": task_id})

        Request = Callable[[httpx.AsyncClient], Awaitable[httpx.Response]]

        def deep_pending() -> tuple[Request, Callable[[Any], bool]]:
            # submitted after the submit case: every task that case queued is ahead of it
            task_id = bc.sage_submit(sync, base, clip, "clip1s.flac")
            position = sync.get(f"{base}/api/status", params={"taskid": task_id}).json()
            print(f"deep queue: queue_position {position.get('queue_position')}", flush=True)
            return status_of(task_id), lambda r: r.json()["status"] == "PENDING"

        cases: dict[str, Callable[[], tuple[Request, Callable[[Any], bool]]]] = {
            "health": lambda: (lambda client: client.get(f"{base}/health"), lambda r: True),
            "status done": lambda: (status_of(done_id),
                                    lambda r: r.json()["status"] == "SUCCEEDED"),
            "status pending": lambda: (status_of(pending_id),
                                       lambda r: r.json()["status"] == "PENDING"),
            "submit": lambda: (lambda client: client.post(f"{base}/api/faster-whisper-submit",
                                                          files={"file": ("clip1s.flac", clip)}),
                               lambda r: r.json()["status"] == "PENDING"),
            "status deep queue": deep_pending,
        }
        for case, prepare in cases.items():
            make_request, check = prepare()
            for concurrency in CONCURRENCY:
                result = asyncio.run(load(make_request, concurrency, args.count, args.seconds,
                                          check, servers))
                results[f"{case} c={concurrency}"] = {"case": case, "concurrency": concurrency,
                                                      **result}
                print(f"{case:17} c={concurrency:<3} {result['rps']:8.1f} req/s  p99 "
                      f"{result['latency_ms']['p99']:.1f} ms", flush=True)
    bc.table(f"gateway throughput (1 gateway process, {bc.machine()['cpus']} cores, client in "
             "the same machine)",
             ["case", "conc", "requests", "req/s", "p50 ms", "p99 ms", "failures",
              "gateway cpu %", "redis cpu %", "client cpu %"],
             [[r["case"], r["concurrency"], r["requests"], r["rps"], r["latency_ms"]["p50"],
               r["latency_ms"]["p99"], r["failures"], r["gateway_cpu_pct"],
               r["redis_cpu_pct"], r["client_cpu_pct"]]
              for r in results.values()])
    bc.write_json(NAME, {"count_limit": args.count, "seconds_limit": args.seconds,
                         "cases": results}, started)


if __name__ == "__main__":
    bc.run(main)
