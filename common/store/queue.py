"""A worker's side of a backend's stream: read, claim, extend the lease, dead-letter.

Delivery is at-least-once: an entry stays in the group's pending list until the task's
terminal state is stored (see TaskStore.finish). A crashed worker's entries come back
through its own restart (same consumer name) or another worker's XAUTOCLAIM.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from redis.asyncio import Redis

from common import keys

# KEYS: queue | ARGV: group, consumer, entry -> 1 if the lease was extended (we still own it)
_EXTEND_LEASE = """
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #pending == 0 or pending[1][2] ~= ARGV[2] then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'JUSTID')
return 1
"""


@dataclass(frozen=True, slots=True)
class Delivery:
    entry_id: str
    task_id: str | None  # None: the entry was deleted (its task was cancelled)


class Queue:
    def __init__(self, redis: Redis, backend: str, consumer: str) -> None:
        self.redis = redis
        self.backend = backend
        self.stream = keys.queue(backend)
        self.consumer = consumer
        self._extend = redis.register_script(_EXTEND_LEASE)

    async def read(self, *, after: str | None = None,
                   block_ms: int | None = 1000) -> list[Delivery]:
        """With `after`: our own unacked entries past that id (re-read after a restart).
        Without: one new entry, waiting up to `block_ms` (None: not at all)."""
        reply = await self.redis.xreadgroup(
            keys.WORKER_GROUP, self.consumer, {self.stream: after or ">"}, count=1,
            block=None if after else block_ms)
        return [_delivery(entry_id, fields) for _, entries in reply or []
                for entry_id, fields in entries]

    async def claim_abandoned(self, min_idle_seconds: float) -> list[Delivery]:
        """Take over one entry whose worker stopped extending its lease."""
        reply = await self.redis.xautoclaim(self.stream, keys.WORKER_GROUP, self.consumer,
                                            min_idle_time=int(min_idle_seconds * 1000),
                                            start_id="0-0", count=1)
        return [_delivery(entry_id, fields) for entry_id, fields in reply[1]]

    async def extend_lease(self, entry_id: str) -> bool:
        return bool(await self._extend(keys=[self.stream],
                                       args=[keys.WORKER_GROUP, self.consumer, entry_id]))

    async def deliveries(self, entry_id: str) -> int:
        pending = await self.redis.xpending_range(self.stream, keys.WORKER_GROUP, min=entry_id,
                                                  max=entry_id, count=1)
        return int(pending[0]["times_delivered"]) if pending else 1

    async def ack(self, entry_id: str) -> None:
        await self.redis.xack(self.stream, keys.WORKER_GROUP, entry_id)

    async def dead_letter(self, task_id: str, reason: str, deliveries: int) -> None:
        await self.redis.xadd(keys.dead_letter(self.backend),
                              {"task_id": task_id, "reason": reason,
                               "deliveries": deliveries, "at": repr(time.time())})


def _delivery(entry_id: bytes, fields: dict[bytes, bytes] | None) -> Delivery:
    task_id = fields.get(b"task_id") if fields else None
    return Delivery(entry_id.decode(), task_id.decode() if task_id else None)
