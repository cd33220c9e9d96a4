"""An ASR task's segments as they are published: each goes out on the task's channel (what a
streaming client and a live session read) and, for a task whose client reads them so
(`streamed`: the worker passes its end, else 0), moves the task's `delivered` mark to its
end, so a task that fails after its transcript reached the client stays charged for what it
delivered (`close_usage` in usage.py). Only the running attempt publishes (a stale one's
segments would reach clients uncharged); a redelivered task publishes its segments again
from 0, and the mark only grows.
"""

from __future__ import annotations

import json
from typing import Any

from redis.asyncio import Redis

from common import keys
from common.store import fence

# KEYS: task, events | ARGV: attempt, the segment's end (seconds), the event (JSON), the worker
#       that started the attempt ("" = any)
_PUBLISH = fence.LUA + """
if not runs(KEYS[1], ARGV[1], ARGV[4]) then return 0 end
local done = tonumber(ARGV[2])
local delivered = tonumber(redis.call('HGET', KEYS[1], 'delivered') or '') or 0
if done > delivered then redis.call('HSET', KEYS[1], 'delivered', done) end
return redis.call('PUBLISH', KEYS[2], ARGV[3])
"""


class SegmentPublisher:
    def __init__(self, redis: Redis) -> None:
        self._publish = redis.register_script(_PUBLISH)

    async def publish(self, task_id: str, attempt: int, end: float,
                      event: dict[str, Any], worker: str = "") -> None:
        await self._publish(keys=[keys.task(task_id), keys.events(task_id)],
                            args=[attempt, repr(max(0.0, float(end))), json.dumps(event),
                                  worker])
