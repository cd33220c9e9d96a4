"""Service metrics kept in Redis, so workers on any host feed the gateway's /metrics.

Workers `record`; the gateway reads a `snapshot` and renders it (gateway/routes/metrics.py).
Histograms are hashes of cumulative-bucket counters plus `sum` and `count`, updated with
HINCRBY(FLOAT).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from redis.asyncio import Redis

from common import keys
from common.store import webhooks
from common.store.breakers import BreakerPolicy
from common.store.devices import DeviceView, devices

if TYPE_CHECKING:
    from common.store.tasks import TaskStore

BUCKETS: dict[str, tuple[float, ...]] = {
    "queue_wait_seconds": (0.005, 0.01, 0.05, 0.1, 0.5, 1, 5, 15, 60, 300, 1800),
    "model_load_seconds": (0.1, 0.5, 1, 2, 5, 10, 30, 60, 120, 300),
    #: a load's wait in line for device memory (the broker), before the load itself
    "device_wait_seconds": (0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 300, 1800),
    "inference_seconds": (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800),
    "end_to_end_seconds": (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 1800),
    "realtime_factor": (0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2, 5),
    #: tasks per engine call, where the engine batches (workers/batching.py); 1 = alone
    "batch_size": (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64),
    #: how long a batch waited for company after its first task was read
    "batch_window_wait_seconds": (0.0005, 0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1,
                                  5),
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


# --- the gateway's side: one read of everything /metrics shows -----------------------------

@dataclass(frozen=True, slots=True)
class Histogram:
    buckets: list[tuple[float, float]]  # (upper bound, cumulative count), as in BUCKETS
    count: float
    sum: float


@dataclass(slots=True)
class BackendMetrics:
    waiting: int  # entries not yet handed to a worker
    pending: int  # handed to a worker, not yet acked
    counters: dict[str, int]  # tasks_SUCCEEDED, tasks_FAILED, worker_starts, load_failures …
    histograms: dict[str, Histogram]


@dataclass(slots=True)
class Snapshot:
    backends: dict[str, BackendMetrics]
    workers: list[dict[str, Any]]  # live workers' heartbeat snapshots
    breakers: list[tuple[str, str, bool]] = field(default_factory=list)  # backend, model, open
    devices: list[DeviceView] = field(default_factory=list)  # the memory broker's devices
    webhooks: dict[str, int] = field(default_factory=dict)  # delivery attempts by outcome


async def snapshot(store: TaskStore, backends: dict[str, dict[str, str]]) -> Snapshot:
    """What every process recorded, the queues, the live workers and the breakers of each
    backend's configured models (backend -> {model -> source}), read by name: no SCAN, so a
    scrape costs the same however many keys Redis holds (a StoreError when Redis does not
    answer)."""
    redis = store.redis
    per_backend: dict[str, BackendMetrics] = {}
    for backend in backends:
        waiting, pending = await store.positions.depth(backend)
        counters = {k.decode(): int(v)
                    for k, v in (await redis.hgetall(keys.counters(backend))).items()}
        histograms = {}
        for name, bounds in BUCKETS.items():
            raw = {k.decode(): float(v) for k, v in
                   (await redis.hgetall(keys.histogram(backend, name))).items()}
            histograms[name] = Histogram([(b, raw.get(repr(float(b)), 0.0)) for b in bounds],
                                         raw.get("count", 0.0), raw.get("sum", 0.0))
        per_backend[backend] = BackendMetrics(waiting, pending, counters, histograms)
    found = Snapshot(per_backend, await store.live.snapshots())
    for backend, sources in backends.items():
        breakers = await store.breakers.read(backend, sources, BreakerPolicy())
        found.breakers.extend((backend, model, breaker.state != "closed")
                              for model, breaker in breakers.items())
    found.devices = await devices(redis)
    found.webhooks = await webhooks.counters(redis)
    return found
