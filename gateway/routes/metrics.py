"""`GET /metrics`: Prometheus text, built from what workers record in Redis on every host
(read in one `common.store.metrics.snapshot`), and each key's all-time usage (kept in Redis
too, so every gateway replica reports the same numbers)."""

from __future__ import annotations

from collections.abc import Iterable

from fastapi import APIRouter
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

from common.api_keys import USAGE_UNITS
from common.catalog import enabled_backends, guarded
from common.settings import Settings
from common.store import StoreError, TaskStore
from common.store.metrics import BUCKETS, Snapshot, snapshot
from gateway.auth import METRICS_ROUTE
from gateway.dependencies import SettingsDep, StoreDep
from gateway.policy.quotas import UNIT_NAMES

#: its own access rule (the metrics token, or a key): see create_app
router = APIRouter(tags=["Operations"])
COUNTERS = {
    "worker_starts": "Worker processes started (a respawn counts again)",
    "worker_reexecs": "Workers that re-exec'd themselves after an idle unload (same pid)",
    "load_failures": "Model loads that failed (each ended its worker)",
    "dead_lettered": "Tasks failed after exhausting their deliveries",
    "store_refusals": "Redis writes a worker gave up on (refused, or Redis gone too long)",
    "unreplicated_writes": "Terminal writes no replica confirmed in time (SPEECH_REDIS_WAIT_*)",
}


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterable[Metric]:
        return self.families


@router.get(METRICS_ROUTE, response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}}})
async def metrics(settings: SettingsDep, store: StoreDep) -> Response:
    try:
        families = _families(await snapshot(store, {name: guarded(settings, name)
                                                    for name in enabled_backends(settings)}))
        families += await _usage_families(settings, store)
    except StoreError:
        up = GaugeMetricFamily("speech_redis_up", "Whether the gateway reaches Redis")
        up.add_metric([], 0)
        families = [up]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))  # type: ignore[arg-type]
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


def _families(found: Snapshot) -> list[Metric]:
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
    for backend, seen in found.backends.items():
        waiting.add_metric([backend], seen.waiting)
        running.add_metric([backend], seen.pending)
        for outcome in ("SUCCEEDED", "FAILED"):
            tasks.add_metric([backend, outcome], seen.counters.get(f"tasks_{outcome}", 0))
        for name, family in counters.items():
            family.add_metric([backend], seen.counters.get(name, 0))
        for name, histogram in seen.histograms.items():
            buckets = [(str(bound), count) for bound, count in histogram.buckets]
            buckets.append(("+Inf", histogram.count))
            histograms[name].add_metric([backend], buckets, sum_value=histogram.sum)
    live = GaugeMetricFamily("speech_workers_live", "Workers with a fresh heartbeat",
                             labels=["backend"])
    rss = GaugeMetricFamily("speech_worker_rss_mib", "Worker resident memory",
                            labels=["backend", "consumer"])
    gpu = GaugeMetricFamily("speech_worker_gpu_reserved_mib", "Worker GPU memory reserved",
                            labels=["backend", "consumer"])
    loaded = GaugeMetricFamily("speech_worker_model_loaded", "1 for each resident model",
                               labels=["backend", "consumer", "model"])
    per_backend = dict.fromkeys(found.backends, 0)
    for worker in found.workers:
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
    for backend, model, is_open in found.breakers:
        breaker.add_metric([backend, model], float(is_open))
    webhooks = CounterMetricFamily("speech_webhook_deliveries", "Webhook delivery attempts by "
                                   "outcome: delivered (2xx), failed (retried), gave_up (last)",
                                   labels=["outcome"])
    for outcome, count in found.webhooks.items():
        webhooks.add_metric([outcome], count)
    return [up, waiting, running, tasks, *counters.values(), *histograms.values(), live, rss,
            gpu, loaded, breaker, *_device_families(found), webhooks]


async def _usage_families(settings: Settings, store: TaskStore) -> list[Metric]:
    """Per key and backend: the audio-seconds and characters of its SUCCEEDED tasks. A key is
    labelled by its name (else its owner id, 16 hex of its digest; never the key itself);
    with keys off, every caller is "anonymous"."""
    labels = {entry.owner: entry.label for entry in settings.api_keys} or {"": "anonymous"}
    families = {unit: CounterMetricFamily(f"speech_usage_{unit}",
                                          f"{UNIT_NAMES[unit].capitalize()} of succeeded tasks, "
                                          "per API key", labels=["key", "backend"])
                for unit in USAGE_UNITS}
    for owner, used in (await store.usage.totals(list(labels))).items():
        for (unit, backend), amount in sorted(used.items()):
            if unit in families:
                families[unit].add_metric([labels[owner], backend], amount)
    return list(families.values())


def _device_families(found: Snapshot) -> list[Metric]:
    """The device memory broker: per device, its budget and how it is used."""
    gauges = {name: GaugeMetricFamily(f"speech_device_{name}", doc, labels=["device"])
              for name, doc in (("budget_mib", "Device memory the models may reserve"),
                                ("reserved_mib", "Device memory reserved by loaded models"),
                                ("free_mib", "Device memory not reserved"),
                                ("waiting_loads", "Model loads waiting for device memory"))}
    evictions = CounterMetricFamily("speech_device_evictions",
                                    "Idle models unloaded to make room for another's load",
                                    labels=["device"])
    for device in found.devices:
        gauges["budget_mib"].add_metric([device.device], device.budget_mib)
        gauges["reserved_mib"].add_metric([device.device], device.reserved_mib)
        gauges["free_mib"].add_metric([device.device], device.free_mib)
        gauges["waiting_loads"].add_metric([device.device], len(device.waiting))
        evictions.add_metric([device.device], device.evictions)
    return [*gauges.values(), evictions]
