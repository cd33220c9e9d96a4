"""Service metrics kept in Redis, so workers on any host feed the gateway's /metrics.

Workers record; the gateway renders (gateway/routes/metrics.py). Histograms are hashes of
cumulative-bucket counters plus `sum` and `count`, updated with HINCRBY(FLOAT).
"""

from __future__ import annotations

from redis.asyncio import Redis

from common import keys

BUCKETS: dict[str, tuple[float, ...]] = {
    "queue_wait_seconds": (0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 15, 60, 300, 1800),
    "model_load_seconds": (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
    "inference_seconds": (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800),
    "end_to_end_seconds": (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800),
    "realtime_factor": (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
}


async def record(redis: Redis, backend: str, counters: tuple[str, ...] = (),
                 observations: dict[str, float] | None = None) -> None:
    """Increment `counters` (tasks_SUCCEEDED, load_failures, worker_starts …) and add
    `observations` to their histograms, in one round trip."""
    pipe = redis.pipeline(transaction=False)
    for counter in counters:
        pipe.hincrby(keys.counters(backend), counter, 1)
    for metric, value in (observations or {}).items():
        key = keys.histogram(backend, metric)
        for bound in BUCKETS[metric]:
            if value <= bound:
                pipe.hincrby(key, repr(float(bound)), 1)
        pipe.hincrbyfloat(key, "sum", value)
        pipe.hincrby(key, "count", 1)
    await pipe.execute()
