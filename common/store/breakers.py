"""Circuit breakers, one per model (`keys.breaker`): a model whose loads keep failing is
refused at once instead of being loaded again by every task; after a cool-down one probe
task may try (half-open), and each failed probe doubles the wait. Read by `/ready` and the
submit path, written by the workers (workers/breakers.py says when)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from common import keys
from common.settings import Settings
from common.store.values import LUA_NOW_S, one_line, text

# Breakers (one hash per model, keys.breaker). Times come from Redis's clock, shared by every
# host. A breaker records the source its failures were for: a different configured source
# is a different model, so the old breaker is dropped (ARGV[1] is always the source).
_BREAKER_PRELUDE = LUA_NOW_S + """
local recorded = redis.call('HGET', KEYS[1], 'source')
if recorded and recorded ~= '' and recorded ~= ARGV[1] then redis.call('DEL', KEYS[1]) end
"""

# KEYS: breaker | ARGV: source, error, threshold, window, cooldown, max cooldown
# -> {1 if open, reopens_at} | {0, ''}. Closed: count failures within the window, open at the
# threshold. Open (a failed probe): open again, the cool-down doubled per trip up to the max.
_LOAD_FAILED = _BREAKER_PRELUDE + """
if redis.call('HGET', KEYS[1], 'open') == '1' then
  local trips = redis.call('HINCRBY', KEYS[1], 'trips', 1)
  local wait = math.min(tonumber(ARGV[5]) * 2 ^ (trips - 1), tonumber(ARGV[6]))
  redis.call('HSET', KEYS[1], 'reopens_at', now + wait)
  redis.call('HDEL', KEYS[1], 'probe', 'probe_until')
  redis.call('HINCRBY', KEYS[1], 'failures', 1)
else
  local first = tonumber(redis.call('HGET', KEYS[1], 'first_failure') or '0')
  if now - first > tonumber(ARGV[4]) then
    redis.call('HSET', KEYS[1], 'first_failure', now, 'failures', 0)
  end
  if redis.call('HINCRBY', KEYS[1], 'failures', 1) >= tonumber(ARGV[3]) then
    redis.call('HSET', KEYS[1], 'open', 1, 'trips', 1, 'reopens_at', now + tonumber(ARGV[5]))
  end
end
redis.call('HSET', KEYS[1], 'source', ARGV[1], 'error', ARGV[2], 'last_failure', now)
if redis.call('HGET', KEYS[1], 'open') == '1' then
  redis.call('PERSIST', KEYS[1])
  return {1, redis.call('HGET', KEYS[1], 'reopens_at')}
end
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[4])))
return {0, ''}
"""

# KEYS: breaker | ARGV: source, holder, probe seconds, cooldown -> {verdict, error, reopens_at}
# 'closed': load it. 'open': fail fast. 'probe': load it, as the one probe of a half-open
# breaker; the claim lasts `probe seconds` (a holder that dies cannot block it for ever) and
# is re-entrant for the same holder (a worker restarted under its consumer name).
# A breaker without reopens_at (opened by an older version) reopens a cool-down after its
# last failure; one without either stays open until a load succeeds or it is reset.
_BREAKER_ADMIT = _BREAKER_PRELUDE + """
local b = redis.call('HMGET', KEYS[1], 'open', 'error', 'reopens_at', 'last_failure', 'probe',
                     'probe_until')
if b[1] ~= '1' then return {'closed', '', ''} end
local reopens = tonumber(b[3]) or ((tonumber(b[4]) or math.huge) + tonumber(ARGV[4]))
if now < reopens or (b[5] and b[5] ~= ARGV[2] and now < (tonumber(b[6]) or 0)) then
  return {'open', b[2] or '', b[3] or ''}
end
redis.call('HSET', KEYS[1], 'probe', ARGV[2], 'probe_until', now + tonumber(ARGV[3]))
return {'probe', b[2] or '', b[3] or ''}
"""


class BreakerStore:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._load_failed = redis.register_script(_LOAD_FAILED)
        self._admit = redis.register_script(_BREAKER_ADMIT)

    async def admit(self, backend: str, model: str, source: str, holder: str,
                    policy: BreakerPolicy) -> Admission:
        """May `holder` load `model` now? 'closed', 'probe' (yes: it is the one probe of a
        half-open breaker) or 'open' (no: fail fast with the error)."""
        verdict, error, reopens = await self._admit(
            keys=[keys.breaker(backend, model)],
            args=[source, holder, policy.probe_seconds, policy.cooldown])
        return Admission(text(verdict), text(error), float(reopens) if reopens else None)

    async def record_load_failure(self, backend: str, model: str, source: str, error: str,
                                  policy: BreakerPolicy) -> bool:
        """Count a load failure; True when the breaker is open after it."""
        opened, _ = await self._load_failed(
            keys=[keys.breaker(backend, model)],
            args=[source, one_line(error), policy.failures, policy.window, policy.cooldown,
                  policy.cooldown_max])
        return bool(opened)

    async def read(self, backend: str, sources: dict[str, str],
                   policy: BreakerPolicy) -> dict[str, Breaker]:
        """The breaker of each model (name -> configured source), read without changing it."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.time()
            for model in sources:
                pipe.hgetall(keys.breaker(backend, model))
            clock, *raws = await pipe.execute()
        now = clock[0] + clock[1] / 1e6
        return {model: Breaker.from_hash(raw, source, now, policy.cooldown)
                for (model, source), raw in zip(sources.items(), raws, strict=True)}

    async def clear(self, backend: str, model: str) -> bool:
        """Close a breaker (a load worked, or an operator reset it); False if it was closed."""
        return bool(await self.redis.delete(keys.breaker(backend, model)))


@dataclass(frozen=True, slots=True)
class BreakerPolicy:
    """The breaker settings, in the units the store's scripts take."""

    failures: int = 3
    window: float = 600.0
    cooldown: float = 60.0
    cooldown_max: float = 3600.0
    #: how long a probe's claim lasts: longer than any model load
    probe_seconds: float = 600.0

    @classmethod
    def of(cls, settings: Settings) -> BreakerPolicy:
        return cls(settings.breaker_failures, settings.breaker_window_seconds,
                   settings.breaker_cooldown_seconds, settings.breaker_cooldown_max_seconds)


@dataclass(frozen=True, slots=True)
class Admission:
    verdict: str  # closed | probe | open
    error: str = ""
    reopens_at: float | None = None


@dataclass(frozen=True, slots=True)
class Breaker:
    """One model's breaker as /ready shows it."""

    state: str = "closed"  # closed | open | half-open
    failures: int = 0
    error: str = ""
    reopens_at: float | None = None  # when it half-opens (in the past: half-open now)
    trips: int = 0  # times opened in a row; each failed probe doubles the cool-down

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes], source: str, now: float,
                  cooldown: float) -> Breaker:
        data = {k.decode(): v.decode() for k, v in raw.items()}
        if data.get("source", source) not in ("", source):
            return cls()  # recorded for another source: a fresh breaker (as _BREAKER_ADMIT)
        failures, error = int(data.get("failures") or 0), data.get("error", "")
        if data.get("open") != "1":
            return cls("closed", failures, error)
        reopens_at = float(data["reopens_at"]) if data.get("reopens_at") else (
            float(data["last_failure"]) + cooldown if data.get("last_failure") else None)
        state = "open" if reopens_at is None or now < reopens_at else "half-open"
        return cls(state, failures, error, reopens_at, int(data.get("trips") or 1))

    def public(self) -> dict[str, Any]:
        return {"state": self.state, "failures": self.failures, "error": self.error or None,
                "reopens_at": self.reopens_at, "trips": self.trips}
