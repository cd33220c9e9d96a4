"""Metering and quotas per owner (API key), in the units users pay for: audio-seconds and
characters, per UTC day and month, in total and per backend.

The submit script (`tasks._SUBMIT`) checks every limit that applies and charges the task in
the same call, so concurrent submits cannot overshoot and a refused submit writes nothing.
The task records its charge (`charge`: JSON of the amount, unit, backend and the keys it went
to); a SUCCEEDED task's charge is settled to the usage its result measured (`settle_usage`,
in the finish script: a container cannot claim less audio than it holds) and added to the
owner's all-time totals; a FAILED or CANCELLED task keeps the part of its charge it had
delivered (its `delivered` field: the end of the last segment it published, the characters
of the pieces it spoke; common/store/segments.py and chunks.py keep it) and the rest is given
back (`close_usage`, in `close()`), so a failure after the output reached its client refunds
only what it did not deliver. The policy (which limits, the 429, `/v1/usage`) is
gateway/policy/quotas.py's.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from redis.asyncio import Redis

from common import keys
from common.api_keys import QUOTA_PERIODS, KeyQuotas
from common.store import fence

#: a period's hash outlives the period by this much (a task finishing just after midnight
#: still finds the hash its charge went to, and gateways' clocks may differ a little)
KEEP_PAST_PERIOD = timedelta(days=1)

# Lua, for the task scripts. `charge_usage(hashes, a)`: hashes = {day, month}; a = {amount,
# unit, backend, day expiry, month expiry, then the limits (day total, day backend, month
# total, month backend; '' = none)}. -> nil when charged, or {3, which limit (1-4), used}.
# `close_usage` and `settle_usage` touch a period's hash only while it exists: a charge whose
# period has ended (the hash expired) is not revived.
LUA = """
local function usage_add(charge, amount)
  for _, hash in ipairs({charge.day, charge.month}) do
    if redis.call('EXISTS', hash) == 1 then
      redis.call('HINCRBYFLOAT', hash, charge.unit, amount)
      redis.call('HINCRBYFLOAT', hash, charge.unit .. ':' .. charge.backend, amount)
    end
  end
end
local function charge_usage(hashes, a)
  local amount = tonumber(a[1])
  local fields = {a[2], a[2] .. ':' .. a[3]}
  for p = 1, 2 do
    for s = 1, 2 do
      local limit = a[5 + (p - 1) * 2 + s]
      if limit ~= '' then
        local used = tonumber(redis.call('HGET', hashes[p], fields[s]) or '') or 0
        if used + amount > tonumber(limit) + 1e-6 then
          return {3, (p - 1) * 2 + s, tostring(used)}
        end
      end
    end
  end
  for p = 1, 2 do
    for s = 1, 2 do redis.call('HINCRBYFLOAT', hashes[p], fields[s], amount) end
    redis.call('EXPIREAT', hashes[p], a[3 + p])
  end
  return nil
end
local function settle_usage(task, measured)
  local raw = redis.call('HGET', task, 'charge')
  local amount = tonumber(measured)
  if not raw or raw == '' or not amount then return end
  local charge = cjson.decode(raw)
  usage_add(charge, amount - charge.amount)
  charge.amount = amount
  redis.call('HSET', task, 'charge', cjson.encode(charge))
end
local function close_usage(task, state)
  local raw = redis.call('HGET', task, 'charge')
  if not raw or raw == '' then return end
  local charge = cjson.decode(raw)
  if state ~= 'SUCCEEDED' then
    local kept = tonumber(redis.call('HGET', task, 'delivered') or '') or 0
    usage_add(charge, kept - charge.amount)
    charge.amount = kept
    redis.call('HSET', task, 'charge', cjson.encode(charge))
  end
  if charge.amount > 0 then
    redis.call('HINCRBYFLOAT', charge.total, charge.unit .. ':' .. charge.backend, charge.amount)
  end
end
"""


# KEYS: the day and month hashes, the all-time hash, and (optional) keys.session_billed |
# ARGV: charge_usage's 9 arguments, then (with that key) the session's total this charge
# brings it to, and the key's TTL
# -> nil charged (and counted in the all-time totals at once), or charge_usage's refusal.
# For work that is no task (a live session's audio with transcription off): nothing is
# settled later, so it is final here. With a session's key the amount is what the total adds
# to what that key says was charged: a charge sent again (its reply lost) adds nothing twice.
CHARGE_NOW = LUA + """
local a = {unpack(ARGV)}
if KEYS[4] then
  local more = tonumber(ARGV[10]) - tonumber(redis.call('GET', KEYS[4]) or '0')
  if more <= 0 then return nil end
  a[1] = tostring(more)
end
local refused = charge_usage({KEYS[1], KEYS[2]}, a)
if refused then return refused end
redis.call('HINCRBYFLOAT', KEYS[3], a[2] .. ':' .. a[3], tonumber(a[1]))
if KEYS[4] then redis.call('SET', KEYS[4], ARGV[10], 'EX', ARGV[11]) end
return nil
"""
#: how long a session's charged total is kept after its last charge (longer than any session)
SESSION_BILLED_SECONDS = 86_400


# KEYS: the task hash | ARGV: the audio it decoded (in its charge's unit), its attempt, the
#       worker that started the attempt ("" = any)
# -> nil when charged (or nothing to charge: not running this attempt, unmetered, no more
# than its charge), or {3, which limit (1-4), used, limit} when the rest would pass it.
# A container can understate its length to the submit's probe (workers/consumer.py): the part
# the submit did not charge is charged here, against the quotas the submit recorded.
TOP_UP = LUA + fence.LUA + """
if not runs(KEYS[1], ARGV[2], ARGV[3]) then return nil end
local raw = redis.call('HGET', KEYS[1], 'charge')
if not raw or raw == '' then return nil end
local charge = cjson.decode(raw)
local more = tonumber(ARGV[1]) - charge.amount
if more <= 0 then return nil end
local limits = charge.limits or {}
local hashes = {charge.day, charge.month}
local fields = {charge.unit, charge.unit .. ':' .. charge.backend}
for p = 1, 2 do
  for s = 1, 2 do
    local limit = limits[tostring((p - 1) * 2 + s)]
    if limit then
      local used = tonumber(redis.call('HGET', hashes[p], fields[s]) or '') or 0
      if used + more > limit + 1e-6 then
        return {3, (p - 1) * 2 + s, tostring(used), tostring(limit)}
      end
    end
  end
end
usage_add(charge, more)
charge.amount = tonumber(ARGV[1])
redis.call('HSET', KEYS[1], 'charge', cjson.encode(charge))
return nil
"""


@dataclass(frozen=True, slots=True)
class Period:
    """One UTC day or month."""

    name: str  # "day" | "month"
    label: str  # "2025-06-01" | "2025-06"
    start: datetime
    end: datetime  # when its usage resets

    @classmethod
    def of(cls, name: str, now: float) -> Period:
        moment = datetime.fromtimestamp(now, UTC)
        if name == "day":
            start = moment.replace(hour=0, minute=0, second=0, microsecond=0)
            return cls(name, start.strftime("%Y-%m-%d"), start, start + timedelta(days=1))
        start = moment.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        end = (start + timedelta(days=32)).replace(day=1)
        return cls(name, start.strftime("%Y-%m"), start, end)

    def key(self, owner: str) -> str:
        return keys.usage(owner, f"{self.name}:{self.label}")

    @property
    def resets_at(self) -> str:
        """ISO 8601, UTC."""
        return self.end.strftime("%Y-%m-%dT%H:%M:%SZ")


def periods(now: float) -> list[Period]:
    return [Period.of(name, now) for name in QUOTA_PERIODS]


@dataclass(frozen=True, slots=True)
class Charge:
    """What a submit costs its owner, and the quotas it must fit in (None: no limits)."""

    owner: str
    backend: str
    unit: str  # "audio_seconds" | "characters"
    amount: float
    quotas: KeyQuotas | None = None

    def limit(self, period: str, per_backend: bool) -> float | None:
        if self.quotas is None:
            return None
        if per_backend:
            quotas = self.quotas.backends.get(self.backend)
            return None if quotas is None else quotas.limit(self.unit, period)
        return self.quotas.limit(self.unit, period)

    def script_args(self, now: float) -> tuple[list[str], list[str], str]:
        """(the period hashes, the submit script's usage arguments, the task's `charge`)."""
        day, month = periods(now)
        limits = [self.limit(period.name, per_backend) for period in (day, month)
                  for per_backend in (False, True)]
        args = [repr(self.amount), self.unit, self.backend,
                *(str(int((p.end + KEEP_PAST_PERIOD).timestamp())) for p in (day, month)),
                *("" if limit is None else repr(limit) for limit in limits)]
        record = json.dumps({"amount": self.amount, "unit": self.unit, "backend": self.backend,
                             "day": day.key(self.owner), "month": month.key(self.owner),
                             "total": keys.usage_total(self.owner),
                             # for a worker's top-up (TOP_UP): by the script's limit numbers
                             "limits": {str(which): limit for which, limit
                                        in enumerate(limits, start=1) if limit is not None}})
        return [day.key(self.owner), month.key(self.owner)], args, record

    def refusal(self, which: int, used: float, now: float) -> QuotaExceeded:
        """The exception of a submit refused by limit `which` (1-4, as the script counts)."""
        period = periods(now)[(which - 1) // 2]
        per_backend = which % 2 == 0
        limit = self.limit(period.name, per_backend)
        assert limit is not None
        return QuotaExceeded(self, period, self.backend if per_backend else "", limit, used)


class QuotaExceeded(Exception):
    """A submit that would take its owner past a quota: nothing was written."""

    def __init__(self, charge: Charge, period: Period, backend: str, limit: float,
                 used: float) -> None:
        super().__init__(f"{charge.unit} per {period.name}")
        self.charge = charge
        self.period = period
        self.backend = backend  # "" for the quota over all backends
        self.limit = limit
        self.used = used


@dataclass(frozen=True, slots=True)
class PeriodUsage:
    period: Period
    used: dict[str, float]  # "audio_seconds" or "audio_seconds:<backend>" -> amount


class UsageStore:
    """The usage reads (the charges are written by the task scripts, in LUA)."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._charge_now = redis.register_script(CHARGE_NOW)

    async def periods(self, owner: str, now: float | None = None) -> list[PeriodUsage]:
        """The owner's usage in the current UTC day and month, in one round trip."""
        current = periods(time.time() if now is None else now)
        async with self.redis.pipeline(transaction=False) as pipe:
            for period in current:
                pipe.hgetall(period.key(owner))
            raws = await pipe.execute()
        return [PeriodUsage(period, {k.decode(): max(0.0, float(v))  # float drift
                                     for k, v in raw.items()})
                for period, raw in zip(current, raws, strict=True)]

    async def totals(self, owners: list[str]) -> dict[str, dict[tuple[str, str], float]]:
        """owner -> (unit, backend) -> all-time usage of its SUCCEEDED tasks, in one round
        trip."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for owner in owners:
                pipe.hgetall(keys.usage_total(owner))
            raws = await pipe.execute()
        found: dict[str, dict[tuple[str, str], float]] = {}
        for owner, raw in zip(owners, raws, strict=True):
            per_field: dict[tuple[str, str], float] = {}
            for field, value in raw.items():
                unit, _, backend = field.decode().partition(":")
                per_field[(unit, backend)] = float(value)
            found[owner] = per_field
        return found

    async def charge_now(self, charge: Charge, now: float | None = None,
                         session: tuple[str, float] | None = None) -> None:
        """Charge `charge` at once, final (no task settles it); QuotaExceeded past a quota.
        `session`: (a live session's meter id, the total this charge brings it to): then
        only what that total adds to what the session was charged so far is charged."""
        now = time.time() if now is None else now
        hashes, args, _ = charge.script_args(now)
        extra_keys, extra_args = ([keys.session_billed(session[0])],
                                  [repr(session[1]), str(SESSION_BILLED_SECONDS)]) \
            if session is not None else ([], [])
        refused = await self._charge_now(
            keys=[*hashes, keys.usage_total(charge.owner), *extra_keys], args=[*args, *extra_args])
        if refused:
            raise charge.refusal(int(refused[1]), float(refused[2]), now)


@dataclass(frozen=True, slots=True)
class TopUpRefused:
    """A worker's top-up (`TOP_UP`) that would pass limit `which` (1-4, as the script counts:
    day total, day backend, month total, month backend)."""

    which: int
    used: float
    limit: float

    @property
    def quota(self) -> str:
        period = QUOTA_PERIODS[(self.which - 1) // 2]
        return f"per {period}" + (" on this backend" if self.which % 2 == 0 else "")


class TopUps:
    """A running task's charge raised to the audio it decoded (`TOP_UP`)."""

    def __init__(self, redis: Redis) -> None:
        self._top_up = redis.register_script(TOP_UP)

    async def top_up(self, task_id: str, attempt: int, amount: float,
                     worker: str = "") -> TopUpRefused | None:
        refused = await self._top_up(keys=[keys.task(task_id)],
                                     args=[repr(amount), attempt, worker])
        if not refused:
            return None
        return TopUpRefused(int(refused[1]), float(refused[2]), float(refused[3]))


def measured(charge: dict[str, Any] | None, state: str, result: dict[str, Any] | None) -> str:
    """What a SUCCEEDED task's result says it used, in its charge's unit ("" = unknown)."""
    if state != "SUCCEEDED" or not charge or not result:
        return ""
    value = (result.get("usage") or {}).get(charge.get("unit"))
    return repr(float(value)) if isinstance(value, int | float) and value >= 0 else ""
