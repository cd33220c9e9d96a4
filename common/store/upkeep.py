"""The sweeper's reads and writes of the queues (the policy is gateway/jobs/sweeper.py's): stream
entries by age, what a backend still owes, the shared no-worker clock, worker liveness and
trimming. Task records are read and failed through TaskStore (`tasks`, `fail_if_unchanged`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from redis.exceptions import ResponseError

from common import keys
from common.schemas import TERMINAL_STATES
from common.store import admission
from common.store.queue import FORGET_CONSUMER, last_delivered, queued_ms
from common.store.record import Task
from common.store.tasks import TaskStore
from common.store.values import text


@dataclass(frozen=True, slots=True)
class Entry:
    entry_id: str
    task_id: str | None  # None: an entry without a task id
    queued_ms: int  # its task's submit (Unix ms), also for an entry from a key's line


#: the priority lanes: every walk below is per backend and lane
LANES = keys.LANES


async def queued_until(store: TaskStore, backend: str, start: str, cutoff_ms: int,
                       count: int, lane: str = keys.BATCH) -> list[Entry]:
    """Up to `count` entries of the lane's stream from `start` ("(" + id: after it) to the
    entries added at `cutoff_ms` (Unix milliseconds), oldest first."""
    return _entries(await store.redis.xrange(keys.queue(backend, lane), start, str(cutoff_ms),
                                             count=count))


async def owed(store: TaskStore, backend: str, cursor: str, most: int,
               lane: str = keys.BATCH) -> tuple[list[Entry], str]:
    """Entries the backend may still owe a result: handed to a worker and not acked, and not
    handed out yet (after `cursor`, where the last call stopped); at most `most` of each.
    Returns them with the cursor for the next call."""
    redis, stream = store.redis, keys.queue(backend, lane)
    if not await redis.exists(stream):
        return [], cursor
    delivered = "0-0"
    try:
        delivered = await last_delivered(store.redis, stream)
        handed_out = await redis.xpending_range(stream, keys.WORKER_GROUP, min="-", max="+",
                                                count=most)
    except ResponseError:  # no consumer group yet: no worker ever read this stream
        handed_out = []
    entries: list[Entry] = []
    if handed_out:
        async with redis.pipeline(transaction=False) as pipe:
            for item in handed_out:
                pipe.xrange(stream, item["message_id"], item["message_id"])
            entries = [entry for found in await pipe.execute() for entry in _entries(found)]
    waiting = await redis.xrange(stream, f"({_later(cursor, delivered)}", "+", count=most)
    if waiting:
        cursor = waiting[-1][0].decode()
    return entries + _entries(waiting), cursor


async def in_lines(store: TaskStore, backend: str, most: int) -> list[Task]:
    """The first `most` tasks waiting in the keys' lines of the backend (both lanes,
    common/store/shares.py), oldest first: they have no stream entry yet for the walks
    above to find. A task whose record is gone leaves the list here."""
    lines = keys.lines(backend)
    names = [text(name) for name in await store.redis.lrange(lines, 0, most - 1)]
    found = await store.tasks([keys.task_id_of(name) for name in names])
    for name, task in zip(names, found, strict=True):
        if task is None:
            await store.redis.lrem(lines, 1, name)
    return [task for task in found if task is not None]


async def undelivered(store: TaskStore, backend: str, most: int,
                      lane: str = keys.BATCH) -> list[Entry]:
    """The first `most` entries of the lane no worker has read yet."""
    stream = keys.queue(backend, lane)
    try:
        delivered = await last_delivered(store.redis, stream)
    except ResponseError:  # no stream or no group yet: every entry is undelivered
        delivered = "0-0"
    return _entries(await store.redis.xrange(stream, f"({delivered}", "+", count=most))


async def deadlines_passed(store: TaskStore, backend: str, most: int) -> list[str]:
    """Ids of queued tasks of `backend` whose deadline has passed (at most `most`), until
    `forget_deadlines` (after they are handled: a pass cut short looks at them again)."""
    return await admission.deadlines_passed(store.redis, backend, most)


async def forget_deadlines(store: TaskStore, backend: str, task_ids: list[str]) -> None:
    """Take tasks a pass has handled (failed, or found past waiting) out of the deadlines."""
    await admission.forget_deadlines(store.redis, backend, task_ids)


async def no_worker_since(store: TaskStore, backend: str, ttl_seconds: int) -> float:
    """When a sweeping gateway first saw `backend` without a live worker (now, if none did).
    Shared by every replica; kept alive by their passes, gone `ttl_seconds` after they stop."""
    redis, key, now = store.redis, keys.no_worker_since(backend), time.time()
    await redis.set(key, repr(now), nx=True)
    await redis.expire(key, ttl_seconds)
    return float(await redis.get(key) or now)


async def holds_tasks(store: TaskStore, backend: str) -> bool:
    """Whether `backend`'s queues or lines hold entries (tasks may wait there; a queue's
    entries go with the trim, after the retention)."""
    async with store.redis.pipeline(transaction=False) as pipe:
        for lane in LANES:
            pipe.xlen(keys.queue(backend, lane))
        pipe.llen(keys.lines(backend))
        return any(await pipe.execute())


async def worker_seen(store: TaskStore, backend: str) -> None:
    """`backend` has a live worker: its no-worker clock stops."""
    await store.redis.delete(keys.no_worker_since(backend))


async def heartbeat_alive(store: TaskStore, backend: str, consumer: str) -> bool:
    return bool(await store.redis.exists(keys.heartbeat(backend, consumer)))


async def trim(store: TaskStore, backend: str, older_than: float) -> None:
    """Drop queue (both lanes) and dead-letter entries added more than `older_than` seconds
    ago, except queue entries a task still needs: handed to a worker and not acked, or not
    handed out yet while their task is not terminal (with no bound on the wait it may be
    any age; an entry trimmed is a task no worker can ever take)."""
    cutoff = f"{int((time.time() - older_than) * 1000)}-0"
    for lane in LANES:
        stream = keys.queue(backend, lane)
        floor = cutoff
        try:
            pending = await store.redis.xpending(stream, keys.WORKER_GROUP)
            delivered = await last_delivered(store.redis, stream)
        except ResponseError:  # no stream or no group yet: every entry is still to hand out
            pending, delivered = {"min": None}, "0-0"
        if pending["min"] is not None:
            floor = _earlier(floor, text(pending["min"]))
        if (live := await _first_live(store, stream, delivered, cutoff)) is not None:
            floor = _earlier(floor, live)
        await store.redis.xtrim(stream, minid=floor, approximate=False)
    await store.redis.xtrim(keys.dead_letter(backend), minid=cutoff, approximate=False)


async def forget_idle_consumers(store: TaskStore, backend: str, idle_seconds: float) -> int:
    """Remove from the group the consumers of `backend` idle `idle_seconds` or more with no
    entry pending to them (queue.FORGET_CONSUMER: checked and removed at once): every worker
    pod is a new name, and a stopped worker that did not leave (killed) stays otherwise.
    How many went."""
    forget = store.redis.register_script(FORGET_CONSUMER)
    forgotten = 0
    for lane in LANES:
        stream = keys.queue(backend, lane)
        try:
            consumers = await store.redis.xinfo_consumers(stream, keys.WORKER_GROUP)
        except ResponseError:  # no stream or group yet
            continue
        for consumer in consumers:
            if consumer["pending"] == 0 and consumer["idle"] >= idle_seconds * 1000:
                forgotten += int(await forget(keys=[stream], args=[
                    keys.WORKER_GROUP, text(consumer["name"])]))
    return forgotten


#: queue entries `trim` looks at in one pass (the rest wait for the next)
TRIM_WALK = 500


async def _first_live(store: TaskStore, stream: str, after: str, before: str) -> str | None:
    """The first entry after `after` and before `before` whose task is not terminal (or the
    last one looked at, if the walk stopped before the end); None: there is none."""
    entries = _entries(await store.redis.xrange(stream, f"({after}", f"({before}",
                                                count=TRIM_WALK))
    async with store.redis.pipeline(transaction=False) as pipe:
        for entry in entries:
            pipe.hget(keys.task(entry.task_id or ""), "state")
        states = await pipe.execute() if entries else []
    for entry, state in zip(entries, states, strict=True):
        if state is not None and text(state) not in TERMINAL_STATES:
            return entry.entry_id
    return entries[-1].entry_id if len(entries) == TRIM_WALK else None


def _entries(raw: list[tuple[bytes, dict[bytes, bytes]]]) -> list[Entry]:
    found = []
    for entry_id, fields in raw:
        task_id = fields.get(b"task_id")
        found.append(Entry(entry_id.decode(), task_id.decode() if task_id is not None else None,
                           queued_ms(entry_id, fields)))
    return found


def _order(entry: str) -> tuple[int, int]:
    millis, _, seq = entry.partition("-")
    return int(millis), int(seq or 0)


def _later(a: str, b: str) -> str:
    return max(a, b, key=_order)


def _earlier(a: str, b: str) -> str:
    return min(a, b, key=_order)
