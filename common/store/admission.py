"""What admission reads and the workers feed: a backend's backlog (queued tasks and
audio-seconds per lane, running ones, and those seconds per model; kept by the task scripts in
`tasks.py`), its measured processing rates (per model, and for all its models together), its
live workers, and its queued tasks with a deadline.

The policy (predicted wait, 429s, deadlines) is gateway/policy/admission.py's.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from redis.asyncio import Redis

from common import keys
from common.store.live import LiveWorkers

#: the processing rate is the work done over the time it took, of the tasks of about this
#: much processing time (seconds) back: older time fades as newer is added. Weighed by time,
#: not by task, a few tiny tasks (a 1-character speech, a 0.1 s clip Whisper pads to 30 s)
#: move it by the time they really take, not as much as a long file each (one key's handful
#: cut every other key's predicted rate 10-100x, and their deadline submits were refused)
RATE_HORIZON_SECONDS = 120.0
#: the backlog key of the running tasks (the lanes are keys.LANES)
RUNNING = "running"

# KEYS: rate | ARGV: one finished task's work (audio-seconds or characters), its wall
# seconds, model ("" = none), RATE_HORIZON_SECONDS -> the backend's new rate. Folded into
# the backend's sums and the model's ('work', 'time'; 'rate' = work / time, what readers read).
_RECORD_RATE = """
local done, took, horizon = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[4])
local keep = math.exp(-took / horizon)
local function fold(suffix)
  local work = tonumber(redis.call('HGET', KEYS[1], 'work' .. suffix) or '')
  local time = tonumber(redis.call('HGET', KEYS[1], 'time' .. suffix) or '')
  if not work or not time then  -- a rate an older version kept: a horizon's worth of it
    local old = tonumber(redis.call('HGET', KEYS[1], 'rate' .. suffix) or '')
    work, time = (old or 0) * horizon, old and horizon or 0
  end
  work, time = work * keep + done, time * keep + took
  local rate = work / time
  redis.call('HSET', KEYS[1], 'work' .. suffix, tostring(work), 'time' .. suffix, tostring(time),
             'rate' .. suffix, tostring(rate))
  redis.call('HINCRBY', KEYS[1], 'tasks' .. suffix, 1)
  return rate
end
if ARGV[3] ~= '' then fold(':' .. ARGV[3]) end
return tostring(fold(''))
"""

@dataclass(frozen=True, slots=True)
class Backlog:
    tasks: dict[str, int]  # lane -> tasks queued (not yet started)
    #: lane (or RUNNING) -> model -> audio-seconds; "" holds what no model is known for
    #: (tasks queued before per-model sums)
    models: dict[str, dict[str, float]]
    #: model -> (running tasks whose start is counted, the sum of their starts, epoch s)
    started: dict[str, tuple[int, float]] = field(default_factory=dict)

    def lanes_ahead(self, lane: str) -> tuple[str, ...]:
        """`lane` and the lanes read before it."""
        return keys.LANES[:keys.LANES.index(lane) + 1] if lane in keys.LANES else keys.LANES

    def tasks_ahead(self, lane: str) -> int:
        """Tasks queued in `lane` and the lanes read before it."""
        return sum(self.tasks[name] for name in self.lanes_ahead(lane))

    def ahead_by_model(self, lane: str) -> dict[str, float]:
        """model -> audio-seconds queued in `lane` and the lanes read before it."""
        found: dict[str, float] = {}
        for name in self.lanes_ahead(lane):
            for model, seconds in self.models[name].items():
                found[model] = found.get(model, 0.0) + seconds
        return found

    def running_by_model(self) -> dict[str, float]:
        return dict(self.models[RUNNING])

# The backlog (keys.backlog): queued tasks and their work per lane, running ones, and the
# same work per model (a task's 'work': audio-seconds, or characters for TTS; a task queued
# before 'work' existed counts its 'audio_seconds'), kept by the submit and by every script
# that moves a task out of PENDING or out of RUNNING. A task's 'queued' and 'running_counted'
# fields say it is counted, so nothing is subtracted twice; its 'backlog_model' says under
# which model its work is counted (absent on a task queued before per-model sums: only the
# lane totals hold it). Per model also how many run and the sum of their start times
# ('running:count:<model>', 'running:since:<model>'; the task's 'running_since'): what is
# left of the running work is its processing time less the time it has run.
BACKLOG_LUA = """
local function enqueue(task, backlog, lane, seconds)
  local model = redis.call('HGET', task, 'model') or ''
  redis.call('HSET', task, 'queued', 1, 'backlog_model', model)
  redis.call('HINCRBY', backlog, lane .. ':tasks', 1)
  redis.call('HINCRBYFLOAT', backlog, lane .. ':seconds', seconds)
  redis.call('HINCRBYFLOAT', backlog, lane .. ':seconds:' .. model, seconds)
end
local function unqueue(task, backlog, running)
  if redis.call('HDEL', task, 'queued') == 1 then
    local f = redis.call('HMGET', task, 'lane', 'work', 'audio_seconds', 'backlog_model')
    local lane, seconds, model = f[1] or 'batch', tonumber(f[2] or f[3] or '') or 0, f[4]
    redis.call('HINCRBY', backlog, lane .. ':tasks', -1)
    redis.call('HINCRBYFLOAT', backlog, lane .. ':seconds', -seconds)
    if model then redis.call('HINCRBYFLOAT', backlog, lane .. ':seconds:' .. model, -seconds) end
    if running then
      redis.call('HSET', task, 'running_counted', 1)
      redis.call('HINCRBY', backlog, 'running:tasks', 1)
      redis.call('HINCRBYFLOAT', backlog, 'running:seconds', seconds)
      if model then redis.call('HINCRBYFLOAT', backlog, 'running:seconds:' .. model, seconds) end
    end
  end
end
local function run_since(task, backlog, now)
  local model = redis.call('HGET', task, 'backlog_model')
  if model and redis.call('HEXISTS', task, 'running_counted') == 1
      and redis.call('HSETNX', task, 'running_since', now) == 1 then
    redis.call('HINCRBYFLOAT', backlog, 'running:since:' .. model, now)
    redis.call('HINCRBY', backlog, 'running:count:' .. model, 1)
  end
end
local function unrun(task, backlog)
  local since = redis.call('HGET', task, 'running_since')
  if since and redis.call('HDEL', task, 'running_since') == 1 then
    local model = redis.call('HGET', task, 'backlog_model') or ''
    if redis.call('HINCRBY', backlog, 'running:count:' .. model, -1) <= 0 then
      -- none left: exactly 0, not the residue of adding and subtracting epoch seconds
      -- (~1e-7 each time), which would add up over a backlog's life
      redis.call('HSET', backlog, 'running:since:' .. model, 0)
    else
      redis.call('HINCRBYFLOAT', backlog, 'running:since:' .. model, -tonumber(since))
    end
  end
  if redis.call('HDEL', task, 'running_counted') == 1 then
    local f = redis.call('HMGET', task, 'work', 'audio_seconds', 'backlog_model')
    local seconds, model = tonumber(f[1] or f[2] or '') or 0, f[3]
    redis.call('HINCRBY', backlog, 'running:tasks', -1)
    redis.call('HINCRBYFLOAT', backlog, 'running:seconds', -seconds)
    if model then redis.call('HINCRBYFLOAT', backlog, 'running:seconds:' .. model, -seconds) end
  end
end
"""



@dataclass(frozen=True, slots=True)
class Rates:
    """A backend's measured audio-seconds per wall second (moving averages)."""

    backend: float | None  # all its models together; None until a task finished
    models: dict[str, float]  # model -> its own, once one of its tasks finished


def _split(total: float, models: dict[str, float]) -> dict[str, float]:
    """The per-model sums of one lane, made to add up to its total: the total is kept by
    every version of the scripts, the split only by those that know the task's model."""
    counted = sum(models.values())
    if counted > total:  # a model's sum drifted past the lane's: share the total out
        return {model: seconds * total / counted for model, seconds in models.items()}
    if total - counted > 1e-6:
        models = {**models, "": models.get("", 0.0) + total - counted}
    return models


def backlog_of(raw: dict[str, str]) -> Backlog:
    def number(name: str) -> float:
        return max(0.0, float(raw.get(name) or 0))  # never below 0 (float drift)

    models: dict[str, dict[str, float]] = {}
    for name in (*keys.LANES, RUNNING):
        prefix = f"{name}:seconds:"
        found = {field.removeprefix(prefix): number(field) for field in raw
                 if field.startswith(prefix)}
        models[name] = _split(number(f"{name}:seconds"),
                              {model: seconds for model, seconds in found.items() if seconds})
    started = {name.removeprefix("running:count:"): int(number(name)) for name in raw
               if name.startswith("running:count:")}
    return Backlog({lane: int(number(f"{lane}:tasks")) for lane in keys.LANES}, models,
                   {model: (count, number(f"running:since:{model}"))
                    for model, count in started.items() if count > 0})


def rates_of(raw: dict[str, str]) -> Rates:
    def positive(value: str | None) -> float | None:
        return float(value) if value and float(value) > 0 else None

    models = {field.removeprefix("rate:"): positive(value) for field, value in raw.items()
              if field.startswith("rate:")}
    return Rates(positive(raw.get("rate")),
                 {model: rate for model, rate in models.items() if rate is not None})


class RateRecorder:
    """Folds finished tasks into a backend's moving processing rates, its model's and its
    own (its script registered once, not per task)."""

    def __init__(self, redis: Redis, backend: str) -> None:
        self.backend = backend
        self._record = redis.register_script(_RECORD_RATE)

    async def record(self, model: str, audio_seconds: float, wall_seconds: float) -> None:
        if audio_seconds > 0 and wall_seconds > 0:
            await self._record(keys=[keys.rate(self.backend)],
                               args=[repr(audio_seconds), repr(wall_seconds), model,
                                     RATE_HORIZON_SECONDS])


class OutlookReader:
    """The reads a predicted wait needs (its script registered once, not per read)."""

    def __init__(self, redis: Redis, live: LiveWorkers) -> None:
        self.redis = redis
        self.live = live

    async def backlog(self, backend: str) -> Backlog:
        return backlog_of(await _text_hash(self.redis, keys.backlog(backend)))

    async def rates(self, backend: str) -> Rates:
        return rates_of(await _text_hash(self.redis, keys.rate(backend)))

    async def facts(self, backend: str) -> tuple[Backlog, Rates, int]:
        """(backlog, rates, live workers) of `backend`, read concurrently."""
        return await asyncio.gather(self.backlog(backend), self.rates(backend),
                                    self.live.count(backend))


async def _text_hash(redis: Redis, key: str) -> dict[str, str]:
    return {k.decode(): v.decode() for k, v in (await redis.hgetall(key)).items()}


async def deadlines_passed(redis: Redis, backend: str, most: int) -> list[str]:
    """Ids of queued tasks whose deadline has passed (at most `most`); kept until their
    caller has handled them (`forget_deadlines`)."""
    found = await redis.zrangebyscore(keys.deadlines(backend), "-inf", repr(time.time()),
                                      start=0, num=most)
    return [task_id.decode() for task_id in found]


async def forget_deadlines(redis: Redis, backend: str, task_ids: list[str]) -> None:
    """Take handled tasks out of `backend`'s deadline set."""
    if task_ids:
        await redis.zrem(keys.deadlines(backend), *task_ids)
