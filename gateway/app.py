"""The gateway: HTTP only. Validates requests, writes tasks to Redis, reads their state."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.asyncio import Redis
from starlette.exceptions import HTTPException

from common import logs
from common.settings import Settings, get_settings
from common.store import TaskStore
from gateway.app_errors import openai_error, sage_error
from gateway.inputs import RequestError
from gateway.limits import BodyLimitMiddleware
from gateway.routes import health, metrics, openai, sage, speech, tasks
from gateway.sweeper import sweep_forever

log = logging.getLogger("gateway")


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    logs.configure("gateway", settings.log_level)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        redis = Redis.from_url(settings.redis_url, socket_connect_timeout=2, socket_timeout=10,
                               health_check_interval=15)
        app.state.settings = settings
        app.state.redis = redis
        app.state.store = TaskStore(redis, settings.retention_seconds)
        sweeper = asyncio.create_task(sweep_forever(app.state.store, settings))
        yield
        sweeper.cancel()
        await redis.aclose()

    app = FastAPI(title="speech-gateway", lifespan=lifespan)
    # multipart overhead on top of the largest allowed file
    app.add_middleware(BodyLimitMiddleware,
                       max_bytes=int(settings.max_upload_mib * 1024 * 1024) + 64 * 1024)
    app.include_router(health.router)
    app.include_router(sage.router)
    app.include_router(tasks.router)
    app.include_router(openai.router)
    app.include_router(speech.router)
    app.include_router(metrics.router)

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
