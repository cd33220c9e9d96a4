"""Liveness and readiness (public), and the public configuration (behind the key)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from common.catalog import enabled_backends, guarded, public_config
from common.store import BreakerPolicy, StoreError
from gateway.auth import is_authenticated
from gateway.dependencies import SettingsDep, StoreDep

#: no key needed: what a load balancer or scripts/run_stack.sh probe
public = APIRouter(tags=["Health"])
router = APIRouter(tags=["Health"])
#: what /ready shows of a live worker only to a caller with a valid key (or with keys off);
#: a breaker's load error, its loaded models and the broker's holders likewise
PRIVATE_LIVE_FIELDS = frozenset({"url", "pid"})


@public.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@public.get("/ready")
async def ready(request: Request, settings: SettingsDep, store: StoreDep) -> JSONResponse:
    """200 whenever Redis answers: the gateway can queue tasks (a worker that restarts picks
    them up), and scripts/run_stack.sh waits for exactly that. Per backend, `ready` says
    whether a worker is live, and `breakers` how each model's breaker stands. Per device of
    the memory broker: its budget, what is reserved and free, the loads waiting in line
    (first first), the evictions so far, and the loads refused as larger than the whole
    budget (until one fits again). Per live worker: its batch settings (`batch`: enabled,
    max_size, window_ms)."""
    private = is_authenticated(request, settings)
    backends: dict[str, Any] = {name: _backend() for name in enabled_backends(settings)}
    try:
        await store.ping()
        workers = await store.live.snapshots()
        devices = {view.device: _device_view(view.public(), private)
                   for view in await store.devices()}
        policy = BreakerPolicy.of(settings)
        for name, entry in backends.items():
            breakers = await store.breakers.read(name, guarded(settings, name), policy)
            entry["breakers"] = {model: _breaker_view(b.public(), private)
                                 for model, b in breakers.items()}
    except StoreError as exc:
        return JSONResponse({"ready": False, "redis": False, "error": type(exc).__name__,
                             "backends": backends}, status_code=503)
    hidden = frozenset() if private else PRIVATE_LIVE_FIELDS | {"loaded_models"}
    for worker in workers:
        entry = backends.setdefault(worker["backend"], _backend())
        entry["ready"] = True
        entry["workers"] += 1
        entry["consumers"].append(worker["consumer"])
        entry["live"].append({k: worker.get(k) for k in ("consumer", "url", "pid", "state",
                                                          "loaded_models", "batch")
                               if k not in hidden})
    return JSONResponse({"ready": True, "redis": True, "backends": backends,
                         "devices": devices})


def _device_view(device: dict[str, Any], private: bool) -> dict[str, Any]:
    """Who holds or waits for a device's memory (consumers, models) is for a key holder;
    the totals are for anyone."""
    return device if private else {k: v for k, v in device.items()
                                   if k not in ("holders", "waiting", "refused", "lapsed")}


def _breaker_view(breaker: dict[str, Any], private: bool) -> dict[str, Any]:
    """A load error can name server paths: only a caller with a key sees it."""
    return breaker if private else {k: v for k, v in breaker.items() if k != "error"}


def _backend() -> dict[str, Any]:
    return {"ready": False, "workers": 0, "consumers": [], "live": [], "breakers": {}}


@router.get("/api/config")
async def config(settings: SettingsDep) -> dict[str, Any]:
    """Backends, models, aliases, voices and limits: what every client builds its choices from."""
    return public_config(settings)
