"""The gateway: HTTP only. Validates requests, writes tasks to Redis, reads their state."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.asyncio import BlockingConnectionPool, Redis
from starlette.exceptions import HTTPException

from common import logs
from common.settings import Settings, get_settings
from common.store import TaskStore
from gateway.app_errors import openai_error, sage_error
from gateway.auth import authorize
from gateway.inputs import RequestError
from gateway.limits import BodyLimitMiddleware
from gateway.routes import admin, docs, health, metrics, openai, sage, speech, tasks, ui
from gateway.sweeper import sweep_forever
from gateway.waiting import EventHub

log = logging.getLogger("gateway")


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    logs.configure("gateway", settings.log_level)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # bounded: past `redis_max_connections` a call waits briefly for a free connection
        # instead of opening more (redis-py's default pool refuses with an error at 100)
        pool = BlockingConnectionPool.from_url(
            settings.redis_url, max_connections=settings.redis_max_connections,
            timeout=settings.redis_pool_timeout_seconds, socket_connect_timeout=2,
            socket_timeout=10, health_check_interval=15, client_name=f"gateway-{os.getpid()}")
        redis = Redis.from_pool(pool)
        hub = EventHub(redis, settings.max_waiting_requests)
        await hub.start()
        app.state.hub = hub
        app.state.settings = settings
        app.state.redis = redis
        app.state.store = TaskStore.for_settings(redis, settings)
        sweeper = asyncio.create_task(sweep_forever(app.state.store, settings))
        yield
        sweeper.cancel()
        await hub.close()
        await redis.aclose()

    # one access rule for every route (gateway/auth.py); the API docs are ordinary routes
    app = FastAPI(title="speech-gateway", lifespan=lifespan, dependencies=[Depends(authorize)],
                  docs_url=None, redoc_url=None, openapi_url=None)
    # multipart overhead on top of the largest allowed file
    app.add_middleware(BodyLimitMiddleware,
                       max_bytes=int(settings.max_upload_mib * 1024 * 1024) + 64 * 1024,
                       idle_seconds=settings.body_timeout_seconds,
                       deadline_seconds=settings.body_deadline_seconds)
    app.include_router(health.router)
    app.include_router(sage.router)
    app.include_router(tasks.router)
    app.include_router(openai.router)
    app.include_router(speech.router)
    app.include_router(metrics.router)
    app.include_router(docs.router)
    app.include_router(admin.router)
    app.include_router(ui.router)

    @app.exception_handler(RequestError)
    async def refused(request: Request, exc: RequestError) -> JSONResponse:
        return openai_error(exc) if request.url.path.startswith("/v1/") else sage_error(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(request, 400, "invalid request: " + "; ".join(
            f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        return error_response(request, exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unhandled error on %s", request.url.path)
        return error_response(request, 500, f"internal error ({type(exc).__name__})")

    return app


def error_response(request: Request, status_code: int, message: str) -> JSONResponse:
    """Errors in the caller's dialect: OpenAI shape under /v1/, Sage shape elsewhere."""
    exc = RequestError(status_code, message)
    return openai_error(exc) if request.url.path.startswith("/v1/") else sage_error(exc)
