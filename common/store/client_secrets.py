"""Ephemeral realtime keys (`POST /v1/realtime/client_secrets`): minted by an API key, stored
under their SHA-256 with the minting key's owner and the session they open, and gone when
their TTL ends, which is their expiry (Redis refuses a lookup after it)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import secrets
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from common import keys
from common.store.slots import SlotStore
from common.store.tasks import TaskStore

PREFIX = "ek_"
#: the slots kind (common/store/slots.py) that counts an owner's live keys
SLOTS = "client-secrets"


class TooManySecrets(Exception):
    """The owner has its most keys alive at once."""


@dataclass(frozen=True, slots=True)
class ClientSecret:
    owner: str
    session: dict[str, Any]  # the session.update `session` the key's sessions start with
    expires_at: int  # epoch seconds


class ClientSecretStore:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self.slots = SlotStore(redis)

    @classmethod
    def of(cls, store: TaskStore) -> ClientSecretStore:
        return cls(store.redis)

    async def mint(self, owner: str, session: dict[str, Any], seconds: int,
                   most: int = 0) -> tuple[str, int]:
        """A new key and its expiry (epoch seconds); TooManySecrets when `owner` already has
        `most` alive (0: no bound). Each holds a slot for its lifetime (a key is not revoked
        early, so its slot is not given back)."""
        value = PREFIX + secrets.token_urlsafe(24)
        digest = _digest(value)
        if most and not await self.slots.take(SLOTS, owner, digest, most, seconds):
            raise TooManySecrets(most)
        expires_at = int(time.time()) + seconds
        record = {"owner": owner, "session": session, "expires_at": expires_at}
        try:
            await self.redis.set(keys.client_secret(digest),
                                 json.dumps(record, ensure_ascii=False), ex=seconds)
        except BaseException:
            if most:  # no key was made: its slot must not count for its lifetime
                with contextlib.suppress(Exception):
                    await self.slots.give_back(SLOTS, owner, digest)
            raise
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
