"""What admission reads and the workers feed: a backend's backlog (queued tasks and
audio-seconds per lane, running ones; kept by the task scripts in `tasks.py`), its measured
processing rate, its live workers, and its queued tasks with a deadline.

The policy (predicted wait, 429s, deadlines) is gateway/admission.py's.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from redis.asyncio import Redis

from common import keys

#: weight of the newest finished task in the moving processing rate
RATE_WEIGHT = 0.3

# KEYS: rate | ARGV: audio seconds per wall second of one finished task, weight -> new rate
_RECORD_RATE = """
local old = tonumber(redis.call('HGET', KEYS[1], 'rate') or '')
local value = tonumber(ARGV[1])
if old then value = old + tonumber(ARGV[2]) * (value - old) end
redis.call('HSET', KEYS[1], 'rate', value)
redis.call('HINCRBY', KEYS[1], 'tasks', 1)
return tostring(value)
"""


@dataclass(frozen=True, slots=True)
class Backlog:
    tasks: dict[str, int]  # lane -> tasks queued (not yet started)
    seconds: dict[str, float]  # lane -> their audio-seconds
    running_tasks: int
    running_seconds: float

    def ahead(self, lane: str) -> tuple[int, float]:
        """(tasks, audio-seconds) queued in `lane` and the lanes read before it."""
        lanes = keys.LANES[:keys.LANES.index(lane) + 1] if lane in keys.LANES else keys.LANES
        return (sum(self.tasks[name] for name in lanes),
                sum(self.seconds[name] for name in lanes))


async def backlog(redis: Redis, backend: str) -> Backlog:
    raw = {k.decode(): v.decode() for k, v in (await redis.hgetall(keys.backlog(backend))).items()}

    def number(name: str) -> float:
        return max(0.0, float(raw.get(name) or 0))  # never below 0 (float drift)

    return Backlog({lane: int(number(f"{lane}:tasks")) for lane in keys.LANES},
                   {lane: number(f"{lane}:seconds") for lane in keys.LANES},
                   int(number("running:tasks")), number("running:seconds"))


async def rate(redis: Redis, backend: str) -> float | None:
    """The backend's measured audio-seconds per wall second; None until a task finished."""
    value = await redis.hget(keys.rate(backend), "rate")
    return float(value) if value and float(value) > 0 else None


class RateRecorder:
    """Folds finished tasks into a backend's moving processing rate (its script registered
    once, not per task)."""

    def __init__(self, redis: Redis, backend: str) -> None:
        self.backend = backend
        self._record = redis.register_script(_RECORD_RATE)

    async def record(self, audio_seconds: float, wall_seconds: float) -> None:
        if audio_seconds > 0 and wall_seconds > 0:
            await self._record(keys=[keys.rate(self.backend)],
                               args=[repr(audio_seconds / wall_seconds), RATE_WEIGHT])


# KEYS: live set -> workers whose heartbeat has not expired
_LIVE_COUNT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
return redis.call('ZCOUNT', KEYS[1], now, '+inf')
"""


async def live_worker_count(redis: Redis, backend: str) -> int:
    """Workers of `backend` whose heartbeat has not expired (O(log n), no keyspace scan)."""
    return int(await redis.register_script(_LIVE_COUNT)(keys=[keys.live(backend)]))


async def outlook_facts(redis: Redis, backend: str) -> tuple[Backlog, float | None, int]:
    """(backlog, rate, live workers) of `backend`, read concurrently."""
    return await asyncio.gather(backlog(redis, backend), rate(redis, backend),
                                live_worker_count(redis, backend))


async def deadlines_passed(redis: Redis, backend: str, most: int) -> list[str]:
    """Ids of queued tasks whose deadline has passed (at most `most`), and forget them."""
    found = await redis.zrangebyscore(keys.deadlines(backend), "-inf", repr(time.time()),
                                      start=0, num=most)
    if found:
        await redis.zrem(keys.deadlines(backend), *found)
    return [task_id.decode() for task_id in found]
