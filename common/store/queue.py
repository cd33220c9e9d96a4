"""A worker's side of a backend's stream: read, claim, extend the lease, dead-letter.

Delivery is at-least-once: an entry stays in the group's pending list until the task's
terminal state is stored (see TaskStore.finish). A crashed worker's entries come back
through its own restart (same consumer name) or another worker's XAUTOCLAIM.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum

from redis.asyncio import Redis

from common import keys
from common.store.values import text

#: XAUTOCLAIM calls a lane's search for abandoned entries makes a turn (10 entries each)
CLAIM_CALLS = 8

# KEYS: queue | ARGV: group, consumer, entry -> 1 the lease was extended (we still own it),
# 0 the entry is no longer pending (acked: its task is done), -1 another consumer owns it
_EXTEND_LEASE = """
local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #pending == 0 then return 0 end
if pending[1][2] ~= ARGV[2] then return -1 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'JUSTID')
return 1
"""


# KEYS: queue | ARGV: group, consumer, idle ms, entries... -> entries given back. Each entry
# still pending to this consumer is left pending, but idle for `idle ms`: another worker's
# XAUTOCLAIM takes it at once, its delivery count unchanged (JUSTID does not count one).
_RELEASE = """
local released = {}
for i = 4, #ARGV do
  local pending = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if #pending == 1 and pending[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'IDLE', ARGV[3], 'JUSTID')
    released[#released + 1] = ARGV[i]
  end
end
return released
"""

# KEYS: queue | ARGV: group, consumer -> 1 the consumer is out of the group (deleted, or it
# was not in it), 0 entries are pending to it (deleting it would drop them from the pending
# list: they would never be delivered again) or there is no stream. A consumer deleted
# while idle is made again by its next read, so a stopped worker's name, or a pod's that is
# gone, does not stay for ever.
FORGET_CONSUMER = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then return 0 end
return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2]) >= 0 and 1 or 0
"""


class Lease(Enum):
    HELD = 1  # extended: the entry is still ours
    DONE = 0  # acked: nothing left to hold
    TAKEN = -1  # another consumer claimed it (we held it past the visibility timeout)


@dataclass(frozen=True, slots=True)
class Delivery:
    entry_id: str
    task_id: str | None  # None: the entry was deleted (its task was cancelled)
    lane: str = keys.BATCH  # the lane whose stream holds the entry (acks and leases go there)
    counted: bool = False  # its task holds a share of its key's (common/store/shares.py)


class Queue:
    """Both lanes of one backend. New work: interactive, then batch; but an undelivered batch
    entry older than `promotion_seconds` goes first once this worker has taken
    `promotion_every` interactive entries since its last batch one, so an aged backlog gets
    a bounded share (one entry in promotion_every + 1) and never all of it ahead of
    interactive work, while batch is never starved."""

    def __init__(self, redis: Redis, backend: str, consumer: str,
                 promotion_seconds: float = 0.0, promotion_every: int = 4) -> None:
        self.redis = redis
        self.backend = backend
        self.streams = {lane: keys.queue(backend, lane) for lane in keys.LANES}
        self.consumer = consumer
        self.promotion_seconds = promotion_seconds
        self.promotion_every = max(1, promotion_every)
        #: interactive entries taken since the last batch one (a new worker owes batch one)
        self.interactive_run = self.promotion_every
        #: where each lane's search for abandoned entries goes on (XAUTOCLAIM's cursor)
        self._claim_from = dict.fromkeys(keys.LANES, "0-0")
        self._extend = redis.register_script(_EXTEND_LEASE)
        self._release = redis.register_script(_RELEASE)
        self._forget = redis.register_script(FORGET_CONSUMER)

    async def read(self, *, after: str | None = None, lane: str = keys.BATCH,
                   block_ms: int | None = 1000) -> list[Delivery]:
        """With `after`: our own unacked entries of `lane` past that id (re-read after a
        restart). Without: one new entry of either lane, in lane order, waiting up to
        `block_ms` (None: not at all) when both are empty."""
        if after:
            return await self._read({self.streams[lane]: after}, None)
        if (self.promotion_seconds > 0 and self.interactive_run >= self.promotion_every
                and await self._batch_overdue()):
            found = self._counted(await self._read({self.streams[keys.BATCH]: ">"}, None))
            if found:
                return found
        for lane_read in keys.LANES:
            found = self._counted(await self._read({self.streams[lane_read]: ">"}, None))
            if found:
                return found
        if block_ms is None:
            return []
        # Both empty: wait on both. Redis answers with what arrived (one entry per stream);
        # the consumer handles them interactive first.
        return self._counted(
            await self._read({self.streams[lane]: ">" for lane in keys.LANES}, block_ms))

    async def take(self, lane: str, count: int) -> list[Delivery]:
        """Up to `count` new entries of `lane`, not waiting."""
        return self._counted(await self._read({self.streams[lane]: ">"}, None, count=count))

    async def sweep(self, count: int, block_ms: int | None = None) -> list[Delivery]:
        """Up to `count` new entries of each lane in one round trip, interactive first
        (a batch gathering its company: workers/batching.py), waiting up to `block_ms` (None:
        not at all) when both are empty."""
        found = await self._read({self.streams[lane]: ">" for lane in keys.LANES}, block_ms,
                                 count=count)
        order = {lane: rank for rank, lane in enumerate(keys.LANES)}
        return self._counted(sorted(found, key=lambda delivery: order[delivery.lane]))

    def _counted(self, found: list[Delivery]) -> list[Delivery]:
        """`found`, counted into the run of interactive entries since the last batch one."""
        for delivery in found:
            interactive = delivery.lane == keys.INTERACTIVE
            self.interactive_run = self.interactive_run + 1 if interactive else 0
        return found

    async def _read(self, streams: dict[str, str], block_ms: int | None,
                    count: int = 1) -> list[Delivery]:
        lanes = {stream: lane for lane, stream in self.streams.items()}
        reply = await self.redis.xreadgroup(keys.WORKER_GROUP, self.consumer, streams, count=count,
                                            block=block_ms)
        return [_delivery(entry_id, fields, lanes[text(stream)])
                for stream, entries in reply or [] for entry_id, fields in entries]

    async def _batch_overdue(self) -> bool:
        """Whether the batch lane's head (its first entry not yet handed out) was queued more
        than `promotion_seconds` ago (its id is its add time; an entry that came in from a
        key's line carries its submit's: common/store/shares.py)."""
        stream = self.streams[keys.BATCH]
        delivered = await last_delivered(self.redis, stream)
        head = await self.redis.xrange(stream, f"({delivered}", "+", count=1)
        if not head:
            return False
        entry_id, fields = head[0]
        return queued_ms(entry_id, fields) < (time.time() - self.promotion_seconds) * 1000

    async def forget_me(self) -> None:
        """Leave the group (both lanes) unless entries are still pending to this consumer."""
        for stream in self.streams.values():
            await self._forget(keys=[stream], args=[keys.WORKER_GROUP, self.consumer])

    async def claim_abandoned(self, min_idle_seconds: float) -> list[Delivery]:
        """Take over one entry (of either lane) whose worker stopped extending its lease.
        XAUTOCLAIM looks at no more than ten pending entries a call (COUNT 1): past leased
        ones (other workers' batches), the search goes on from its cursor, a few calls a
        turn and on at the next turn, so an abandoned entry is found behind any number."""
        for lane in keys.LANES:
            for _ in range(CLAIM_CALLS):
                reply = await self.redis.xautoclaim(self.streams[lane], keys.WORKER_GROUP,
                                                    self.consumer,
                                                    min_idle_time=int(min_idle_seconds * 1000),
                                                    start_id=self._claim_from[lane], count=1)
                self._claim_from[lane] = text(reply[0])
                if reply[1]:
                    return [_delivery(entry_id, fields, lane) for entry_id, fields in reply[1]]
                if self._claim_from[lane] == "0-0":  # the whole list looked at
                    break
        return []

    async def extend_lease(self, delivery: Delivery) -> Lease:
        return Lease(int(await self._extend(keys=[self.streams[delivery.lane]],
                                            args=[keys.WORKER_GROUP, self.consumer,
                                                  delivery.entry_id])))

    async def release(self, deliveries: list[Delivery], idle_seconds: float,
                      ) -> list[Delivery]:
        """Give entries this worker took but will not run back to the others (a stop): each
        stays pending, idle for `idle_seconds`, so the next XAUTOCLAIM takes it. Those
        released: the others were acked, or another worker holds them now."""
        released: set[str] = set()
        for lane in keys.LANES:
            ids = [d.entry_id for d in deliveries if d.lane == lane]
            if ids:
                released.update(text(entry) for entry in await self._release(
                    keys=[self.streams[lane]],
                    args=[keys.WORKER_GROUP, self.consumer, int(idle_seconds * 1000), *ids]))
        return [d for d in deliveries if d.entry_id in released]

    async def deliveries(self, delivery: Delivery) -> tuple[int, bool]:
        """How many times the entry was delivered, and whether it is still ours (False once
        another consumer has claimed it)."""
        pending = await self.redis.xpending_range(self.streams[delivery.lane], keys.WORKER_GROUP,
                                                  min=delivery.entry_id, max=delivery.entry_id,
                                                  count=1)
        if not pending:
            return 1, True
        return int(pending[0]["times_delivered"]), text(pending[0]["consumer"]) == self.consumer

    async def ack(self, delivery: Delivery) -> None:
        await self.redis.xack(self.streams[delivery.lane], keys.WORKER_GROUP, delivery.entry_id)

    async def dead_letter(self, task_id: str, reason: str, deliveries: int) -> None:
        await self.redis.xadd(keys.dead_letter(self.backend),
                              {"task_id": task_id, "reason": reason,
                               "deliveries": deliveries, "at": repr(time.time())})


def queued_ms(entry_id: bytes | str, fields: dict[bytes, bytes]) -> int:
    """When an entry's task was submitted (Unix ms): its id's time, or for an entry that came
    in from a key's line, the submit time it carries (common/store/shares.py)."""
    return int(fields.get(b"queued_ms") or text(entry_id).partition("-")[0])


async def last_delivered(redis: Redis, stream: str) -> str:
    """The id of the last entry the workers' group read from `stream` ("0-0": none; a
    ResponseError without the stream)."""
    for group in await redis.xinfo_groups(stream):
        if text(group["name"]) == keys.WORKER_GROUP:
            return text(group["last-delivered-id"])
    return "0-0"


def _delivery(entry_id: bytes, fields: dict[bytes, bytes] | None, lane: str) -> Delivery:
    task_id = fields.get(b"task_id") if fields else None
    return Delivery(entry_id.decode(), task_id.decode() if task_id else None, lane,
                    bool(fields and b"counted" in fields))
