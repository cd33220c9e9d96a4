"""Why a Sage submit was refused, kept for its refusal id's status polls (gateway/errors.py,
SAGE_SUBMIT_ROUTES). Best effort by design: a refusal is often the store's own outage, so
a write or read that fails, or takes longer than WAIT_SECONDS, is skipped, and the poll
answers from what the id itself says (its HTTP status and code).
"""

from __future__ import annotations

import asyncio
import contextlib

from redis.asyncio import Redis
from redis.exceptions import RedisError

from common import keys

#: the longest a refusal's reply waits on Redis (a failover in progress would hold it)
WAIT_SECONDS = 0.5
#: the longest message kept (a refusal listing every language code runs long)
MAX_MESSAGE = 1000


class Refusals:
    def __init__(self, redis: Redis, retention_seconds: int) -> None:
        self.redis = redis
        self.retention = retention_seconds

    async def remember(self, token: str, message: str) -> None:
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await asyncio.wait_for(self.redis.set(keys.refusal(token), message[:MAX_MESSAGE],
                                                  ex=self.retention), WAIT_SECONDS)

    async def recall(self, token: str) -> str | None:
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            found = await asyncio.wait_for(self.redis.get(keys.refusal(token)), WAIT_SECONDS)
            return found.decode() if isinstance(found, bytes) else found
        return None
