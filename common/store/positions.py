"""Where a queued task stands, and how deep a backend's lanes are, exact across Redis
restarts: each entry carries its own number in its lane's add order (the submit script's
counter, keys.queue_counter), so a position is one subtraction from the first entry not yet
handed to a worker. Each answer is one Lua call (one round trip)."""

from __future__ import annotations

from redis.asyncio import Redis

from common import keys
from common.store.record import Task

# Lua functions, for the scripts below and the status poll's (poll._POLL), which only read
# (so a queue's head, read once, holds for the whole call: one poll call reads many tasks):
# queue_head -> the last delivered entry id, the number of the first entry not yet delivered
#   (0 = none, -1 = it has no number), the last number, entries delivered and not yet acked;
# lane_depth -> entries not yet handed to any worker, entries handed out and not yet acked;
# position -> 1 for the next entry a worker will read, 2 behind it …; 0 once handed to a
#   worker (it is about to start); -1 when the entry predates per-entry numbers. A batch
#   task (`istream` given) also counts every interactive entry waiting now (best effort:
#   interactive work queued later still goes first, and an old batch entry promoted past
#   the interactive lane goes earlier).
# held_position -> the same for a task waiting in its owner's line (shares.py): behind every
#   entry waiting in the lane now and the owner's tasks ahead of it in the line (at least
#   that: other keys' work queued meanwhile enters the lane before its turn comes); -1 past
#   the line's first 1000.
LUA = """
local heads = {}
local function read_queue_head(stream, counter, group)
  local delivered, pending = '0-0', 0
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', stream)
  if not ok then return '0-0', 0, 0, 0 end
  for _, g in ipairs(groups) do
    local f = {}
    for i = 1, #g, 2 do f[g[i]] = g[i + 1] end
    if f['name'] == group then delivered, pending = f['last-delivered-id'], f['pending'] end
  end
  local last = tonumber(redis.call('GET', counter) or '0')
  local head = redis.call('XRANGE', stream, '(' .. delivered, '+', 'COUNT', 1)
  local first = 0
  if #head > 0 then
    first = -1
    local fields = head[1][2]
    for i = 1, #fields, 2 do if fields[i] == 'seq' then first = tonumber(fields[i + 1]) end end
  end
  return delivered, first, last, pending
end
local function queue_head(stream, counter, group)
  local key = stream .. '\0' .. counter .. '\0' .. group
  if not heads[key] then heads[key] = {read_queue_head(stream, counter, group)} end
  return unpack(heads[key])
end
local function lane_depth(stream, counter, group)
  local _, first, last, pending = queue_head(stream, counter, group)
  local waiting = 0
  if first < 0 then waiting = redis.call('XLEN', stream)
  elseif first > 0 then waiting = math.max(0, last - first + 1) end
  return waiting, pending
end
local function entry_after(a, b)
  local am, aseq = string.match(a, '(%d+)-?(%d*)')
  local bm, bseq = string.match(b, '(%d+)-?(%d*)')
  am, bm = tonumber(am), tonumber(bm)
  return am > bm or (am == bm and (tonumber(aseq) or 0) > (tonumber(bseq) or 0))
end
local function held_position(line, task, stream, counter, group, istream, icounter)
  -- a line is at most its key's tasks in flight; with no such bound, a poll looks no deeper
  local ahead = redis.call('LPOS', line, task, 'MAXLEN', 1000)
  if not ahead then return -1 end
  local p = lane_depth(stream, counter, group) + ahead + 1
  if istream then p = p + lane_depth(istream, icounter, group) end
  return p
end
local function position(entry, seq, stream, counter, group, istream, icounter)
  local delivered, first = queue_head(stream, counter, group)
  if not entry_after(entry, delivered) then return 0 end
  if first <= 0 or seq == 0 then return -1 end
  local p = math.max(1, seq - first + 1)
  if istream then p = p + lane_depth(istream, icounter, group) end
  return p
end
"""

# KEYS: the lane's stream, its counter, the task, its owner's line[, the interactive stream,
#       its counter: a batch task]
# ARGV: group, entry id ("": in the line), entry number -> position (see LUA)
_POSITION = LUA + """
if ARGV[2] == '' then
  return held_position(KEYS[4], KEYS[3], KEYS[1], KEYS[2], ARGV[1], KEYS[5], KEYS[6])
end
return position(ARGV[2], tonumber(ARGV[3]) or 0, KEYS[1], KEYS[2], ARGV[1], KEYS[5], KEYS[6])
"""

# KEYS: stream, counter, stream, counter, … (each lane), then the backend's lines
# (shares.py) | ARGV: group
# -> {waiting, pending} over them all (the tasks in the lines wait too)
_DEPTH = LUA + """
local waiting, pending = redis.call('LLEN', KEYS[#KEYS]), 0
for i = 1, #KEYS - 1, 2 do
  local w, p = lane_depth(KEYS[i], KEYS[i + 1], ARGV[1])
  waiting, pending = waiting + w, pending + p
end
return {waiting, pending}
"""


def position_keys(task: Task) -> list[str]:
    """The keys `position` reads for `task` (its lane's, and its owner's line; the
    interactive lane's too for a batch task)."""
    found = [keys.queue(task.backend, task.lane), keys.queue_counter(task.backend, task.lane),
             keys.task(task.id), keys.held(task.backend, task.lane, task.owner)]
    if task.lane != keys.INTERACTIVE:
        found += [keys.queue(task.backend, keys.INTERACTIVE),
                  keys.queue_counter(task.backend, keys.INTERACTIVE)]
    return found


class Positions:
    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._position = redis.register_script(_POSITION)
        self._depth = redis.register_script(_DEPTH)

    async def of(self, task: Task) -> int | None:
        """1 for the next entry a worker will read, 2 behind it …; 0 once handed to a worker;
        None when the entry predates per-entry numbers (see LUA). A task in its owner's line
        (no entry yet): at least how many are ahead of it (`held_position`)."""
        found = int(await self._position(keys=position_keys(task),
                                         args=[keys.WORKER_GROUP, task.entry_id,
                                               task.queue_seq]))
        return None if found < 0 else found

    async def in_line(self, task: Task) -> int:
        """How many of `task`'s owner's tasks wait in its line of the task's lane (shares.py):
        ahead of its next one, and in no backlog yet."""
        return int(await self.redis.llen(keys.held(task.backend, task.lane, task.owner)))

    async def depth(self, backend: str) -> tuple[int, int]:
        """(tasks not yet handed to any worker: entries, and tasks in the keys' lines;
        entries handed out and not yet acked) of both lanes together."""
        names = [name for lane in keys.LANES
                 for name in (keys.queue(backend, lane), keys.queue_counter(backend, lane))]
        names.append(keys.lines(backend))
        waiting, pending = await self._depth(keys=names, args=[keys.WORKER_GROUP])
        return int(waiting), int(pending)
