"""`GET /metrics`: Prometheus text, built from what workers record in Redis on every host."""

from __future__ import annotations

from collections.abc import Iterable

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from redis.asyncio import Redis
from redis.exceptions import RedisError

from common import keys
from common.catalog import enabled_backends
from common.store import TaskStore, live_workers
from common.store.metrics import BUCKETS
from gateway.state import redis_of, settings_of, store_of

router = APIRouter()
COUNTERS = {
    "worker_starts": "Worker processes started (a respawn counts again)",
    "load_failures": "Model loads that failed (each ended its worker)",
    "dead_lettered": "Tasks failed after exhausting their deliveries",
}


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    redis = redis_of(request)
    backends = enabled_backends(settings_of(request))
    try:
        families = await _families(redis, store_of(request), backends)
    except RedisError:
        up = GaugeMetricFamily("speech_redis_up", "Whether the gateway reaches Redis")
        up.add_metric([], 0)
        families = [up]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))  # type: ignore[arg-type]
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


async def _families(redis: Redis, store: TaskStore, backends: list[str]) -> list[Metric]:
    up = GaugeMetricFamily("speech_redis_up", "Whether the gateway reaches Redis")
    up.add_metric([], 1)
    waiting = GaugeMetricFamily("speech_queue_waiting", "Tasks not yet handed to a worker",
                                labels=["backend"])
    running = GaugeMetricFamily("speech_queue_pending", "Tasks handed to a worker, not done",
                                labels=["backend"])
    tasks = CounterMetricFamily("speech_tasks", "Finished tasks by outcome",
                                labels=["backend", "outcome"])
    counters = {name: CounterMetricFamily(f"speech_{name}", doc, labels=["backend"])
                for name, doc in COUNTERS.items()}
    histograms = {name: HistogramMetricFamily(f"speech_{name}", name.replace("_", " "),
                                              labels=["backend"]) for name in BUCKETS}
    for backend in backends:
        queued, pending = await store.queue_depth(backend)
        waiting.add_metric([backend], queued)
        running.add_metric([backend], pending)
        raw_counters = await redis.hgetall(keys.counters(backend))
        values = {k.decode(): int(v) for k, v in raw_counters.items()}
        for outcome in ("SUCCEEDED", "FAILED"):
            tasks.add_metric([backend, outcome], values.get(f"tasks_{outcome}", 0))
        for name, family in counters.items():
            family.add_metric([backend], values.get(name, 0))
        for name, bounds in BUCKETS.items():
            raw = {k.decode(): float(v) for k, v in
                   (await redis.hgetall(keys.histogram(backend, name))).items()}
            buckets = [(str(b), raw.get(repr(float(b)), 0.0)) for b in bounds]
            buckets.append(("+Inf", raw.get("count", 0.0)))
            histograms[name].add_metric([backend], buckets, sum_value=raw.get("sum", 0.0))
    live = GaugeMetricFamily("speech_workers_live", "Workers with a fresh heartbeat",
                             labels=["backend"])
    rss = GaugeMetricFamily("speech_worker_rss_mib", "Worker resident memory",
                            labels=["backend", "consumer"])
    gpu = GaugeMetricFamily("speech_worker_gpu_reserved_mib", "Worker GPU memory reserved",
                            labels=["backend", "consumer"])
    loaded = GaugeMetricFamily("speech_worker_model_loaded", "1 for each resident model",
                               labels=["backend", "consumer", "model"])
    per_backend = dict.fromkeys(backends, 0)
    for worker in await live_workers(redis):
        backend, consumer = worker["backend"], worker["consumer"]
        per_backend[backend] = per_backend.get(backend, 0) + 1
        rss.add_metric([backend, consumer], worker["memory"]["rss_mib"])
        if "gpu_reserved_mib" in worker["memory"]:
            gpu.add_metric([backend, consumer], worker["memory"]["gpu_reserved_mib"])
        for model in worker["loaded_models"]:
            loaded.add_metric([backend, consumer, model], 1)
    for backend, count in per_backend.items():
        live.add_metric([backend], count)
    breaker = GaugeMetricFamily("speech_breaker_open", "1 while a model is marked unavailable",
                                labels=["backend", "model"])
    async for key in redis.scan_iter(match=keys.breaker_pattern(), count=200):
        backend, model = keys.breaker_parts(key.decode())
        breaker.add_metric([backend, model], float(await redis.hget(key, "open") == b"1"))
    return [up, waiting, running, tasks, *counters.values(), *histograms.values(), live, rss,
            gpu, loaded, breaker]
