"""A key's flood and another key's one task: how long the one task waits, with each key's
share of a lane (`SPEECH_QUEUED_PER_KEY`, common/store/shares.py) and without it, and what
the share costs the flood itself.

A real worker runtime (`workers.runtime.Worker`, in this process) on a real redis-server with
the bundled tiny.en: key A queues --flood clips, then key B queues one; the worker drains
them (batching on, as deployed: up to 8 a call, 50 ms window; and off). Per mode: B's latency
(`finished_at - created_at`), the flood's drain time, and how many of A's tasks finished
before B's; medians of --rounds rounds, the modes' order turned each round. Ratios: B's
latency with the share ÷ without (the target: well under 1), the flood's drain time with ÷
without (about 1: a key alone loses little).

`.venvs/core/bin/python bench/fairness.py [--flood 32] [--seconds 6] [--share 8]`
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
from typing import Any  # noqa: E402

from redis.asyncio import Redis  # noqa: E402

from bench import common as bc  # noqa: E402
from bench.batching import GREEDY, clips  # noqa: E402
from common.schemas import TaskState  # noqa: E402
from common.settings import Settings  # noqa: E402
from common.store import Task, TaskStore, new_task_id  # noqa: E402
from harness import procs  # noqa: E402
from workers.engines import create_engine  # noqa: E402
from workers.runtime import Worker  # noqa: E402

NAME = "fairness"


async def run_mode(redis_url: str, audios: list[bytes], share: int,
                   batching: bool) -> dict[str, Any]:
    client = Redis.from_url(redis_url)
    await client.flushdb()
    settings = Settings(redis_url=redis_url, backend=bc.FW, models={bc.FW: {"bench": "bundled"}},
                        consumer="bench", device="cpu", idle_unload_seconds=-1,
                        heartbeat_seconds=2, batch_max_size=8 if batching else 1,
                        batch_window_ms=50.0 if batching else 0.0, min_uptime_seconds=0)
    worker = Worker(settings, create_engine(bc.FW, settings), client, handle_signals=False,
                    exit=lambda code: None, burst=True)
    await worker.host.preload("bench")
    store = TaskStore(client, 3600)

    async def submit(owner: str, audio: bytes) -> str:
        task = Task(id=new_task_id(), backend=bc.FW, model="bench", owner=owner,
                    state=TaskState.PENDING, params=dict(GREEDY),
                    audio_seconds=len(audio) / 32000)
        await store.submit(task, audio, lane_share=share)
        return task.id

    flood = [await submit("key-a", audio) for audio in audios[:-1]]
    other = await submit("key-b", audios[-1])
    started = time.time()
    await worker.run()
    done = {task_id: await store.get(task_id) for task_id in [*flood, other]}
    await client.aclose()
    assert all(t is not None and t.state == TaskState.SUCCEEDED for t in done.values())
    mine = done[other]
    assert mine is not None and mine.finished_at is not None
    flooded = [t for task_id in flood if (t := done[task_id]) is not None]
    return {"share": share, "batching": batching,
            "other_latency_s": round(mine.finished_at - mine.created_at, 3),
            "flood_drain_s": round(max(t.finished_at or 0.0 for t in flooded) - started, 3),
            "flood_done_before": sum((t.finished_at or 0.0) < mine.finished_at
                                     for t in flooded)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flood", type=int, default=32, help="key A's tasks")
    parser.add_argument("--seconds", type=float, default=6.0, help="clip length")
    parser.add_argument("--share", type=int, default=8, help="SPEECH_QUEUED_PER_KEY")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds of every mode, the order turned each round; medians")
    args = parser.parse_args()
    started = {"machine": bc.machine(), "revision": bc.git_revision()}
    audios = clips(args.flood + 1, args.seconds)
    modes = [(batching, share) for batching in (True, False) for share in (args.share, 0)]
    runs: dict[tuple[bool, int], list[dict[str, Any]]] = {mode: [] for mode in modes}
    with tempfile.TemporaryDirectory() as tmp:
        redis = procs.RedisServer(Path(tmp) / "redis", appendonly=False).start()
        try:
            for round_ in range(args.rounds):
                for batching, share in (modes if round_ % 2 == 0 else modes[::-1]):
                    runs[(batching, share)].append(
                        asyncio.run(run_mode(redis.url, audios, share, batching)))
        finally:
            redis.stop()
    rows = [{**found[0], **{field: bc.median([r[field] for r in found])
                            for field in ("other_latency_s", "flood_drain_s",
                                          "flood_done_before")}}
            for found in runs.values()]
    bc.table(f"key A queues {args.flood} clips of {args.seconds} s, then key B one; one "
             f"worker, tiny.en on cpu; medians of {args.rounds} rounds",
             ["batching", "share", "B's latency s", "A's tasks done before B's",
              "A's drain s"],
             [[r["batching"], r["share"] or "off", r["other_latency_s"],
               r["flood_done_before"], r["flood_drain_s"]] for r in rows])
    ratios = {}
    for batching in (True, False):
        on, off = (next(r for r in rows if r["batching"] == batching and r["share"] == share)
                   for share in (args.share, 0))
        key = "batching" if batching else "one at a time"
        ratios[key] = {"other_latency": round(on["other_latency_s"] / off["other_latency_s"], 3),
                       "flood_drain": round(on["flood_drain_s"] / off["flood_drain_s"], 3)}
        print(f"{key}: B's latency with the share ÷ without {ratios[key]['other_latency']}, "
              f"A's drain {ratios[key]['flood_drain']}")
    print(bc.write_json(NAME, {"flood": args.flood, "seconds": args.seconds,
                               "share": args.share, "modes": rows, "ratios": ratios}, started))


if __name__ == "__main__":
    bc.run(main)
