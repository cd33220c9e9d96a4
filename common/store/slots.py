"""Leased slots: at most N holders of one name across every gateway process (a key's live
sessions, its webhook deliveries on the way). A holder renews its slot while it holds it;
a slot lapses one lease after its last renewal, so a process that dies frees its slots by
itself, and nothing needs to be cleaned up after a crash."""

from __future__ import annotations

from redis.asyncio import Redis

from common import keys
from common.store.values import LUA_NOW_S

# KEYS: the slots (sorted set: holder -> lease end, Redis's clock) | ARGV: holder, most, lease
# -> 1 taken or renewed | 0 full. A holder already in renews whatever the count.
_TAKE = LUA_NOW_S + """
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local lease = tonumber(ARGV[3])
if not redis.call('ZSCORE', KEYS[1], ARGV[1])
   and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[2]) then
  return 0
end
redis.call('ZADD', KEYS[1], now + lease, ARGV[1])
-- the set lives as long as its longest lease: a shorter one must not end the others early
local ms = math.ceil(lease * 1000)
if redis.call('PTTL', KEYS[1]) < ms then redis.call('PEXPIRE', KEYS[1], ms) end
return 1
"""


class SlotStore:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._take = redis.register_script(_TAKE)

    async def take(self, kind: str, owner: str, holder: str, most: int,
                   lease_seconds: float) -> bool:
        """Take (or renew) `holder`'s slot of `owner`'s `kind`; False when `most` are held."""
        return bool(await self._take(keys=[keys.slots(kind, owner)],
                                     args=[holder, most, lease_seconds]))

    async def give_back(self, kind: str, owner: str, holder: str) -> None:
        await self.redis.zrem(keys.slots(kind, owner), holder)
