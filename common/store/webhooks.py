"""Webhook deliveries in Redis: the due set every gateway's deliverer claims from, each
task's attempt log, and the counters /metrics shows.

A finished task with a `callback_url` enters the due set inside its terminal write
(tasks.close). A deliverer claims due entries by moving their score to the end of a lease,
so a gateway that dies mid-attempt only delays the delivery; each attempt's record is
fenced by the score it claimed, so a claim that lapsed (or a redelivery asked meanwhile)
is not undone by a late answer.

With SPEECH_REDIS_WAIT_REPLICAS, a claim counts only once a replica holds it: replication is
in order, so the replica then holds the terminal write that made the delivery due as well.
Unconfirmed, nothing is sent (a failover could lose that write, and the task then run again
to another outcome: its receiver would hear of two); the entries are due again a moment
later.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis

from common import keys
from common.store.record import Task
from common.store.replicas import NotReplicated, ReplicaWait
from common.store.tasks import TaskStore
from common.store.values import text

log = logging.getLogger("gateway.deliverer")
#: attempts kept per task (the newest): a redeliver loop cannot grow a task's log for ever
MAX_ATTEMPTS_KEPT = 100
#: a claim no replica confirmed is due again this much later
UNCONFIRMED_RETRY_SECONDS = 1.0
OUTCOMES = ("delivered", "failed", "gave_up")

#: due entries one claim looks through: a key's surplus among them is spread out (below)
CLAIM_WINDOW = 1000

# KEYS: due | ARGV: now (ms), lease (ms), most, one key's most per pass (0: no limit), the
# window, the pass interval (ms), a task's key less its id -> {task id, claimed score, ...}
# A key's entries past its most in the window are put off over the passes that its most
# takes them in, so a flood of one key's (a submit-and-cancel loop makes a webhook due at
# no cost) no longer holds the head of the set, and every other key's waited behind it.
_CLAIM = """
local now, most, share = tonumber(ARGV[1]), tonumber(ARGV[3]), tonumber(ARGV[4])
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now, 'LIMIT', 0, ARGV[5])
local claimed, lease_end, seen, taken = {}, now + tonumber(ARGV[2]), {}, 0
for _, id in ipairs(ids) do
  local owner = redis.call('HGET', ARGV[7] .. id, 'owner') or ''
  local n = (seen[owner] or 0) + 1
  seen[owner] = n
  if share > 0 and owner ~= '' and n > share then
    redis.call('ZADD', KEYS[1], now + tonumber(ARGV[6]) * math.floor((n - 1) / share), id)
  elseif taken < most then
    redis.call('ZADD', KEYS[1], lease_end, id)
    table.insert(claimed, id)
    table.insert(claimed, string.format('%d', lease_end))
    taken = taken + 1
  end
end
return claimed
"""

# KEYS: task, attempts, due, counters
# ARGV: task id, claimed score, attempt (JSON), outcome, series start, next due (ms; "" = done)
# -> 1 the due entry was ours and is rescheduled or removed, 0 it was not (left alone)
# The log follows the task's remaining lifetime, so it expires with it.
_RECORD = """
redis.call('HINCRBY', KEYS[4], ARGV[4], 1)
local ttl = redis.call('TTL', KEYS[1])
if ttl > 0 then
  redis.call('RPUSH', KEYS[2], ARGV[3])
  redis.call('LTRIM', KEYS[2], -""" + str(MAX_ATTEMPTS_KEPT) + """, -1)
  redis.call('EXPIRE', KEYS[2], ttl)
end
local score = redis.call('ZSCORE', KEYS[3], ARGV[1])
if not score or tonumber(score) ~= tonumber(ARGV[2]) then return 0 end
if ARGV[6] == '' then
  redis.call('ZREM', KEYS[3], ARGV[1])
  if ttl > 0 then redis.call('HDEL', KEYS[1], 'webhook_failures', 'webhook_since') end
else
  redis.call('ZADD', KEYS[3], ARGV[6], ARGV[1])
  if ttl > 0 then
    redis.call('HINCRBY', KEYS[1], 'webhook_failures', 1)
    redis.call('HSET', KEYS[1], 'webhook_since', ARGV[5])
  end
end
return 1
"""

# KEYS: due | ARGV: task id, claimed score -> 1 dropped, 0 not ours any more
_DROP = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) ~= tonumber(ARGV[2]) then return 0 end
return redis.call('ZREM', KEYS[1], ARGV[1])
"""

# KEYS: due | ARGV: task id, claimed score, due (ms) -> 1 put off, 0 not ours any more
_DEFER = """
local score = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not score or tonumber(score) ~= tonumber(ARGV[2]) then return 0 end
redis.call('ZADD', KEYS[1], ARGV[3], ARGV[1])
return 1
"""

# KEYS: task, due, the owner's redeliveries this minute | ARGV: task id, now (ms), most per
# minute (0 = no limit) -> 1 due now, 0 not a finished task with a callback, -1 past the
# owner's redeliveries this minute
# A redelivery starts a new series of attempts (its own backoff and give-up clock).
_REDELIVER = """
local f = redis.call('HMGET', KEYS[1], 'state', 'callback_url')
if not f[1] or f[1] == 'PENDING' or f[1] == 'RUNNING' or not f[2] or f[2] == '' then
  return 0
end
local most = tonumber(ARGV[3])
if most > 0 then
  if tonumber(redis.call('GET', KEYS[3]) or '0') >= most then return -1 end
  if redis.call('INCR', KEYS[3]) == 1 then redis.call('EXPIRE', KEYS[3], 60) end
end
redis.call('HDEL', KEYS[1], 'webhook_failures', 'webhook_since')
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
return 1
"""


@dataclass(frozen=True, slots=True)
class Claim:
    """A due delivery this process holds until `until_ms` (then anyone may take it)."""

    task_id: str
    until_ms: int


@dataclass(frozen=True, slots=True)
class Owed:
    """A claimed delivery's task as stored, and its series of attempts so far."""

    task: Task
    failures: int  # failed attempts since the series began
    since: float | None  # when the series' first attempt started (None: this is it)


@dataclass(frozen=True, slots=True)
class Attempt:
    at: float  # epoch seconds it started
    duration: float
    outcome: str  # one of OUTCOMES
    status: int | None = None  # the receiver's HTTP status, None when it never answered
    error: str | None = None

    def as_json(self) -> str:
        return json.dumps({"at": round(self.at, 3), "duration": round(self.duration, 3),
                           "outcome": self.outcome, "status": self.status, "error": self.error})


class WebhookStore:
    def __init__(self, redis: Redis, replicas: ReplicaWait | None = None) -> None:
        self.redis = redis
        self.replicas = replicas or ReplicaWait()
        self._quiet_until = 0.0  # no "held" warning before this (time.monotonic)
        self._claim = redis.register_script(_CLAIM)
        self._record = redis.register_script(_RECORD)
        self._drop = redis.register_script(_DROP)
        self._redeliver = redis.register_script(_REDELIVER)
        self._defer = redis.register_script(_DEFER)

    @classmethod
    def of(cls, store: TaskStore) -> WebhookStore:
        """The webhook side of `store`, on its connection pool (and its replicas' rule)."""
        return cls(store.redis, store.replicas)

    async def claim(self, most: int, lease_seconds: float, per_key: int = 0,
                    pass_seconds: float = 1.0) -> list[Claim]:
        """Up to `most` due deliveries, each held for `lease_seconds`, at most `per_key` of
        one key's (0: any number; its surplus is put off over the passes, `pass_seconds`
        apart, that take it); none while no replica confirms the claim (see the module's
        docstring)."""
        try:
            flat = await self.replicas.call(
                self.redis, self._claim, keys=[keys.webhooks_due()],
                args=[_ms(time.time()), _ms(lease_seconds), most, per_key, CLAIM_WINDOW,
                      _ms(pass_seconds), keys.task("")],
                wrote=bool)  # nothing claimed: nothing to wait for
        except NotReplicated as short:
            if time.monotonic() >= self._quiet_until:  # (a line a minute while it lasts)
                self._quiet_until = time.monotonic() + 60.0
                log.warning("webhooks held: no replica confirms their terminal writes (%s)",
                            short)
            flat = short.result
            for i in range(0, len(flat), 2):
                await self.defer(Claim(text(flat[i]), int(flat[i + 1])),
                                 time.time() + UNCONFIRMED_RETRY_SECONDS)
            return []
        return [Claim(text(flat[i]), int(flat[i + 1])) for i in range(0, len(flat), 2)]

    async def owed(self, task_id: str) -> Owed | None:
        """The claimed delivery's task (None once it has expired)."""
        raw = await self.redis.hgetall(keys.task(task_id))
        if not raw:
            return None
        since = raw.get(b"webhook_since")
        return Owed(Task.from_hash(raw), int(raw.get(b"webhook_failures") or 0),
                    float(since) if since else None)

    async def record(self, claim: Claim, attempt: Attempt, since: float,
                     next_due: float | None) -> bool:
        """Log an attempt, count it, and (if the claim is still ours) schedule the next one
        at `next_due` (epoch seconds) or, with None, close the series."""
        return bool(await self._record(
            keys=[keys.task(claim.task_id), keys.webhook_attempts(claim.task_id),
                  keys.webhooks_due(), keys.webhook_counters()],
            args=[claim.task_id, claim.until_ms, attempt.as_json(), attempt.outcome,
                  repr(since), "" if next_due is None else _ms(next_due)]))

    async def drop(self, claim: Claim) -> bool:
        """Forget a claimed delivery that no longer has a task to send."""
        return bool(await self._drop(keys=[keys.webhooks_due()],
                                     args=[claim.task_id, claim.until_ms]))

    async def defer(self, claim: Claim, due: float) -> bool:
        """Put a claimed delivery off until `due` (epoch seconds), unsent and unrecorded."""
        return bool(await self._defer(keys=[keys.webhooks_due()],
                                      args=[claim.task_id, claim.until_ms, _ms(due)]))

    async def redeliver(self, task_id: str, owner: str = "", per_minute: int = 0) -> int:
        """Make a finished task's webhook due now: 1; 0 if it is not finished or has none;
        -1 when `owner` already asked `per_minute` redeliveries this minute (0: no limit)."""
        return int(await self._redeliver(
            keys=[keys.task(task_id), keys.webhooks_due(), keys.webhook_redeliveries(owner)],
            args=[task_id, _ms(time.time()), per_minute]))

    async def deliveries(self, task_id: str) -> tuple[list[dict[str, Any]], float | None]:
        """(the task's attempts, oldest first; when its next attempt is due, None if none)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            pipe.lrange(keys.webhook_attempts(task_id), 0, -1)
            pipe.zscore(keys.webhooks_due(), task_id)
            attempts, score = await pipe.execute()
        return [json.loads(raw) for raw in attempts], (score / 1000 if score is not None else None)



async def counters(redis: Redis) -> dict[str, int]:
    """Delivery attempts so far by outcome, every gateway's together."""
    raw = await redis.hgetall(keys.webhook_counters())
    return {outcome: int(raw.get(outcome.encode(), 0)) for outcome in OUTCOMES}


def _ms(seconds: float) -> int:
    return int(seconds * 1000)
