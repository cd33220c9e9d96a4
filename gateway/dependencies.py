"""Typed dependencies: what the app's lifespan built, for routes to declare instead of
fetching it from `request.app.state` themselves (`settings: SettingsDep`). The caller's
identity is `gateway.auth.Owner`; the OpenAI routes' serving objects are declared next to
their routers.

Each is an `async def`: FastAPI runs a plain `def` dependency in its thread pool, a hop that
costs a status poll more than its Redis call."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from common.settings import Settings
from common.store import TaskStore
from common.store.running_polls import RunningPolls
from common.store.webhooks import WebhookStore


async def app_settings(request: Request) -> Settings:
    return request.app.state.settings


async def app_store(request: Request) -> TaskStore:
    return request.app.state.store


async def app_polls(request: Request) -> RunningPolls:
    return request.app.state.polls


async def app_webhooks(request: Request) -> WebhookStore:
    return request.app.state.webhooks


SettingsDep = Annotated[Settings, Depends(app_settings)]
StoreDep = Annotated[TaskStore, Depends(app_store)]
PollsDep = Annotated[RunningPolls, Depends(app_polls)]
WebhooksDep = Annotated[WebhookStore, Depends(app_webhooks)]
