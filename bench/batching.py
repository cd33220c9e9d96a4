"""Cross-request batching (issue 29): throughput and latency against the batch size, and
what batching costs a lone stream.

A real worker runtime (`workers.runtime.Worker`, in this process: engine host, consumer,
WorkerStore) on a real redis-server, with the backend's engine and model:

- **batch size**: --tasks clips (the test files cut at several offsets, ≤ 12 s each,
  greedy decoding) queued at once, then drained with `SPEECH_BATCH_MAX_SIZE` = B (B=1 is
  batching off); tasks/s, audio-seconds/s, and p50/p99 of each task's latency
  (`finished_at - created_at`, from the task hash). Every B's texts are compared with
  B=1's (identical is the contract under greedy decoding);
- **B=1 overhead**: one stream (submit, wait for the result, submit the next) with
  batching on (window 50 ms) and off, two workers side by side taking turns task by task
  (on, off, off, on …); the median of the paired latency ratios.

Run with the backend's environment: `.venvs/core/bin/python bench/batching.py` (faster-
whisper, bundled tiny.en), `.venvs/nemo/bin/python bench/batching.py --backend parakeet
--source models/tiny/parakeet/parakeet-tiny.nemo`, `.venvs/hf/bin/python bench/batching.py --backend
qwen3 --source models/tiny/qwen3`. `--device cuda` for the GPU rows
(scripts/gpu_check.sh).
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
from common import keys  # noqa: E402
from common.audio import decode_audio, encode_wav  # noqa: E402
from common.schemas import TaskState  # noqa: E402
from common.settings import Settings  # noqa: E402
from common.store import Task, TaskStore, new_task_id  # noqa: E402
from harness import procs  # noqa: E402
from workers.engines import create_engine  # noqa: E402
from workers.runtime import Worker  # noqa: E402

NAME = "batching"
FILES = ("jfk.flac", "hotwords.mp3", "multilingual.mp3", "stereo_16k.wav")
GREEDY = {"beam_size": 1, "language": "en"}


def clips(count: int, seconds: float) -> list[bytes]:
    decoded = [decode_audio((bc.AUDIO / name).read_bytes(), 16000, None) for name in FILES]
    found = []
    for index in range(count):
        audio = decoded[index % len(decoded)]
        offset = int((index // len(decoded)) * 1.3 * 16000) % max(1, len(audio) - 16000)
        found.append(encode_wav(audio[offset:offset + int(seconds * 16000)], 16000))
    return found


class Bench:
    def __init__(self, args: argparse.Namespace, redis_url: str) -> None:
        self.args = args
        self.redis_url = redis_url
        self.backend = args.backend

    def settings(self, max_size: int, window_ms: float) -> Settings:
        return Settings(redis_url=self.redis_url, backend=self.backend,
                        models={self.backend: {"bench": self.args.source}},
                        consumer="bench", device=self.args.device, idle_unload_seconds=-1,
                        heartbeat_seconds=2, batch_max_size=max_size,
                        batch_window_ms=window_ms, min_uptime_seconds=0)

    async def submit(self, client: Redis, audio: bytes) -> str:
        task = Task(id=new_task_id(), backend=self.backend, model="bench",
                    state=TaskState.PENDING, params=dict(GREEDY),
                    audio_seconds=len(audio) / 32000)
        await TaskStore(client, 3600).submit(task, audio)
        return task.id

    async def results(self, client: Redis, ids: list[str]) -> list[Task]:
        store = TaskStore(client, 3600)
        return [task for task_id in ids if (task := await store.get(task_id)) is not None]

    async def drain(self, audios: list[bytes], max_size: int) -> dict[str, Any]:
        """Queue every clip, then one worker drains them with batches of up to `max_size`."""
        client = Redis.from_url(self.redis_url)
        await client.flushdb()
        settings = self.settings(max_size, 50.0 if max_size > 1 else 0.0)
        worker = Worker(settings, create_engine(self.backend, settings), client,
                        handle_signals=False, exit=lambda code: None, burst=True)
        await worker.host.preload("bench")
        ids = [await self.submit(client, audio) for audio in audios]
        started = time.time()
        await worker.run()
        done = await self.results(client, ids)
        wall = max(t.finished_at or 0.0 for t in done) - started
        sizes = {k.decode(): float(v) for k, v in
                 (await client.hgetall(keys.histogram(self.backend, "batch_size"))).items()}
        await client.aclose()
        latencies = [(t.finished_at or 0.0) - t.created_at for t in done]
        return {"batch_max": max_size, "tasks": len(done),
                "succeeded": sum(t.state == TaskState.SUCCEEDED for t in done),
                "wall_s": round(wall, 3), "tasks_per_s": round(len(done) / wall, 3),
                "audio_s_per_s": round(sum(t.audio_seconds or 0 for t in done) / wall, 2),
                "latency_p50_s": round(bc.percentile(latencies, 50), 3),
                "latency_p99_s": round(bc.percentile(latencies, 99), 3),
                "mean_batch": round(sizes.get("sum", 0) / sizes["count"], 2)
                if sizes.get("count") else 1.0,
                "texts": [t.result["text"] if t.result else None for t in done]}

    async def one_stream(self, audio: bytes, reps: int) -> dict[str, Any]:
        """`reps` sequential tasks a mode, alternating task by task between two workers that
        run side by side (batching on in Redis db 0, off in db 1): the machine's drift
        reaches both modes alike, and the paired ratios cancel it."""
        latencies: dict[str, list[float]] = {"on": [], "off": []}
        clients = {mode: Redis.from_url(self.redis_url, db=db)
                   for db, mode in enumerate(("on", "off"))}
        workers, running = [], []
        for mode, client in clients.items():
            await client.flushdb()
            settings = self.settings(8, 50.0 if mode == "on" else 0.0)
            worker = Worker(settings, create_engine(self.backend, settings), client,
                            handle_signals=False, exit=lambda code: None)
            await worker.host.preload("bench")
            workers.append(worker)
            running.append(asyncio.create_task(worker.run()))
        for rep in range(reps * 2):
            mode = ("on", "off")[rep % 2 if rep // 2 % 2 == 0 else 1 - rep % 2]  # on off off on
            client = clients[mode]
            task_id = await self.submit(client, audio)
            while True:
                found = (await self.results(client, [task_id]))[0]
                if found.state.terminal:
                    break
                await asyncio.sleep(0.002)
            assert found.finished_at is not None
            latencies[mode].append(found.finished_at - found.created_at)
        for worker in workers:
            worker.stop()
        await asyncio.gather(*running)
        for client in clients.values():
            await client.aclose()
        on, off = bc.median(latencies["on"]), bc.median(latencies["off"])
        paired = [a / b for a, b in zip(latencies["on"], latencies["off"], strict=True)]
        return {"reps": len(latencies["on"]), "median_on_s": round(on, 4),
                "median_off_s": round(off, 4), "ratio": round(on / off, 4),
                "paired_ratio": round(bc.median(paired), 4),
                "p99_on_s": round(bc.percentile(latencies["on"], 99), 4),
                "p99_off_s": round(bc.percentile(latencies["off"], 99), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default=bc.FW)
    parser.add_argument("--source", default="bundled", help="the model (dir, file, bundled)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tasks", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=8.0, help="clip length")
    parser.add_argument("--sizes", default="1,2,4,8")
    parser.add_argument("--reps", type=int, default=40, help="one-stream tasks a mode")
    args = parser.parse_args()
    started = {"machine": bc.machine(), "revision": bc.git_revision()}
    with tempfile.TemporaryDirectory() as tmp:
        redis = procs.RedisServer(Path(tmp) / "redis", appendonly=False).start()
        try:
            bench = Bench(args, redis.url)
            audios = clips(args.tasks, args.seconds)
            rows = [asyncio.run(bench.drain(audios, int(size)))
                    for size in args.sizes.split(",")]
            stream = asyncio.run(bench.one_stream(audios[0], args.reps))
        finally:
            redis.stop()
    base = rows[0]["texts"]
    for row in rows:
        texts = row.pop("texts")
        row["same_text"] = f"{sum(a == b for a, b in zip(base, texts, strict=True))}/{len(base)}"
    bc.table(f"{args.backend} on {args.device}: {args.tasks} clips of {args.seconds} s, "
                   "greedy", ["batch max", "mean batch", "tasks/s", "audio s/s", "p50 s",
                              "p99 s", "same text"],
                   [[r["batch_max"], r["mean_batch"], r["tasks_per_s"], r["audio_s_per_s"],
                     r["latency_p50_s"], r["latency_p99_s"], r["same_text"]] for r in rows])
    bc.table("one stream, batching on (50 ms) vs off",
                   ["reps", "median on s", "median off s", "ratio", "paired ratio",
                    "p99 on s", "p99 off s"],
                   [[stream["reps"], stream["median_on_s"], stream["median_off_s"],
                     stream["ratio"], stream["paired_ratio"], stream["p99_on_s"],
                     stream["p99_off_s"]]])
    print(f"B=1 overhead: {bc.verdict(stream['paired_ratio'], 1.02, at_most=True)}")
    payload = {"backend": args.backend, "device": args.device, "sizes": rows,
               "one_stream": stream}
    print(bc.write_json(f"{NAME}-{args.backend}-{args.device}", payload, started))


if __name__ == "__main__":
    bc.run(main)
