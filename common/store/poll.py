"""A status poll in one round trip: the task's fields that a reply carries and, for a queued
task, its queue position and what its estimate reads (the backlog, the rates, the live
workers), all in one Lua call.

The keys the script reads depend on the task's backend and lane, known only once its hash is
read, so the script is given them as templates (common/keys.py builds them, with
keys.BACKEND_SLOT where the backend goes) and fills the backend in: no key is spelled here.
"""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from common import keys
from common.schemas import TaskState
from common.store import admission, positions
from common.store.record import Task
from common.store.values import LUA_NOW_MS, text

#: the task's fields a poll reads, in the script's order
FIELDS = ("state", "owner", "backend", "model", "lane", "work", "audio_seconds", "entry_id",
          "queue_seq", "error", "error_code", "result", "usage")

# KEYS: the task | ARGV: group, the backend slot, then the templates: the batch queue, its
# counter, the interactive queue, its counter, the backlog, the rates, the live set
# -> {} for no task, {fields} unless it is PENDING, else {fields, position (-1: unknown),
#    backlog (flat hash), rates (flat hash), live workers}
_POLL = LUA_NOW_MS + positions.LUA + """
local f = redis.call('HMGET', KEYS[1], 'state', 'owner', 'backend', 'model', 'lane', 'work',
                     'audio_seconds', 'entry_id', 'queue_seq', 'error', 'error_code', 'result',
                     'usage')
if not f[1] then return {} end
if f[1] ~= 'PENDING' or not f[8] or not f[3] then return {f} end
local backend = f[3]
local function key(template)
  local i, j = string.find(template, ARGV[2], 1, true)
  return string.sub(template, 1, i - 1) .. backend .. string.sub(template, j + 1)
end
local group = ARGV[1]
local at
if f[5] == 'interactive' then
  at = position(f[8], tonumber(f[9]) or 0, key(ARGV[5]), key(ARGV[6]), group)
else
  at = position(f[8], tonumber(f[9]) or 0, key(ARGV[3]), key(ARGV[4]), group,
                key(ARGV[5]), key(ARGV[6]))
end
return {f, at, redis.call('HGETALL', key(ARGV[7])), redis.call('HGETALL', key(ARGV[8])),
        redis.call('ZCOUNT', key(ARGV[9]), now, '+inf')}
"""


@dataclass(frozen=True, slots=True)
class Poll:
    #: the record's poll fields only (no params, no charge): what a reply and an estimate read
    task: Task
    result: bytes | None  # the result as stored (JSON), not decoded
    usage: bytes | None  # its `usage` as stored at the terminal write (JSON; None: older task)
    position: int | None  # a PENDING task's queue position (see positions.LUA)
    #: what a PENDING task's estimate reads (None otherwise)
    outlook: tuple[admission.Backlog, admission.Rates, int] | None


class PollReader:
    def __init__(self, redis: Redis) -> None:
        self._poll = redis.register_script(_POLL)
        slot = keys.BACKEND_SLOT
        self._args = [keys.WORKER_GROUP, slot,
                      keys.queue(slot, keys.BATCH), keys.queue_counter(slot, keys.BATCH),
                      keys.queue(slot, keys.INTERACTIVE),
                      keys.queue_counter(slot, keys.INTERACTIVE),
                      keys.backlog(slot), keys.rate(slot), keys.live(slot)]

    async def read(self, task_id: str) -> Poll | None:
        reply = await self._poll(keys=[keys.task(task_id)], args=self._args)
        if not reply:
            return None
        raw = dict(zip(FIELDS, reply[0], strict=True))

        def field(name: str) -> str:
            value = raw[name]
            return text(value) if value is not None else ""

        def number(name: str) -> float | None:
            value = raw[name]
            return float(value) if value else None

        task = Task(id=task_id, backend=field("backend"), model=field("model"),
                    state=TaskState(field("state")), owner=field("owner"),
                    lane=field("lane") or keys.BATCH, work=number("work"),
                    audio_seconds=number("audio_seconds"), entry_id=field("entry_id"),
                    queue_seq=int(raw["queue_seq"] or 0), error=field("error"),
                    error_code=field("error_code"))
        if len(reply) == 1:
            return Poll(task, raw["result"] or None, raw["usage"] or None, None, None)
        _, at, backlog, rates, live = reply
        outlook = (admission.backlog_of(_pairs(backlog)), admission.rates_of(_pairs(rates)),
                   int(live))
        return Poll(task, None, None, None if int(at) < 0 else int(at), outlook)


def _pairs(flat: list[bytes]) -> dict[str, str]:
    return {text(k): text(v) for k, v in zip(flat[::2], flat[1::2], strict=True)}
