"""Ephemeral realtime keys (`POST /v1/realtime/client_secrets`): minted by an API key, stored
under their SHA-256 with the minting key's owner and the session they open, and gone when
their TTL ends, which is their expiry (Redis refuses a lookup after it)."""

from __future__ import annotations

import hashlib
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from common import keys
from common.store.tasks import TaskStore

PREFIX = "ek_"


@dataclass(frozen=True, slots=True)
class ClientSecret:
    owner: str
    session: dict[str, Any]  # the session.update `session` the key's sessions start with
    expires_at: int  # epoch seconds


class ClientSecretStore:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis

    @classmethod
    def of(cls, store: TaskStore) -> ClientSecretStore:
        return cls(store.redis)

    async def mint(self, owner: str, session: dict[str, Any], seconds: int) -> tuple[str, int]:
        """A new key and its expiry (epoch seconds)."""
        value = PREFIX + secrets.token_urlsafe(24)
        expires_at = int(time.time()) + seconds
        record = {"owner": owner, "session": session, "expires_at": expires_at}
        await self.redis.set(keys.client_secret(_digest(value)), json.dumps(record), ex=seconds)
        return value, expires_at

    async def lookup(self, value: str) -> ClientSecret | None:
        """The key's record while it lives; None once expired (or never minted)."""
        raw = await self.redis.get(keys.client_secret(_digest(value)))
        if raw is None:
            return None
        record = json.loads(raw)
        if record["expires_at"] <= time.time():  # Redis's TTL has a second's granularity
            return None
        return ClientSecret(record["owner"], record["session"], int(record["expires_at"]))


def is_client_secret(key: str) -> bool:
    return key.startswith(PREFIX)


def _digest(value: str) -> str:
    return hashlib.sha256(value.encode()).hexdigest()
