"""Typed access to what the app's lifespan put on `app.state`."""

from __future__ import annotations

from fastapi import Request
from redis.asyncio import Redis

from common.settings import Settings
from common.store import TaskStore
from gateway.waiting import EventHub


def settings_of(request: Request) -> Settings:
    return request.app.state.settings


def store_of(request: Request) -> TaskStore:
    return request.app.state.store


def redis_of(request: Request) -> Redis:
    return request.app.state.redis


def hub_of(request: Request) -> EventHub:
    return request.app.state.hub
