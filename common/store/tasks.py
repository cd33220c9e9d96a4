"""The task lifecycle in Redis: submit, start, finish, cancel, and close() that every terminal
write ends with. Every state change that must be atomic with another write (submit +
enqueue, terminal state + ack, cancel + dequeue) is one Lua call, so no crash leaves half.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from common import keys
from common.blobs import BlobDir
from common.schemas import TERMINAL_STATES, TaskState
from common.settings import Settings
from common.store import admission, fence, shares, usage
from common.store.blobs import BlobStore
from common.store.breakers import BreakerStore
from common.store.chunks import SpeechChunks
from common.store.connection import bounded_client
from common.store.devices import DeviceView, devices
from common.store.live import LiveWorkers
from common.store.poll import PollReader
from common.store.positions import Positions
from common.store.record import (
    Duplicate,
    InputsFull,
    QueueFull,
    Task,
    TooManyInFlight,
    TooManySubmits,
)
from common.store.replicas import NotReplicated, ReplicaWait
from common.store.slots import SlotStore
from common.store.usage import Charge, UsageStore
from common.store.values import one_line, strict_json, text

# A task with a callback_url owes its webhook from the moment it is terminal: it joins the
# deliverers' due set (keys.webhooks_due) in the same call, so no crash loses it.
_WEBHOOK_DUE = """
local function webhook_due(task, webhooks, now)
  local url = redis.call('HGET', task, 'callback_url')
  if url and url ~= '' then
    redis.call('ZADD', webhooks, math.floor(tonumber(now) * 1000), redis.call('HGET', task, 'id'))
  end
end
"""

# Every terminal write ends with close(): the task leaves the backlog (and the deadlines),
# takes its state, starts its retention (and its idempotency key's), loses its input and, a
# minute later, its spoken pieces (a TTS task's; its WAV or its error says it all from then
# on), its owner's usage is settled (usage.LUA), its watchers hear of it, and its webhook is
# owed. What else must happen exactly once per task,
# atomically with its terminal state, belongs here.
_CLOSE = admission.BACKLOG_LUA + usage.LUA + shares.LUA + _WEBHOOK_DUE + """
local function close(task, backlog, input, speech, events, state, now, retention, webhooks)
  local counted = redis.call('HGET', task, 'in_flight')
  if counted and redis.call('HDEL', task, 'in_flight') == 1 then
    if redis.call('DECR', counted) <= 0 then redis.call('DEL', counted) end
  end
  local held = redis.call('HMGET', task, 'input_bytes_key', 'input_bytes')
  if held[1] and redis.call('HDEL', task, 'input_bytes_key', 'input_bytes') > 0 then
    if redis.call('DECRBY', held[1], tonumber(held[2]) or 0) <= 0 then
      redis.call('DEL', held[1])
    end
  end
  unqueue(task, backlog, false)
  unshare(task, backlog)
  unrun(task, backlog)
  close_usage(task, state)
  local found = redis.call('HMGET', task, 'id', 'deadlines', 'idempotency')
  if found[2] then redis.call('ZREM', found[2], found[1]) end
  -- a repeated Idempotency-Key finds the task for its retention from now on
  if found[3] and redis.call('GET', found[3]) == found[1] then
    redis.call('EXPIRE', found[3], retention)
  end
  redis.call('HSET', task, 'state', state, 'finished_at', now)
  redis.call('EXPIRE', task, retention)
  redis.call('DEL', input)
  -- a TTS task's pieces outlive it briefly, so a stream reading them sends its last ones
  -- from the record rather than downloading the WAV to cut them out of it
  redis.call('PEXPIRE', speech, 60000)
  redis.call('PUBLISH', events, cjson.encode({type='state', status=state}))
  webhook_due(task, webhooks, now)
end
"""

# KEYS: task, queue, input blob, queue counter, idempotency key, backlog, deadlines, the
#       owner's day and month usage hashes, the owner's in-flight count, its lane share, its
#       line and the backend's lines (shares.py), the owner's share and line of the other
#       lane, the owner's queued input bytes, the owner's submits this minute, and
#       (optional) the staged upload (BlobStore.stage) that becomes the input blob
# ARGV: task_id, the input's and idempotency key's ttl (0 = none: close() ends them), blob
#       ("" = none, or staged), idempotent ("1"/"0"), most queued tasks (0 = no
#       limit), lane, audio seconds, deadline ("" = none), the 9 arguments of
#       charge_usage (usage.LUA; all "" = not metered), the owner's most tasks in flight
#       (0 = no limit, "" = not counted), the owner's most entries waiting in the lane (0 =
#       no limit), their most work (0 = no limit), the owner's most of the queued tasks
#       (0 = no limit), the owner's most input bytes held by its tasks (0 = not counted),
#       this task's input bytes, the owner's most submits a minute (0 = no limit), field,
#       value, ...
# -> {1, entry id, its number} queued ({1, "", 0}: in the owner's line, shares.py),
#    {0, original task id} for a repeated idempotency key
#    (or a repeated submit of the same task),
#    {2, tasks queued} when the backend already has its most queued tasks, {3, which
#    limit, used} when the charge would pass a quota, or {4, in flight} when the owner has
#    its most tasks queued or running, or {5} when the staged upload is gone, or {6, its
#    tasks queued} when the owner holds its most of the queued tasks, or {7, bytes held}
#    when the input would take the owner past its most input bytes (a task alone always
#    may), or {8, ms until its minute ends} when the owner made its most submits this
#    minute (nothing written for any of those).
# Each entry carries its own number in the backend's add order (our counter, not Redis's
# group "entries-read", which Redis 7.0 loses when it reloads the AOF): a queue position
# is then one subtraction from the first entry not yet handed to a worker.
_SUBMIT = admission.BACKLOG_LUA + usage.LUA + shares.LUA + shares.SUBMIT_LUA + """
if redis.call('EXISTS', KEYS[1]) == 1 then
  -- this very submit, sent again after its reply was lost (ids are random): answer as the
  -- first one did; the HSET (same value) makes a WAIT after it cover the stored record
  redis.call('HSET', KEYS[1], 'id', ARGV[1])
  return {0, ARGV[1]}
end
if ARGV[4] == '1' then
  local original = redis.call('GET', KEYS[5])
  if original then
    -- a repeated key: the same value written back, so a WAIT after it covers the original's
    -- submit also on a Redis before 7.0 (whose WAIT counts only the connection's writes: a
    -- retry on another connection, with nothing written since a replica fell behind, would
    -- be confirmed at once; 7.0 on counts its last command of any kind)
    redis.call('SET', KEYS[5], original, 'KEEPTTL')
    return {0, original}
  end
end
if KEYS[18] and redis.call('EXISTS', KEYS[18]) == 0 then return {5, ''} end
local rate_most = tonumber(ARGV[24]) or 0
if rate_most > 0 and (tonumber(redis.call('GET', KEYS[17]) or '0') or 0) >= rate_most then
  return {8, tostring(redis.call('PTTL', KEYS[17]))}
end
local most = tonumber(ARGV[5])
if most > 0 then
  local b = redis.call('HMGET', KEYS[6], 'interactive:tasks', 'batch:tasks')
  local queued = (tonumber(b[1] or '') or 0) + (tonumber(b[2] or '') or 0)
                 + redis.call('LLEN', KEYS[13])  -- and those in the keys' lines
  if queued >= most then return {2, tostring(queued)} end
  local own_most = tonumber(ARGV[21]) or 0
  if own_most > 0 then  -- the owner's waiting entries and lines, both lanes
    local own = (tonumber(redis.call('GET', KEYS[11]) or '0') or 0) + redis.call('LLEN', KEYS[12])
                + (tonumber(redis.call('GET', KEYS[14]) or '0') or 0)
                + redis.call('LLEN', KEYS[15])
    if own >= own_most then return {6, tostring(own)} end
  end
end
local cap = tonumber(ARGV[18])
if cap and cap > 0 then
  local flying = tonumber(redis.call('GET', KEYS[10]) or '0')
  if flying >= cap then return {4, tostring(flying)} end
end
local bytes_most, bytes = tonumber(ARGV[22]) or 0, tonumber(ARGV[23]) or 0
if bytes_most > 0 and bytes > 0 then
  -- none of the owner's tasks unfinished: none holds input (a version's close() that did
  -- not uncount it, in a rolling upgrade, must not lock the key out for good)
  if cap and (tonumber(redis.call('GET', KEYS[10]) or '0') or 0) <= 0 then
    redis.call('DEL', KEYS[16])
  end
  local held = tonumber(redis.call('GET', KEYS[16]) or '0') or 0
  if held > 0 and held + bytes > bytes_most then return {7, tostring(held)} end
end
if ARGV[9] ~= '' then
  local refused = charge_usage({KEYS[8], KEYS[9]}, {unpack(ARGV, 9, 17)})
  if refused then return refused end
end
local entry, seq = share_or_hold(KEYS[1], KEYS[2], KEYS[4], KEYS[11], KEYS[12], KEYS[13],
                                 KEYS[6], ARGV[6], ARGV[7], tonumber(ARGV[19]) or 0,
                                 tonumber(ARGV[20]) or 0, ARGV[1], unpack(ARGV, 25))
if rate_most > 0 and redis.call('INCR', KEYS[17]) == 1 then
  redis.call('PEXPIRE', KEYS[17], 60000)  -- a fixed minute from the first submit
end
if cap then
  redis.call('INCR', KEYS[10])
  redis.call('HSET', KEYS[1], 'in_flight', KEYS[10])
end
if bytes_most > 0 and bytes > 0 then  -- uncounted by close()
  redis.call('INCRBY', KEYS[16], bytes)
  redis.call('HSET', KEYS[1], 'input_bytes', bytes, 'input_bytes_key', KEYS[16])
end
if ARGV[8] ~= '' then
  redis.call('ZADD', KEYS[7], ARGV[8], ARGV[1])
  redis.call('HSET', KEYS[1], 'deadlines', KEYS[7])
end
local function keep(key)
  if ARGV[2] == '0' then redis.call('PERSIST', key) else redis.call('EXPIRE', key, ARGV[2]) end
end
if ARGV[3] ~= '' then
  redis.call('SET', KEYS[3], ARGV[3])
  keep(KEYS[3])
elseif KEYS[18] then
  redis.call('RENAME', KEYS[18], KEYS[3])
  keep(KEYS[3])
end
if ARGV[4] == '1' then
  redis.call('SET', KEYS[5], ARGV[1])
  keep(KEYS[5])
  redis.call('HSET', KEYS[1], 'idempotency', KEYS[5])
end
return {1, entry, seq}
"""

# KEYS: task, events, backlog, input blob, webhooks due, spoken pieces, the backend's
#       deadlines (of queued tasks)
# ARGV: worker, now, deliveries, retention, task id, "1" to start it even unconfirmed
# -> new attempt, 0 if terminal, -1 if missing, -2 if its deadline passed while it was
# queued (it is FAILED deadline_exceeded here, never run), -3 if its submit is not yet
# confirmed by a replica (UNCONFIRMED: the submit may still withdraw it)
_START = _CLOSE + """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return -1 end
if state ~= 'PENDING' and state ~= 'RUNNING' then return 0 end
if ARGV[6] ~= '1' and redis.call('HEXISTS', KEYS[1], 'unconfirmed') == 1 then return -3 end
redis.call('HDEL', KEYS[1], 'unconfirmed')
redis.call('ZREM', KEYS[7], ARGV[5])  -- queued no longer
local deadline = tonumber(redis.call('HGET', KEYS[1], 'deadline') or '')
if state == 'PENDING' and deadline and tonumber(ARGV[2]) > deadline then
  redis.call('HSET', KEYS[1], 'error', 'its deadline passed before a worker could start it',
             'error_code', 'deadline_exceeded')
  close(KEYS[1], KEYS[3], KEYS[4], KEYS[6], KEYS[2], 'FAILED', ARGV[2], ARGV[4], KEYS[5])
  return -2
end
unqueue(KEYS[1], KEYS[3], true)
unshare(KEYS[1], KEYS[3])
run_since(KEYS[1], KEYS[3], ARGV[2])
local attempt = redis.call('HINCRBY', KEYS[1], 'attempt', 1)
redis.call('HSET', KEYS[1], 'state', 'RUNNING', 'worker', ARGV[1], 'started_at', ARGV[2],
           'deliveries', ARGV[3])
redis.call('PUBLISH', KEYS[2], '{"type":"state","status":"RUNNING"}')
return attempt
"""

# KEYS: task, queue, events, input blob, output blob, backlog, webhooks due,
#       spoken pieces
# ARGV: attempt (or "" = unfenced), entry, group, state, now, retention, result, error, code,
#       output ("" = none), output file name ("" = none), measured usage ("" = none),
#       the result's `usage` as JSON ("" = none: a poll's reply splices it unparsed), the
#       worker that started the attempt ("" = any: a failover that lost a start can hand the
#       same attempt number to a second worker, and only the worker field tells them apart),
#       "1" when this writes again a terminal write no replica confirmed
# -> 1 stored (now, or by an earlier call of this attempt whose reply was lost: the record
# names its output file), 0 stale attempt or already terminal. Acks only after the state is
# stored.
# The output is written here, inside the fence, so a stale attempt cannot replace the
# winner's audio; the input is deleted here, since no attempt can need it any more.
_FINISH = _CLOSE + fence.LUA + """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 0 end
if ARGV[1] ~= '' and not holds(KEYS[1], ARGV[1], ARGV[14]) then return 0 end
local finisher = ARGV[1] .. '@' .. (ARGV[14] or '')
if state ~= 'PENDING' and state ~= 'RUNNING' then
  if ARGV[2] ~= '' then redis.call('XACK', KEYS[2], ARGV[3], ARGV[2]) end
  -- a retried call whose first reply was lost: the record names this attempt's output file;
  -- or one its replica did not confirm (ARGV[15]): this attempt and worker as its finisher
  -- (each written back as it is: a WAIT after it covers the first call's write, as for a
  -- repeated key in _SUBMIT, on a Redis before 7.0)
  if ARGV[11] ~= '' and redis.call('HGET', KEYS[1], 'output_file') == ARGV[11] then
    redis.call('HSET', KEYS[1], 'output_file', ARGV[11])
    return 1
  end
  if ARGV[15] == '1' and ARGV[1] ~= ''
     and redis.call('HGET', KEYS[1], 'finished_by') == finisher then
    redis.call('HSET', KEYS[1], 'finished_by', finisher)
    return 1
  end
  return 0
end
if ARGV[1] ~= '' then redis.call('HSET', KEYS[1], 'finished_by', finisher) end
if ARGV[7] ~= '' then redis.call('HSET', KEYS[1], 'result', ARGV[7], 'usage', ARGV[13]) end
if ARGV[8] ~= '' then redis.call('HSET', KEYS[1], 'error', ARGV[8], 'error_code', ARGV[9]) end
if ARGV[10] ~= '' then redis.call('SET', KEYS[5], ARGV[10], 'EX', ARGV[6]) end
if ARGV[11] ~= '' then redis.call('HSET', KEYS[1], 'output_file', ARGV[11]) end
if ARGV[12] ~= '' then settle_usage(KEYS[1], ARGV[12]) end
close(KEYS[1], KEYS[6], KEYS[4], KEYS[8], KEYS[3], ARGV[4], ARGV[5], ARGV[6], KEYS[7])
if ARGV[2] ~= '' then redis.call('XACK', KEYS[2], ARGV[3], ARGV[2]) end
return 1
"""

# KEYS: task, queue, events, input blob, backlog, webhooks due, spoken pieces
# ARGV: now, retention
# -> the state after.
# The stream entry stays (its number keeps the positions behind it exact): a worker that
# reads it finds the task terminal and acks it.
_CANCEL = _CLOSE + """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return '' end
if state ~= 'PENDING' then
  -- CANCELLED written back as it is, so a WAIT after it covers the write that made it (a
  -- cancel sent again on another connection after the first's replica wait failed; as for
  -- a repeated key in _SUBMIT, for a Redis before 7.0)
  if state == 'CANCELLED' then redis.call('HSET', KEYS[1], 'state', state) end
  return state
end
redis.call('HSET', KEYS[1], 'error', 'task was cancelled before it started')
close(KEYS[1], KEYS[5], KEYS[4], KEYS[7], KEYS[3], 'CANCELLED', ARGV[1], ARGV[2], KEYS[6])
return 'CANCELLED'
"""

# KEYS: task, queue, events, input blob, backlog, webhooks due, spoken pieces
# ARGV: state read, attempt read, entry, group, now, retention, error, code
# -> 1 FAILED, 0 left alone. The fence for a sweeper's read-then-write: a task that was
# started, finished or re-attempted since the caller read it is not touched.
_FAIL_IF_UNCHANGED = _CLOSE + """
local current = redis.call('HMGET', KEYS[1], 'state', 'attempt')
if current[1] ~= ARGV[1] or (current[2] or '0') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'error', ARGV[7], 'error_code', ARGV[8])
close(KEYS[1], KEYS[5], KEYS[4], KEYS[7], KEYS[3], 'FAILED', ARGV[5], ARGV[6], KEYS[6])
if ARGV[3] ~= '' then redis.call('XACK', KEYS[2], ARGV[4], ARGV[3]) end
return 1
"""


# KEYS: task -> 1 counted, 0 the task is gone (its record is not made again)
_SPARE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'spared', 1)
return 1
"""

#: a terminal write waits up to this many `redis_wait_timeout_ms` for its replica: a worker
#: has nothing better to do meanwhile, and a replica that reconnects catches up at once
FINISH_WAITS = 10
#: a task hash field, there while no replica has confirmed its submit (with
#: SPEECH_REDIS_WAIT_REPLICAS): no worker starts it meanwhile, so a submit its replica did not
#: confirm in time can always be withdrawn and refused (503). An idle worker used to start it
#: within the wait, and the submit was then answered 200 for a task the primary's death lost.
UNCONFIRMED = "unconfirmed"
#: a submit whose reply was lost, and whose withdrawal failed too, is withdrawn again in the
#: background for this long: Redis back within it, the task its caller was told 503 of (and
#: sends again) is cancelled if no worker has started it yet (with a replica wait, none does
#: for 5 s: UNCONFIRMED); else, or past it, it runs as well
WITHDRAW_PATIENCE_SECONDS = 30.0

log = logging.getLogger(__name__)


class TaskStore:
    """The gateway's whole side of Redis: the task lifecycle here (submit, start, finish,
    cancel, the sweeper's fenced fail), and the rest as sub-stores: `positions` (queue
    positions and depths), `poll` (a status poll in one round trip), `blobs` (inputs and
    outputs), `usage`, `breakers`, `slots` (a key's leased slots), `live` (live workers),
    `outlook` (what a predicted wait reads), `speech` (a TTS task's audio so far)."""

    def __init__(self, redis: Redis, retention_seconds: int,
                 blob_dir: BlobDir | None = None, replicas: ReplicaWait | None = None,
                 max_queue_seconds: float | None = None) -> None:
        """`max_queue_seconds`: the longest a task may wait to start (0: for ever; None:
        not bounded here, its input kept for the retention)."""
        self.redis = redis
        self.retention = retention_seconds
        self._withdrawals: set[asyncio.Task[None]] = set()
        # a queued task's input and idempotency key outlive its longest wait, then the
        # retention; with no bound on the wait they live until its terminal write
        self.input_ttl = (retention_seconds if max_queue_seconds is None else
                          0 if max_queue_seconds <= 0 else
                          retention_seconds + math.ceil(max_queue_seconds))
        self.blobs = BlobStore(redis, retention_seconds, blob_dir)
        self.replicas = replicas or ReplicaWait()  # submits and terminal writes wait for them
        self.positions = Positions(redis)
        self.poll = PollReader(redis)
        self.usage = UsageStore(redis)
        self.breakers = BreakerStore(redis)
        self.slots = SlotStore(redis)
        self.live = LiveWorkers(redis)
        self.outlook = admission.OutlookReader(redis, self.live)
        self.speech = SpeechChunks(redis, retention_seconds)
        self._submit = redis.register_script(_SUBMIT)
        self._start = redis.register_script(_START)
        self._finish = redis.register_script(_FINISH)
        self._cancel = redis.register_script(_CANCEL)
        self._fail_if_unchanged = redis.register_script(_FAIL_IF_UNCHANGED)
        self._spare = redis.register_script(_SPARE)

    @classmethod
    def for_settings(cls, redis: Redis, settings: Settings) -> TaskStore:
        blob_dir = None
        if settings.blob_dir is not None:
            blob_dir = BlobDir(settings.blob_dir, int(settings.blob_dir_min_kib * 1024))
        return cls(redis, settings.retention_seconds, blob_dir, ReplicaWait.of(settings),
                   settings.max_queue_seconds)

    @classmethod
    def connect(cls, settings: Settings, client_name: str) -> TaskStore:
        """A store on its own bounded connection pool (the gateway's); `close` releases it."""
        return cls.for_settings(bounded_client(settings, client_name), settings)

    async def close(self) -> None:
        for withdrawal in list(self._withdrawals):  # (bounded retries: a stop ends them)
            withdrawal.cancel()
        await asyncio.gather(*self._withdrawals, return_exceptions=True)
        await self.redis.aclose()

    async def ping(self) -> bool:
        """Whether the store answers now (a StoreError when it does not)."""
        return bool(await self.redis.ping())

    async def devices(self) -> list[DeviceView]:
        """The device memory broker's view of every device."""
        return await devices(self.redis)

    async def ensure_queue(self, backend: str) -> None:
        """Create both lanes' streams and their consumer group unless they exist."""
        for lane in keys.LANES:
            try:
                await self.redis.xgroup_create(keys.queue(backend, lane), keys.WORKER_GROUP,
                                               id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def submit(self, task: Task, blob: bytes | None, idempotency_key: str = "",
                     max_queued_tasks: int = 0, charge: Charge | None = None,
                     max_in_flight: int | None = None, staged: str = "",
                     lane_share: int = 0, lane_share_work: float = 0.0,
                     max_queued_own: int = 0, max_input_bytes: int = 0,
                     submits_per_minute: int = 0) -> None:
        """Write the task record, its queue entry and its input blob in one atomic step, and
        charge its owner's usage (`charge`; None: unmetered). `staged`: the key the blob was
        staged under (BlobStore.stage), renamed to the input here; the blob itself is sent
        only if that key is gone. A refused submit leaves the staged key to its caller.

        Raises Duplicate when `idempotency_key` was already used by the same owner within
        the retention, QueueFull when the backend already has `max_queued_tasks` queued
        (0: no limit), QuotaExceeded when the charge would pass one of its quotas,
        TooManyInFlight when its owner already has `max_in_flight` tasks queued or running
        (0: no limit; None: not counted): nothing is written then. `lane_share`: the most
        entries its owner may have waiting in the lane, `lane_share_work` the most work (its
        units; 0: no limit); past them the task waits in the owner's line (shares.py).
        `max_queued_own`: the most of the backend's queued tasks its owner may hold, counted
        in its lane shares and lines (0: no limit); past it QueueFull(own=True).
        `max_input_bytes`: the most input its owner's unfinished tasks may hold, this one's
        included unless it is alone (0: not counted); past it InputsFull.
        `submits_per_minute`: the most tasks its owner may submit in a minute (0: no limit;
        repeats of an idempotency key are free); past it TooManySubmits."""
        now = time.time()
        hashes, usage_args, charged = [keys.task(task.id)] * 2, [""] * 9, ""
        if charge is not None:
            hashes, usage_args, charged = charge.script_args(now)
        fields = task.new_hash(now, charged)
        if self.replicas.replicas > 0:  # no worker starts it before a replica holds it
            fields[UNCONFIRMED] = "1"
        flat = [item for pair in fields.items() for item in pair]
        other_lane = next(lane for lane in keys.LANES if lane != task.lane)
        in_file = self.blobs.in_file(blob)
        if in_file:
            assert blob is not None
            await self.blobs.write_input_file(task.id, blob)
        stored = False
        keep_file = False  # the task lives, whatever this call answers: its input stays
        try:
            try:
                queued, value, *number = await self.replicas.call(
                    self.redis, self._submit,
                    keys=[keys.task(task.id), keys.queue(task.backend, task.lane),
                          keys.input_blob(task.id), keys.queue_counter(task.backend, task.lane),
                          keys.idempotency(task.owner, idempotency_key),
                          keys.backlog(task.backend), keys.deadlines(task.backend), *hashes,
                          keys.in_flight(task.owner),
                          keys.lane_share(task.backend, task.lane, task.owner),
                          keys.held(task.backend, task.lane, task.owner),
                          keys.lines(task.backend),
                          keys.lane_share(task.backend, other_lane, task.owner),
                          keys.held(task.backend, other_lane, task.owner),
                          keys.input_bytes(task.owner), keys.submits(task.owner),
                          *([staged] if staged else [])],
                    args=[task.id, self.input_ttl,
                          b"" if in_file or staged else (blob or b""),
                          "1" if idempotency_key else "0", max_queued_tasks, task.lane,
                          repr(task.work_units),
                          "" if task.deadline is None else repr(task.deadline), *usage_args,
                          "" if max_in_flight is None else max_in_flight,
                          lane_share if task.owner else 0,
                          repr(lane_share_work) if task.owner else 0,
                          max_queued_own if task.owner else 0,
                          max_input_bytes if task.owner else 0, len(blob or b""),
                          submits_per_minute if task.owner else 0, *flat])
            except (RedisConnectionError, RedisTimeoutError):
                # the reply was lost: the task may be queued. A retry with its key finds it,
                # so its input stays (BlobStore.sweep removes it if it was not); without a
                # key its caller is told 503 and sends it again, so it is withdrawn where it
                # was written (best effort: Redis may be gone for the cancel too)
                keep_file = True
                if not idempotency_key:
                    await self._withdraw(task)
                raise
            except NotReplicated as short:
                if short.result[0] != 1:
                    raise
                # refused to the client: withdraw the task, unless a retry with its key is
                # to find it (then it stays queued, and the retry is answered with it)
                keep_file = True
                if idempotency_key:
                    raise
                state = await self._withdraw(task)
                if state in ("", TaskState.CANCELLED):  # withdrawn (or not known to run)
                    raise
                # a worker took it within the wait: it runs and is charged, so it is accepted
                queued, value, *number = short.result
            stored = queued == 1
            if UNCONFIRMED in fields and queued in (0, 1):  # confirmed: the task may start
                with contextlib.suppress(RedisError):
                    await self.redis.hdel(keys.task(text(value) if queued == 0 else task.id),
                                          UNCONFIRMED)
            # a retried call (its first reply lost) finds its own idempotency key: the task
            # was written by the first one
            keep_file = keep_file or stored or (queued == 0 and text(value) == task.id)
        finally:
            if in_file and not keep_file:
                self.blobs.delete_input_file(task.id)
        if queued == 5:  # staged on a primary that has since failed over: send it along
            await self.submit(task, blob, idempotency_key, max_queued_tasks, charge,
                              max_in_flight, lane_share=lane_share,
                              lane_share_work=lane_share_work, max_queued_own=max_queued_own,
                              max_input_bytes=max_input_bytes,
                              submits_per_minute=submits_per_minute)
            return
        if queued in (2, 6):
            raise QueueFull(int(value), own=queued == 6)
        if queued == 3:
            assert charge is not None
            raise charge.refusal(int(value), float(number[0]), now)
        if queued == 4:
            raise TooManyInFlight(int(value))
        if queued == 7:
            raise InputsFull(int(value))
        if queued == 8:
            raise TooManySubmits(max(0, int(value)) / 1000)
        if stored:  # the record as written, so its queue position can be read at once
            task.entry_id, task.queue_seq = text(value), int(number[0])
            task.created_at = now
        if not stored:
            raise Duplicate(text(value))

    async def _withdraw(self, task: Task) -> str:
        """Cancel a task whose submit is refused to its caller: its state after, or "" when
        Redis did not answer (then tried again in the background for
        WITHDRAW_PATIENCE_SECONDS)."""
        try:
            return await self.cancel(task.id, task.backend)
        except RedisError:
            withdrawal = asyncio.create_task(self._withdraw_later(task))
            self._withdrawals.add(withdrawal)
            withdrawal.add_done_callback(self._withdrawals.discard)
            return ""

    async def _withdraw_later(self, task: Task) -> None:
        give_up_at, delay = time.monotonic() + WITHDRAW_PATIENCE_SECONDS, 0.2
        while time.monotonic() < give_up_at:
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)
            try:
                state = await self.cancel(task.id, task.backend)
            except RedisError:
                continue
            log.info("withdrew task %s, refused to its caller: it is %s", task.id,
                     state or "unknown")
            return
        log.warning("could not withdraw task %s, refused to its caller, in %.0f s: it may run",
                    task.id, WITHDRAW_PATIENCE_SECONDS)

    async def idempotent(self, owner: str, idempotency_key: str) -> str | None:
        """The id of the task a submit with this owner's key made (within its retention)."""
        found = await self.redis.get(keys.idempotency(owner, idempotency_key))
        return None if found is None else text(found)

    async def get(self, task_id: str) -> Task | None:
        raw = await self.redis.hgetall(keys.task(task_id))
        return Task.from_hash(raw) if raw else None

    async def tasks(self, task_ids: list[str]) -> list[Task | None]:
        """Several task records in one round trip (None for an expired one)."""
        async with self.redis.pipeline(transaction=False) as pipe:
            for task_id in task_ids:
                pipe.hgetall(keys.task(task_id))
            raws = await pipe.execute()
        return [Task.from_hash(raw) if raw else None for raw in raws]

    async def start(self, task_id: str, worker: str, deliveries: int, backend: str,
                    unconfirmed_too: bool = False) -> int:
        """Mark RUNNING and open a new attempt: its number, 0 if already terminal, -1 if gone,
        -2 if its deadline passed while queued (then it is FAILED deadline_exceeded), -3 if
        no replica has confirmed its submit yet (unless `unconfirmed_too`)."""
        started = int(await self._start(
            keys=[keys.task(task_id), keys.events(task_id), keys.backlog(backend),
                  keys.input_blob(task_id), keys.webhooks_due(), keys.speech_chunks(task_id),
                  keys.deadlines(backend)],
            args=[worker, repr(time.time()), deliveries, self.retention, task_id,
                  "1" if unconfirmed_too else ""]))
        if started == -2:
            self.blobs.delete_input_file(task_id)
        return started

    async def finish(
        self,
        task: Task,
        state: TaskState,
        *,
        attempt: int | None,
        entry_id: str,
        result: dict[str, Any] | None = None,
        error: str = "",
        error_code: str = "",
        output: bytes | None = None,
        worker: str = "",
        again: bool = False,
    ) -> bool:
        """Store the terminal state (fenced by attempt and, unless "", the `worker` that
        started it) with its output (`again`: this call repeats one no replica confirmed, and
        counts as stored if that one was), delete the input,
        then ack; False if this write lost (its output is then discarded). NotReplicated
        (its `result`: stored or not) when no replica confirmed it after FINISH_WAITS waits:
        the input file then stays for a redelivery (the sweeper removes it later)."""
        assert state in TERMINAL_STATES
        output_file = ""
        if self.blobs.in_file(output):
            assert output is not None
            output_file = await self.blobs.write_output_file(task.id, attempt, output, worker)
        try:
            stored = bool(await self.replicas.call(
                self.redis, self._finish,
                keys=[keys.task(task.id), keys.queue(task.backend, task.lane),
                      keys.events(task.id), keys.input_blob(task.id), keys.output_blob(task.id),
                      keys.backlog(task.backend), keys.webhooks_due(),
                      keys.speech_chunks(task.id)],
                args=["" if attempt is None else attempt, entry_id, keys.WORKER_GROUP,
                      state.value, repr(time.time()), self.retention,
                      strict_json(result) if result is not None else "", one_line(error),
                      error_code, b"" if output_file or output is None else output,
                      output_file, usage.measured(task.charge, state, result),
                      strict_json(result.get("usage") or {}) if result is not None else "",
                      worker, "1" if again else ""],
                tries=FINISH_WAITS))
        except NotReplicated as short:
            if output_file and not short.result:
                self.blobs.delete_output_file(output_file)
            raise
        if stored:
            self.blobs.delete_input_file(task.id)
        else:
            self.blobs.delete_output_file(output_file)
        return stored

    async def cancel(self, task_id: str, backend: str) -> str:
        """Cancel a PENDING task; returns the task's state afterwards ("" if unknown).
        NotReplicated (a StoreError: the caller's 503) when no replica confirmed it: a
        cancel the primary's death loses would leave its client told CANCELLED of a task that
        then runs; a retry is safe."""
        try:
            state = await self.replicas.call(
                self.redis, self._cancel,
                keys=[keys.task(task_id), keys.queue(backend), keys.events(task_id),
                      keys.input_blob(task_id), keys.backlog(backend), keys.webhooks_due(),
                      keys.speech_chunks(task_id)],
                args=[repr(time.time()), self.retention])
        except NotReplicated as short:
            if text(short.result) == TaskState.CANCELLED:
                raise
            state = short.result  # nothing was written: nothing to confirm
        state = text(state)
        if state == TaskState.CANCELLED:
            self.blobs.delete_input_file(task_id)
        return state

    async def fail_if_unchanged(self, task: Task, error: str, error_code: str) -> bool:
        """FAIL `task` only if it is still in the state and attempt it was read with: the
        check is inside the Lua call, so a task a worker starts meanwhile is never failed.
        It waits for a replica like any terminal write; unconfirmed, it stands on the primary
        (the sweeper tells no client itself) and its input file stays for the sweeper."""
        try:
            failed = bool(await self.replicas.call(
                self.redis, self._fail_if_unchanged,
                keys=[keys.task(task.id), keys.queue(task.backend, task.lane),
                      keys.events(task.id), keys.input_blob(task.id), keys.backlog(task.backend),
                      keys.webhooks_due(), keys.speech_chunks(task.id)],
                args=[task.state.value, task.attempt, task.entry_id, keys.WORKER_GROUP,
                      repr(time.time()), self.retention, one_line(error), error_code]))
        except NotReplicated as short:
            return bool(short.result)
        if failed:
            self.blobs.delete_input_file(task.id)
        return failed

    async def spare_deliveries(self, task_ids: list[str]) -> None:
        """One delivery of each task is not its doing (a graceful stop cut its attempt
        short, or a worker gave back an entry it never started): SPEECH_MAX_DELIVERIES does
        not count it (`Task.spared`)."""
        for task_id in task_ids:
            await self._spare(keys=[keys.task(task_id)])

    async def in_flight(self, owner: str) -> int:
        """How many of `owner`'s tasks are queued or running (counted with keys on)."""
        return int(await self.redis.get(keys.in_flight(owner)) or 0)

    async def publish(self, task_id: str, event: dict[str, Any]) -> None:
        await self.redis.publish(keys.events(task_id), json.dumps(event))
