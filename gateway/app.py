"""The gateway: HTTP only. Validates requests, writes tasks to the store, reads their state."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from functools import partial

from fastapi import APIRouter, Depends, FastAPI
from starlette.types import Receive, Scope, Send

from common import logs
from common.settings import Settings, get_settings
from common.store import TaskStore
from common.store.events import EventHub
from common.store.refusals import Refusals
from common.store.running_polls import RunningPolls
from common.store.webhooks import WebhookStore
from gateway import errors
from gateway.auth import (
    PUBLIC_ROUTES,
    body_holder,
    require_key,
    require_key_or_metrics_token,
    require_key_or_signed_url,
)
from gateway.jobs import running_jobs
from gateway.process.limits import BodyLimitMiddleware
from gateway.realtime.connection import RealtimeServing
from gateway.routes import (
    admin,
    docs,
    health,
    metrics,
    openai,
    realtime,
    sage,
    speech,
    tasks,
    ui,
    usage,
    voices,
)
from gateway.serving.calls import SyncCalls
from gateway.serving.speech import SpeechServing
from gateway.serving.transcription import TranscriptionServing
from gateway.serving.voices import MAX_BODY_BYTES as VOICE_BODY_BYTES
from gateway.serving.voices import VoiceServing


class Gateway(FastAPI):
    """The app, with Sage's GET status poll answered before any of FastAPI's layers
    (gateway/routes/sage.answer_status)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if sage.is_status_poll(scope):
            scope["app"] = self  # what Starlette would set: request.app, url_for
            await sage.answer_status(self.state, scope, receive, send)
            return
        await super().__call__(scope, receive, send)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()
    logs.configure("gateway", settings.log_level)
    if settings.callback_url_hosts and not settings.webhook_secrets:
        raise RuntimeError("SPEECH_CALLBACK_URL_HOSTS is set but SPEECH_WEBHOOK_SECRETS is not: "
                           "webhooks are never sent unsigned")

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        store = TaskStore.connect(settings, client_name=f"gateway-{os.getpid()}")
        # one subscriber per process
        hub = EventHub(store, settings.max_waiting_requests, settings.stream_keepalive_seconds)
        await hub.start()
        calls = SyncCalls(settings, store, hub)
        app.state.settings = settings
        app.state.store = store
        app.state.refusals = Refusals(store.redis, store.retention)
        app.state.polls = RunningPolls(store.poll, hub, pace=settings.poll_pace_seconds)
        app.state.transcription = TranscriptionServing(calls)
        app.state.speech = SpeechServing(calls)
        app.state.realtime = RealtimeServing(calls)
        app.state.voices = VoiceServing(calls)
        app.state.webhooks = WebhookStore.of(store)
        async with running_jobs(store, app.state.webhooks, settings):
            yield
        await hub.close()
        await store.close()

    # the API docs are ordinary routes (gateway/routes/docs.py), behind the key like the rest
    app = Gateway(title="speech-gateway", lifespan=lifespan,
                  docs_url=None, redoc_url=None, openapi_url=None)
    app.openapi = partial(docs.openapi_schema, app)  # type: ignore[method-assign]
    app.add_middleware(BodyLimitMiddleware,
                       max_bytes=settings.max_body_bytes,
                       idle_seconds=settings.body_timeout_seconds,
                       deadline_seconds=settings.body_deadline_seconds,
                       error_reply=errors.refusal_reply,
                       # (/v1/audio/voices and /v1/audio/voice_consents)
                       path_limits={"/v1/audio/voice": VOICE_BODY_BYTES},
                       budget_bytes=int(settings.upload_budget_mib * 2**20),
                       # each key its share (with keys off, one caller: no share)
                       holder=body_holder if settings.api_keys else None,
                       holder_share=settings.realtime_key_share)

    # anyone: liveness, readiness, the try-it page's files (exactly auth.PUBLIC_ROUTES)
    public = [health.public, ui.router]
    # a client key when keys are on; each refusal is a 401 in the caller's dialect
    protected = [sage.router, openai.router, realtime.router, speech.router, tasks.router,
                 usage.router, admin.router, health.router, docs.router, voices.router]
    _check_public(public)
    for router in public:
        app.include_router(router)
    for router in protected:
        app.include_router(router, dependencies=[Depends(require_key)])
    # their own credential besides a key: a Prometheus token, a signed audio URL
    app.include_router(metrics.router, dependencies=[Depends(require_key_or_metrics_token)])
    app.include_router(speech.audio_router, dependencies=[Depends(require_key_or_signed_url)])
    # the live-transcription WebSocket checks its key itself (header or subprotocol) and
    # refuses with close code 1008 (gateway/auth.py's websocket_caller)
    app.include_router(realtime.socket_router)

    errors.install(app)
    return app


def _check_public(routers: list[APIRouter]) -> None:
    """A route added to a public router must be listed in auth.PUBLIC_ROUTES, so the one
    list of what needs no key stays true (tests/test_auth_routes.py walks it)."""
    paths = {getattr(route, "path", "") for router in routers for route in router.routes}
    if paths != PUBLIC_ROUTES:
        raise RuntimeError(f"public routes {sorted(paths)} differ from auth.PUBLIC_ROUTES "
                           f"{sorted(PUBLIC_ROUTES)}")
