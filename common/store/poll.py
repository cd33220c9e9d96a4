"""A status poll in one round trip: the task's fields that a reply carries and, for a queued
task, its queue position and what its estimate reads (the backlog, the rates, the live
workers), all in one Lua call.

Polls that arrive together share that call: every poll made in one turn of the event loop
waits for the next turn, when one script call reads all of them (KEYS: one task each). Under
load a process's Redis writes, reads and reply parsing are then paid once per turn, not once
per poll (they were a third of a poll's CPU); a lone poll waits one loop turn, microseconds.

The keys the script reads depend on the task's backend and lane, known only once its hash is
read, so the script is given them as templates (common/keys.py builds them, with
keys.BACKEND_SLOT where the backend goes) and fills the backend in: no key is spelled here.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from common import keys
from common.schemas import TaskState
from common.store import admission, positions
from common.store.connection import within_deadline
from common.store.record import Task
from common.store.values import LUA_NOW_MS, text

#: polls read by one script call at most (one call blocks Redis while it runs)
MOST_PER_CALL = 64
#: the task's fields a poll reads, in the script's order
FIELDS = ("state", "owner", "backend", "model", "lane", "work", "audio_seconds", "entry_id",
          "queue_seq", "error", "error_code", "result", "usage", "held")

# KEYS: the tasks, one per poll | ARGV: group, the backend slot, then the templates: the batch
# queue, its counter, the interactive queue, its counter, the backlog, the rates, the live set
# -> {replies, outlooks}: per task {} for no task, {fields} unless it is PENDING, else
#    {fields, position (-1: unknown)}, or Redis's error reading it (a key of another type:
#    another application's); per backend of a PENDING task, once: backend, its
#    backlog (flat hash), rates (flat hash), live workers
_POLL = LUA_NOW_MS + positions.LUA + """
local outlooks, seen = {}, {}
local function poll(task)
local f = redis.pcall('HMGET', task, 'state', 'owner', 'backend', 'model', 'lane', 'work',
                      'audio_seconds', 'entry_id', 'queue_seq', 'error', 'error_code', 'result',
                      'usage', 'held')
if f.err then return f.err end  -- this poll's own error, not every poll's of the call
if not f[1] then return {} end
if f[1] ~= 'PENDING' or not (f[8] or f[14]) or not f[3] then return {f} end
local backend = f[3]
local function key(template)
  local i, j = string.find(template, ARGV[2], 1, true)
  return string.sub(template, 1, i - 1) .. backend .. string.sub(template, j + 1)
end
local group = ARGV[1]
local at
local stream, counter, istream, icounter
if f[5] == 'interactive' then
  stream, counter = key(ARGV[5]), key(ARGV[6])
else
  stream, counter, istream, icounter = key(ARGV[3]), key(ARGV[4]), key(ARGV[5]), key(ARGV[6])
end
if f[14] then  -- in its owner's line (shares.py)
  at = held_position(f[14], task, stream, counter, group, istream, icounter)
else
  at = position(f[8], tonumber(f[9]) or 0, stream, counter, group, istream, icounter)
end
if not seen[backend] then
  seen[backend] = true
  for _, value in ipairs({backend, redis.call('HGETALL', key(ARGV[7])),
                          redis.call('HGETALL', key(ARGV[8])),
                          redis.call('ZCOUNT', key(ARGV[9]), now, '+inf')}) do
    table.insert(outlooks, value)
  end
end
return {f, at}
end
local replies = {}
for i, task in ipairs(KEYS) do replies[i] = poll(task) end
return {replies, outlooks}
"""


Outlook = tuple[admission.Backlog, admission.Rates, int]


@dataclass(frozen=True, slots=True)
class Poll:
    #: the record's poll fields only (no params, no charge): what a reply and an estimate read
    task: Task
    result: bytes | None  # the result as stored (JSON), not decoded
    usage: bytes | None  # its `usage` as stored at the terminal write (JSON; None: older task)
    position: int | None  # a PENDING task's queue position (see positions.LUA)
    #: what a PENDING task's estimate reads (None otherwise)
    outlook: Outlook | None


class PollReader:
    def __init__(self, redis: Redis) -> None:
        self._poll = redis.register_script(_POLL)
        slot = keys.BACKEND_SLOT
        self._args = [keys.WORKER_GROUP, slot,
                      keys.queue(slot, keys.BATCH), keys.queue_counter(slot, keys.BATCH),
                      keys.queue(slot, keys.INTERACTIVE),
                      keys.queue_counter(slot, keys.INTERACTIVE),
                      keys.backlog(slot), keys.rate(slot), keys.live(slot)]

        #: the polls waiting for this loop turn's call: (task id, where its reply goes)
        self._waiting: list[tuple[str, asyncio.Future[Any]]] = []
        self._calls: set[asyncio.Task[None]] = set()
        #: backend -> (the outlook's bytes as last read, parsed)
        self._last_outlooks: dict[str, tuple[list[Any], Outlook]] = {}

    async def read(self, task_id: str) -> Poll | None:
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[Any] = loop.create_future()
        self._waiting.append((task_id, reply))
        if len(self._waiting) == 1:
            loop.call_soon(self._call)
        return _parsed(task_id, *await within_deadline(reply))

    def _call(self) -> None:
        waiting, self._waiting = self._waiting, []
        loop = asyncio.get_running_loop()
        for first in range(0, len(waiting), MOST_PER_CALL):
            call = loop.create_task(self._read_all(waiting[first:first + MOST_PER_CALL]))
            self._calls.add(call)  # a running task needs a reference, or it may be collected
            call.add_done_callback(self._calls.discard)

    async def _read_all(self, polls: list[tuple[str, asyncio.Future[Any]]]) -> None:
        try:
            replies, flat = await self._poll(
                keys=[keys.task(task_id) for task_id, _ in polls], args=self._args)
        except asyncio.CancelledError:
            for _, reply in polls:
                reply.cancel()
            raise
        except Exception as exc:  # every poll of the call gets the store's error
            for _, reply in polls:
                if not reply.done():
                    reply.set_exception(exc)
            return
        outlooks = {text(flat[i]): self._outlook(text(flat[i]), flat[i + 1:i + 4])
                    for i in range(0, len(flat), 4)}
        for (_, reply), found in zip(polls, replies, strict=True):
            if not reply.done():  # a poll whose request was cancelled meanwhile is skipped
                reply.set_result((found, outlooks))


    def _outlook(self, backend: str, raw: list[Any]) -> Outlook:
        """A backend's outlook, parsed once per change: polls between two writes to its
        backlog or rates read the same bytes, and reuse what the last call parsed."""
        last = self._last_outlooks.get(backend)
        if last is not None and last[0] == raw:
            return last[1]
        backlog, rates, live = raw
        parsed = (admission.backlog_of(_pairs(backlog)), admission.rates_of(_pairs(rates)),
                  int(live))
        self._last_outlooks[backend] = (raw, parsed)
        return parsed


class UnknownState(ValueError):
    """A record in a state this version does not know (a newer one wrote it, during a
    rolling upgrade): the task lives on, whatever this reader makes of it."""


def _parsed(task_id: str, reply: list[Any] | bytes,
            outlooks: dict[str, Outlook]) -> Poll | None:
    if isinstance(reply, bytes):  # the read of this task's key failed (WRONGTYPE)
        raise ResponseError(text(reply))
    if not reply:
        return None
    raw = dict(zip(FIELDS, reply[0], strict=True))
    state = text(raw["state"] or b"")
    if state not in TaskState.__members__:
        raise UnknownState(f"task {task_id} is in a state this version does not know: "
                           f"{state[:40]!r}")

    def field(name: str) -> str:
        value = raw[name]
        return text(value) if value is not None else ""

    def number(name: str) -> float | None:
        value = raw[name]
        return float(value) if value else None

    task = Task(id=task_id, backend=field("backend"), model=field("model"),
                state=TaskState(state), owner=field("owner"),
                lane=field("lane") or keys.BATCH, work=number("work"),
                audio_seconds=number("audio_seconds"), entry_id=field("entry_id"),
                queue_seq=int(raw["queue_seq"] or 0), error=field("error"),
                error_code=field("error_code"))
    if len(reply) == 1:
        return Poll(task, raw["result"] or None, raw["usage"] or None, None, None)
    at = int(reply[1])
    return Poll(task, None, None, None if at < 0 else at, outlooks[task.backend])


def _pairs(flat: list[bytes]) -> dict[str, str]:
    return {text(k): text(v) for k, v in zip(flat[::2], flat[1::2], strict=True)}
