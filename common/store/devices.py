"""The device memory broker's side of Redis: per device, a budget, the reservations that
hold it (each a lease its worker renews), the loads waiting in line, and evictions.

Every change is one Lua call, timed by Redis's own clock (`TIME`), so workers on hosts
whose clocks differ still agree on who has expired:

- `reserve`: purge expired holders (but those whose process its host sees alive: a stopped
  worker still holds its memory) and waiters; a need above the whole budget is refused at
  once; the first load in line (FIFO by arrival) whose need fits takes its reservation;
  otherwise it stays in line, and the head of the line asks idle holders (no task running),
  least recently used first, to yield just enough (an `evict` flag their host honours), and
  once it has been the head for its patience, busy ones too (each yields after its call);
  holders past their lease (stopped) are never asked: they cannot answer;
- `release`: a holder gives its reservation back (counted as an eviction when asked to);
- `mark`: a holder starts or ends a task; asked to yield, it is told so (and is not marked
  busy: it yields before the task), while a load still waits in line;
- `renew`: the lease of a holder or a waiter is extended; answers whether it is asked to
  yield. A request to yield stands while any load waits in line, and lapses with the line.

The gateway reads `devices` for /ready and /metrics.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis

from common import keys
from common.store.values import LUA_NOW_S, text

# a consumer's reservation in the holders hash, or nil. One whose lease lapsed but is still
# there was never given to anyone (`reserve` purges lapsed holders unless their process is
# alive), so its holder may renew it: a worker that was stopped and resumed holds on.
_HOLDER = LUA_NOW_S + """
local function holder(key, consumer)
  local raw = redis.call('HGET', key, consumer)
  if not raw then return nil end
  return cjson.decode(raw)
end
"""

# `keep`: names whose lapsed lease still stands (a holder its host sees alive but not
# renewing: SIGSTOPped, or stalled in a long call, still holds the memory it reserved)
_PURGE = """
local function live(key, keep)
  local all = redis.call('HGETALL', key)
  local found = {}
  for i = 1, #all, 2 do
    local entry = cjson.decode(all[i + 1])
    if entry.expires < now and not keep[all[i]] then redis.call('HDEL', key, all[i])
    else found[all[i]] = entry end
  end
  return found
end
"""

# A recorded peak (KEYS peaks, field "<backend>/<model>[:<class>]", its time in "…@at") ages
# out after its max age, and one above the whole budget (while the configured need fits)
# after one lease: it is measured again rather than refusing every later load for ever.
_PEAK = """
local function peak_of(peaks, name, configured, budget, lease, max_age)
  local peak = tonumber(redis.call('HGET', peaks, name) or '') or 0
  local at = tonumber(redis.call('HGET', peaks, name .. '@at') or '') or now
  if peak > 0 and ((max_age > 0 and now - at > max_age)
                   or (peak > budget and configured <= budget and now - at > lease)) then
    redis.call('HDEL', peaks, name, name .. '@at')
    return 0
  end
  return peak
end
"""

# KEYS: device, holders, waiting, peaks, devices
# ARGV: consumer, backend, model, need (MiB, from settings), budget, lease seconds, device id,
#       the peak's field, the peaks' max age (seconds, 0 = never), the model's plain peak
#       field to start from when the class is not measured yet ("" = the peak is the plain
#       one), this process's identity (workers/processes.py), the seconds after which the
#       head of the line asks busy holders to yield too (after their call),
#       then the holders whose lapsed leases still stand (their processes are alive)
# -> {1, need, reserved after, measured} taken | {0, need, place in line, measured} waiting |
#    {-1, need, budget, measured} never fits (the device's `refused:<field>` says so until a
#    reservation of it succeeds); measured: 1 when a recorded peak was known
_RESERVE = LUA_NOW_S + _PURGE + _PEAK + """
redis.call('SADD', KEYS[5], ARGV[7])
redis.call('HSET', KEYS[1], 'budget', ARGV[5])
local me, lease, budget = ARGV[1], tonumber(ARGV[6]), tonumber(ARGV[5])
local alive = {}
for i = 13, #ARGV do alive[ARGV[i]] = true end
local holders, waiting = live(KEYS[2], alive), live(KEYS[3], {})
local need = tonumber(ARGV[4])
local peak = peak_of(KEYS[4], ARGV[8], need, budget, lease, tonumber(ARGV[9]))
local measured = 0
if peak > 0 then measured = 1
elseif ARGV[10] ~= '' then  -- a class not measured yet starts from a lighter one's peak
  peak = peak_of(KEYS[4], ARGV[10], need, budget, lease, tonumber(ARGV[9]))
end
if peak > need then need = peak end
if need > budget then
  redis.call('HDEL', KEYS[3], me)
  redis.call('HSET', KEYS[1], 'refused:' .. ARGV[8],
             cjson.encode({need = need, budget = budget, at = now}))
  return {-1, need, budget, measured}
end
-- a reservation of our own is replaced by this one; growing it in place does not wait in
-- line (a waiter may be waiting for the very memory this holder's model already uses)
local holding = holders[me] ~= nil
holders[me] = nil
local reserved = 0
for _, h in pairs(holders) do reserved = reserved + h.mib end
local since = waiting[me] and waiting[me].since or now
local head = waiting[me] and waiting[me].head or nil
local ahead = 0
for name, w in pairs(waiting) do
  if name ~= me and (w.since < since or (w.since == since and name < me)) then
    ahead = ahead + 1
  end
end
if (ahead == 0 or holding) and reserved + need <= budget then
  redis.call('HDEL', KEYS[3], me)
  redis.call('HDEL', KEYS[1], 'refused:' .. ARGV[8])
  redis.call('HSET', KEYS[2], me, cjson.encode({backend = ARGV[2], model = ARGV[3], mib = need,
             busy = 1, evict = 0, last_used = now, expires = now + lease,
             process = ARGV[11]}))
  return {1, need, reserved + need, measured}
end
if ahead == 0 and not head then head = now end  -- the head of the line from now on
redis.call('HSET', KEYS[3], me, cjson.encode({backend = ARGV[2], model = ARGV[3], need = need,
           since = since, head = head, expires = now + lease}))
if ahead == 0 then
  -- the head of the line: ask idle holders, least recently used first, to yield enough; past
  -- its patience, busy ones too (each yields after its call: a holder with a steady queue is
  -- busy call after call, and would never be idle when the waiter looks)
  local free = budget - reserved
  local idle, busy = {}, {}
  for name, h in pairs(holders) do
    if h.evict == 1 then free = free + h.mib
    elseif h.expires < now then  -- stopped (its process alive): it cannot yield, nor answer
    elseif h.busy == 0 then table.insert(idle, {name, h})
    else table.insert(busy, {name, h}) end
  end
  local function by_use(a, b) return a[2].last_used < b[2].last_used end
  table.sort(idle, by_use)
  table.sort(busy, by_use)
  if now - head >= tonumber(ARGV[12]) then
    for _, pair in ipairs(busy) do table.insert(idle, pair) end
  end
  for _, pair in ipairs(idle) do
    if free >= need then break end
    pair[2].evict = 1
    redis.call('HSET', KEYS[2], pair[1], cjson.encode(pair[2]))
    free = free + pair[2].mib
  end
end
return {0, need, ahead + 1, measured}
"""

# KEYS: peaks | ARGV: the peak's field, MiB, max age (seconds, 0 = never) -> the peak kept
# A lighter measurement never lowers a live peak (a light first task would leave heavier
# ones over their reservation); the peak is replaced once it has aged out.
_RECORD_PEAK = LUA_NOW_S + """
local old = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '') or 0
local at = tonumber(redis.call('HGET', KEYS[1], ARGV[1] .. '@at') or '') or 0
local max_age, mib = tonumber(ARGV[3]), tonumber(ARGV[2])
if old >= mib and (max_age <= 0 or now - at <= max_age) then return tostring(old) end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2], ARGV[1] .. '@at', now)
return ARGV[2]
"""

# KEYS: device, holders, waiting | ARGV: consumer -> 1 if it held a reservation
_RELEASE = """
redis.call('HDEL', KEYS[3], ARGV[1])
local raw = redis.call('HGET', KEYS[2], ARGV[1])
if not raw then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
if cjson.decode(raw).evict == 1 then redis.call('HINCRBY', KEYS[1], 'evictions', 1) end
return 1
"""

# `asked(h, waiting)`: the holder is asked to yield, and a load still waits in line; a request
# whose line has gone (the waiter served elsewhere, timed out, cancelled) is withdrawn
_ASKED = """
local function asked(h, waiting)
  if h.evict ~= 1 then return false end
  for _, raw in pairs(redis.call('HVALS', waiting)) do
    if cjson.decode(raw).expires >= now then return true end
  end
  h.evict = 0
  return false
end
"""

# KEYS: holders, waiting | ARGV: consumer, busy (1/0), lease seconds -> 1, 2 if asked to
# yield (a request a new call does not withdraw: the holder yields before it, so it is not
# marked busy), 0 if it holds nothing
_MARK = _HOLDER + _ASKED + """
local h = holder(KEYS[1], ARGV[1])
if not h then return 0 end
h.expires = now + tonumber(ARGV[3])
local yield = asked(h, KEYS[2])
if yield and tonumber(ARGV[2]) == 1 then
  redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(h))
  return 2
end
h.busy = tonumber(ARGV[2])
h.last_used = now
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(h))
if yield then return 2 end
return 1
"""

# KEYS: holders, waiting | ARGV: consumer, lease seconds
# -> 2 holding and asked to yield, 1 holding, 0 holding nothing
_RENEW = _HOLDER + _ASKED + """
local raw = redis.call('HGET', KEYS[2], ARGV[1])
if raw then
  local w = cjson.decode(raw)
  w.expires = now + tonumber(ARGV[2])
  redis.call('HSET', KEYS[2], ARGV[1], cjson.encode(w))
end
local h = holder(KEYS[1], ARGV[1])
if not h then return 0 end
h.expires = now + tonumber(ARGV[2])
local yield = asked(h, KEYS[2])
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(h))
if yield then return 2 end
return 1
"""


@dataclass(frozen=True, slots=True)
class Reservation:
    """What a `reserve` call came to."""

    status: int  # 1 reserved, 0 waiting in line, -1 can never fit
    need: float  # MiB asked for: the configured need or the recorded peak, whichever is more
    value: float  # reserved after (1), place in line (0), the budget (-1)
    measured: bool = True  # a recorded peak was known (else this load measures one)

    @property
    def reserved(self) -> bool:
        return self.status == 1

    @property
    def never_fits(self) -> bool:
        return self.status == -1


#: `busy_yield_after` for a waiter that never asks busy holders to yield
NEVER = 1e12


class DeviceLedger:
    """One worker's calls to the broker of one device (as consumer `consumer`)."""

    def __init__(self, redis: Redis, device_id: str, consumer: str) -> None:
        self.device_id = device_id
        self.consumer = consumer
        self._redis = redis
        self._keys = (keys.device(device_id), keys.device_holders(device_id),
                      keys.device_waiting(device_id))
        self._reserve = redis.register_script(_RESERVE)
        self._release = redis.register_script(_RELEASE)
        self._mark = redis.register_script(_MARK)
        self._renew = redis.register_script(_RENEW)
        self._record_peak = redis.register_script(_RECORD_PEAK)

    async def register(self, budget_mib: int) -> None:
        """Make the device and its budget visible before any load."""
        pipe = self._redis.pipeline(transaction=True)
        pipe.sadd(keys.devices(), self.device_id)
        pipe.hset(self._keys[0], "budget", budget_mib)
        await pipe.execute()

    async def reserve(self, backend: str, model: str, need_mib: float, budget_mib: int,
                      lease_seconds: float, peak_class: str = "",
                      peak_max_age: float = 0.0, process: str = "",
                      alive: Sequence[str] = (), lighter_class: str = "",
                      busy_yield_after: float = NEVER) -> Reservation:
        """`process`: this worker's process identity, kept with its reservation; `alive`:
        holders whose leases stand though lapsed (their processes still exist);
        `lighter_class`: the class whose peak an unmeasured `peak_class` starts from;
        `busy_yield_after`: seconds in line after which, at its head, busy holders are asked
        to yield too (idle ones at once)."""
        status, need, value, measured = await self._reserve(
            keys=[*self._keys, keys.model_peaks(), keys.devices()],
            args=[self.consumer, backend, model, need_mib, budget_mib, lease_seconds,
                  self.device_id, peak_field(backend, model, peak_class), peak_max_age,
                  peak_field(backend, model, lighter_class) if peak_class else "", process,
                  repr(float(busy_yield_after)), *alive])
        return Reservation(int(status), float(need), float(value), bool(measured))

    async def holder_processes(self) -> dict[str, str]:
        """Each holder's process identity (lapsed leases included; "" for none recorded)."""
        raw = await self._redis.hgetall(self._keys[1])
        return {text(name): json.loads(entry).get("process", "") for name, entry in raw.items()}

    async def release(self) -> bool:
        return bool(await self._release(keys=list(self._keys), args=[self.consumer]))

    async def mark(self, busy: bool, lease_seconds: float) -> int:
        """1: marked; 2: marked, and asked to yield; 0: this worker holds no reservation (it
        expired, or Redis lost it)."""
        return int(await self._mark(keys=[self._keys[1], self._keys[2]],
                                    args=[self.consumer, int(busy), lease_seconds]))

    async def renew(self, lease_seconds: float) -> int:
        """2: holding and asked to yield; 1: holding; 0: holding nothing."""
        return int(await self._renew(keys=[self._keys[1], self._keys[2]],
                                     args=[self.consumer, lease_seconds]))

    async def leave_line(self) -> None:
        await self._redis.hdel(self._keys[2], self.consumer)

    async def record_peak(self, backend: str, model: str, mib: float, peak_class: str = "",
                          max_age: float = 0.0) -> float:
        """Record a measured peak (kept if a live one is higher); the peak kept."""
        return float(await self._record_peak(
            keys=[keys.model_peaks()],
            args=[peak_field(backend, model, peak_class), round(mib, 1), max_age]))

    async def peak(self, backend: str, model: str, peak_class: str = "") -> float | None:
        raw = await self._redis.hget(keys.model_peaks(), peak_field(backend, model, peak_class))
        return float(raw) if raw is not None else None


def peak_field(backend: str, model: str, peak_class: str = "") -> str:
    """A peak's name: per model and class (a diarized task's peak is not a plain one's)."""
    return f"{backend}/{model}" + (f":{peak_class}" if peak_class else "")


# --- the gateway's side: what /ready and /metrics show --------------------------------------

@dataclass(slots=True)
class DeviceView:
    device: str
    budget_mib: float
    reserved_mib: float
    evictions: int
    holders: dict[str, dict[str, Any]] = field(default_factory=dict)
    waiting: list[dict[str, Any]] = field(default_factory=list)  # first in line first
    #: loads refused as larger than the whole budget, until one of them fits again
    refused: list[dict[str, Any]] = field(default_factory=list)
    #: holders past their lease still on record: stopped (SIGSTOP, a stall; their memory is
    #: still counted by the next reservation while their process lives) or dead (dropped
    #: by the next reservation)
    lapsed: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def free_mib(self) -> float:
        return max(0.0, self.budget_mib - self.reserved_mib)

    def public(self) -> dict[str, Any]:
        return {"budget_mib": self.budget_mib, "reserved_mib": self.reserved_mib,
                "free_mib": self.free_mib, "waiting_loads": len(self.waiting),
                "evictions": self.evictions, "holders": self.holders, "waiting": self.waiting,
                "refused_loads": len(self.refused), "refused": self.refused,
                "lapsed_holders": len(self.lapsed), "lapsed": self.lapsed,
                # what the lapsed hold: a load on their host still counts it while their
                # processes live, so free_mib may be this much less in truth
                "lapsed_mib": sum(float(h["mib"]) for h in self.lapsed.values())}


async def devices(redis: Redis) -> list[DeviceView]:
    """Every registered device; holders past their lease apart (`lapsed`)."""
    seconds, micros = await redis.time()
    now = seconds + micros / 1e6
    views = []
    for raw_id in sorted(await redis.smembers(keys.devices())):
        device_id = raw_id.decode()
        pipe = redis.pipeline(transaction=True)
        pipe.hgetall(keys.device(device_id))
        pipe.hgetall(keys.device_holders(device_id))
        pipe.hgetall(keys.device_waiting(device_id))
        info, holders, waiting = await pipe.execute()
        recorded = {k.decode(): json.loads(v) for k, v in holders.items()}
        live = {k: v for k, v in recorded.items() if v["expires"] >= now}
        queued = [{"consumer": k.decode(), **json.loads(v)} for k, v in waiting.items()]
        queued = sorted((w for w in queued if w["expires"] >= now),
                        key=lambda w: (w["since"], w["consumer"]))
        views.append(DeviceView(
            device_id, float(info.get(b"budget", 0)), sum(h["mib"] for h in live.values()),
            int(info.get(b"evictions", 0)),
            {k: {f: v[f] for f in ("backend", "model", "mib", "busy", "evict")}
             for k, v in live.items()},
            [{f: w[f] for f in ("consumer", "backend", "model", "need")}
             | {"waiting_seconds": round(now - w["since"], 3)} for w in queued],
            _refused(info, now),
            {k: {f: v[f] for f in ("backend", "model", "mib")}
             | {"lapsed_seconds": round(now - v["expires"], 1)}
             for k, v in recorded.items() if k not in live}))
    return views


def _refused(info: dict[bytes, bytes], now: float) -> list[dict[str, Any]]:
    found = []
    for name, raw in info.items():
        if name.startswith(b"refused:"):
            entry = json.loads(raw)
            found.append({"model": name.decode().removeprefix("refused:"),
                          "need_mib": entry["need"], "budget_mib": entry["budget"],
                          "seconds_ago": round(now - entry["at"], 1)})
    return sorted(found, key=lambda entry: entry["model"])
