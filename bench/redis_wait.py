"""Redis replication: what waiting for a replica (WAIT) costs, and what one primary sustains.

A primary and its replica on loopback (AOF, fsync every second, as deployed). The store's
own calls, as the gateway and the workers make them (common/store), no HTTP:

1. submit (a 1 s FLAC blob) with `SPEECH_REDIS_WAIT_REPLICAS` 0 and 1, interleaved one by
   one: wall time per submit, p50/p99, and the paired difference (the wait's cost);
2. the terminal write (finish + ack) likewise;
3. the primary's own CPU per operation (INFO used_cpu_*, over a batch of each): a submit
   with its wait, a Sage status poll (the record, its queue position and its estimate, as
   `/api/status` reads them), a worker's cycle (read, deliveries, start, finish); from
   them, what one primary core sustains for the workload of a Sage task (1 submit, 10
   polls, 1 worker cycle), the figure docs/operations.md gives for not needing Redis
   Cluster.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Awaitable, Callable  # noqa: E402
from typing import Any  # noqa: E402

from bench import common as bc  # noqa: E402
from common.schemas import TaskState  # noqa: E402
from common.settings import Settings  # noqa: E402
from common.store import Task, TaskStore, WorkerStore, new_task_id  # noqa: E402
from common.store.connection import worker_client  # noqa: E402
from harness import procs  # noqa: E402

NAME = "redis_wait"
POLLS_PER_TASK = 10  # a Sage task polled every second for ~10 s in the queue and running


def _task() -> Task:
    return Task(id=new_task_id(), backend=bc.FW, model="tiny.en", state=TaskState.PENDING,
                audio_seconds=1.0)


async def _paired(count: int, make: Callable[[bool], Awaitable[float]]
                  ) -> tuple[list[float], list[float]]:
    """`make(wait)` returns one operation's seconds; alternated, so drift hits both alike."""
    without, with_wait = [], []
    for n in range(count):
        for wait in ((False, True) if n % 2 else (True, False)):
            (with_wait if wait else without).append(await make(wait))
    return without, with_wait


def _cpu(node: procs.RedisServer) -> float:
    info = node.client().info("cpu")
    return float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


async def _cpu_per_op(node: procs.RedisServer, count: int,
                      operation: Callable[[], Awaitable[Any]], concurrency: int = 8
                      ) -> tuple[float, float]:
    """(primary CPU seconds per operation, operations/s the client reached)."""
    left = count

    async def client() -> None:
        nonlocal left
        while left > 0:
            left -= 1
            await operation()

    before, started = _cpu(node), time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    wall = time.perf_counter() - started
    return (_cpu(node) - before) / count, count / wall


async def measure(primary: procs.RedisServer, blob: bytes, count: int) -> dict[str, Any]:
    def settings(replicas: int) -> Settings:
        return Settings(redis_url=primary.url, redis_wait_replicas=replicas,
                        consumer=f"bench-{replicas}")
    stores = {wait: TaskStore.for_settings(worker_client(settings(int(wait)), "bench"),
                                           settings(int(wait))) for wait in (False, True)}
    workers = {wait: WorkerStore(stores[wait].redis, settings(int(wait)), f"bench-{int(wait)}")
               for wait in (False, True)}
    await stores[True].ensure_queue(bc.FW)
    out: dict[str, Any] = {}

    async def submit(wait: bool) -> float:
        started = time.perf_counter()
        await stores[wait].submit(_task(), blob)
        return time.perf_counter() - started
    out["submit"] = await _paired(count, submit)

    async def finish(wait: bool) -> float:  # take one entry, start it, time its finish
        worker = workers[wait]
        delivery = (await worker.read(block_ms=None))[0]
        task = await worker.get(delivery.task_id)
        assert task is not None
        attempt = await worker.start(task.id, 1)
        started = time.perf_counter()
        await worker.finish(task, TaskState.SUCCEEDED, attempt=attempt,
                            entry_id=delivery.entry_id, result={"text": "x" * 200})
        return time.perf_counter() - started
    out["finish"] = await _paired(count, finish)

    # the primary's CPU per operation, with a queue of pending tasks to poll
    queued = [_task() for _ in range(1000)]
    for task in queued:
        await stores[True].submit(task, blob)
    store, worker, turn = stores[True], workers[True], iter(range(10**9))

    async def poll() -> None:
        # the Sage status poll's one round trip (common/store/poll.py)
        assert await store.poll.read(queued[next(turn) % len(queued)].id) is not None

    async def cycle() -> None:
        deliveries = await worker.read(block_ms=None)
        if not deliveries:
            return
        task = await worker.get(deliveries[0].task_id)
        assert task is not None
        await worker.deliveries(deliveries[0])
        attempt = await worker.start(task.id, 1)
        await worker.finish(task, TaskState.SUCCEEDED, attempt=attempt,
                            entry_id=deliveries[0].entry_id, result={"text": "x" * 200})

    out["cpu"] = {"submit": await _cpu_per_op(primary, count, lambda: store.submit(_task(),
                                                                                 blob)),
                  "poll": await _cpu_per_op(primary, count * 2, poll),
                  "worker_cycle": await _cpu_per_op(primary, min(count, 1000), cycle,
                                                    concurrency=1)}
    for each in stores.values():
        await each.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=1000, help="operations per case")
    args = parser.parse_args()
    started = bc.machine()
    workdir = Path(tempfile.mkdtemp(prefix="sg-bench-redis-wait-"))
    primary = replica = None
    try:
        primary = procs.RedisServer(workdir / "primary").start()
        replica = procs.RedisServer(workdir / "replica", replica_of=primary).start()
        procs.wait_until(
            lambda: replica.client().info("replication")["master_link_status"] == "up",
            20, "the replica's link")
        blob = bc.JFK.read_bytes()[:32_000]  # the size of a 1 s FLAC upload
        found = asyncio.run(measure(primary, blob, args.count))
    finally:
        for node in (replica, primary):
            if node is not None:
                node.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    rows, payload = [], {}
    for name in ("submit", "finish"):
        without, with_wait = found[name]
        cost = [b - a for a, b in zip(without, with_wait, strict=True)]
        payload[name] = {"no_wait_ms": bc.summary(without, 1000),
                         "wait_ms": bc.summary(with_wait, 1000),
                         "paired_cost_ms": bc.summary(cost, 1000)}
        rows.append([name, *(f"{bc.percentile(v, 50) * 1000:.3f} / "
                             f"{bc.percentile(v, 99) * 1000:.3f}"
                             for v in (without, with_wait, cost))])
    bc.table("replica wait (WAIT 1) per write, ms (p50 / p99)",
             ["write", "no wait", "WAIT 1", "paired cost"], rows)
    cpu = found["cpu"]
    per_task = (cpu["submit"][0] + POLLS_PER_TASK * cpu["poll"][0] + cpu["worker_cycle"][0])
    tasks_per_second = 1.0 / per_task
    payload["cpu_us"] = {k: round(v[0] * 1e6, 2) for k, v in cpu.items()}
    payload["client_ops_per_second"] = {k: round(v[1]) for k, v in cpu.items()}
    payload["sustained"] = {"tasks_per_second": round(tasks_per_second),
                            "submits_and_polls_per_second":
                                round(tasks_per_second * (1 + POLLS_PER_TASK))}
    bc.table("one primary's CPU per operation",
             ["operation", "µs of Redis CPU", "one core sustains /s", "client reached /s"],
             [[k, f"{v[0] * 1e6:.1f}", f"{1 / v[0]:.0f}" if v[0] > 0 else "-", f"{v[1]:.0f}"]
              for k, v in cpu.items()])
    print(f"a Sage task (1 submit + {POLLS_PER_TASK} polls + 1 worker cycle): "
          f"{per_task * 1e6:.0f} µs of Redis CPU -> one primary core sustains "
          f"~{tasks_per_second:.0f} tasks/s = ~{tasks_per_second * (1 + POLLS_PER_TASK):.0f} "
          "submits+polls/s")
    bc.write_json(NAME, payload, started)


if __name__ == "__main__":
    bc.run(main)
