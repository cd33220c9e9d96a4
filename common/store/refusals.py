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
#: the most reasons kept for one owner per retention window: a loop of refused submits
#: (they cost nothing) would otherwise fill Redis with ~1 KB a refusal; past it the ids still
#: poll FAILED, with the reason their status and code give. Keys off (owner ""): one
#: trusted caller, not bounded
MAX_KEPT_PER_OWNER = 1000

# KEYS: the refusal, the owner's count | ARGV: message, retention, most (0: not counted)
# -> 1 kept, 0 not
_REMEMBER = """
local most = tonumber(ARGV[3])
if most > 0 then
  local kept = redis.call('INCR', KEYS[2])
  if kept == 1 then redis.call('EXPIRE', KEYS[2], ARGV[2]) end
  if kept > most then return 0 end
end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1
"""


class Refusals:
    def __init__(self, redis: Redis, retention_seconds: int) -> None:
        self.redis = redis
        self.retention = retention_seconds
        self._remember = redis.register_script(_REMEMBER)

    async def remember(self, token: str, message: str, owner: str) -> None:
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            await asyncio.wait_for(self._remember(
                keys=[keys.refusal(token), keys.refusals_kept(owner)],
                args=[message[:MAX_MESSAGE], self.retention,
                      MAX_KEPT_PER_OWNER if owner else 0]),
                WAIT_SECONDS)

    async def recall(self, token: str) -> str | None:
        with contextlib.suppress(RedisError, OSError, TimeoutError):
            found = await asyncio.wait_for(self.redis.get(keys.refusal(token)), WAIT_SECONDS)
            return found.decode() if isinstance(found, bytes) else found
        return None
