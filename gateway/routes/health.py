"""Liveness, readiness and the public configuration."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from redis.exceptions import RedisError

from common.catalog import enabled_backends, public_config
from common.store import live_workers
from gateway.state import redis_of, settings_of

router = APIRouter()


@router.get("/health")
async def health() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/ready")
async def ready(request: Request) -> JSONResponse:
    """200 when Redis answers; lists which backends have a live worker."""
    redis = redis_of(request)
    backends: dict[str, Any] = {
        name: {"workers": 0, "consumers": [], "live": []}
        for name in enabled_backends(settings_of(request))
    }
    try:
        await redis.ping()
        workers = await live_workers(redis)
    except RedisError as exc:
        return JSONResponse({"ready": False, "redis": False, "error": type(exc).__name__,
                             "backends": backends}, status_code=503)
    for worker in workers:
        entry = backends.setdefault(worker["backend"], {"workers": 0, "consumers": [], "live": []})
        entry["workers"] += 1
        entry["consumers"].append(worker["consumer"])
        entry["live"].append({k: worker.get(k) for k in ("consumer", "url", "pid", "state",
                                                          "loaded_models")})
    return JSONResponse({"ready": True, "redis": True, "backends": backends})


@router.get("/api/config")
async def config(request: Request) -> dict[str, Any]:
    return public_config(settings_of(request))
