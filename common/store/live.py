"""Which workers are alive: the live sets their heartbeats keep (keys.live: consumer ->
expiry on Redis's clock, so hosts with skewed clocks agree), read without a scan."""

from __future__ import annotations

import json
from typing import Any

from redis.asyncio import Redis

from common import keys
from common.backends import BACKENDS
from common.store.values import LUA_NOW_MS, text

# KEYS: each backend's live set -> {backend's index (from 1), consumer, ...} for every
# worker whose heartbeat has not expired
_CONSUMERS = LUA_NOW_MS + """
local found = {}
for index, key in ipairs(KEYS) do
  for _, consumer in ipairs(redis.call('ZRANGEBYSCORE', key, now, '+inf')) do
    table.insert(found, index)
    table.insert(found, consumer)
  end
end
return found
"""

# KEYS: live set -> workers whose heartbeat has not expired (O(log n))
_COUNT = LUA_NOW_MS + """
return redis.call('ZCOUNT', KEYS[1], now, '+inf')
"""


class LiveWorkers:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._consumers = redis.register_script(_CONSUMERS)
        self._count = redis.register_script(_COUNT)

    async def consumers(self) -> list[tuple[str, str]]:
        """(backend, consumer) of every live worker."""
        backends = list(BACKENDS)
        found = await self._consumers(keys=[keys.live(name) for name in backends])
        return [(backends[int(index) - 1], text(consumer))
                for index, consumer in zip(found[::2], found[1::2], strict=True)]

    async def snapshots(self) -> list[dict[str, Any]]:
        """The health snapshot of every live worker."""
        names = [keys.heartbeat(backend, consumer)
                 for backend, consumer in await self.consumers()]
        if not names:
            return []
        return [json.loads(raw) for raw in await self.redis.mget(names) if raw]

    async def count(self, backend: str) -> int:
        """Live workers of `backend`."""
        return int(await self._count(keys=[keys.live(backend)]))
