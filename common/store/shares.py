"""Each key's share of a lane: at most SPEECH_QUEUED_PER_KEY of one key's entries wait in a
lane's stream at once (not yet read by a worker), and at most SPEECH_QUEUED_SECONDS_PER_KEY
of work (audio-seconds; characters at 15 a second; one task alone always may, whatever its
size), so another key's task is queued behind at most that many of its own, and that much
of its work, however many it sent and however long. The key's further tasks wait in its own line
(keys.held; every key's of a backend also in keys.lines, which an autoscaler counts beside
the streams' lag), oldest first, and enter the stream one at a time, each as one of the
key's entries there is read or ends: a key alone keeps the workers busy (its entries come in
as fast as they are taken) and fills a batch call, but a second key's work lands behind a
few of the first key's entries, not behind its whole backlog.

A task in a line is not in the backend's backlog (admission.BACKLOG_LUA) until it comes in:
the backlog is the work ahead of a new task of another key, which goes before the lines (the
submit's queued-task limit counts the lines as well; metrics and autoscaling count them).

The submit script puts a task in the stream or in the line (tasks._SUBMIT); these functions,
called by every script that moves a task out of waiting (a worker's read of its entry, its
start, any terminal write), take it out of the count or the line and let the next one in. A
task's fields say where it is counted, so nothing is counted twice: `share` (the owner's
keys.lane_share) and `line` (its keys.held) while it waits in the stream; `held` (the line),
`held_all` (keys.lines) and `held_queue`, `held_counter` (where it goes in) while it waits
in the line. A counted task's stream entry says so (`counted`), so a worker's read calls
TAKEN only for entries that hold a share (none at all with keys off); one that came in from
a line also carries its submit time (`queued_ms`), its age for the batch lane's promotion
(its entry's id is when it came in).
"""
from __future__ import annotations

from common.store import admission

# Lua functions, for tasks._CLOSE and tasks._SUBMIT (after admission.BACKLOG_LUA):
# fits(share, most, most_work, work) -> whether one more entry of `work` may wait in the
#   stream: fewer than `most` wait, and their work (keys.lane_share + ":work") and this one's
#   stay within `most_work` (0: no bound), or none of theirs waits (a task alone always may)
# admit(line, share, backlog, most, most_work) -> the owner's next tasks in line into the
#   stream (and the backlog), while they fit
# unshare(task, backlog) -> the task waits no more: out of its owner's count and work (and the
#   owner's next tasks in line in, by the limits the task was counted under), or out of the
#   line.
LUA = """
local function fits(share, most, most_work, work)
  local count = tonumber(redis.call('GET', share) or '0') or 0
  if count >= most then return false end
  if most_work <= 0 or count <= 0 then return true end  -- alone: whatever its work
  local sum = tonumber(redis.call('GET', share .. ':work') or '0') or 0
  return sum + work <= most_work
end
-- one more entry of `work` counted; the first restarts the sum (an older version's scripts
-- uncount entries but not their work: what they left behind goes with the count)
local function count_in(share, work)
  if redis.call('INCR', share) == 1 then
    redis.call('SET', share .. ':work', work)
  else
    redis.call('INCRBYFLOAT', share .. ':work', work)
  end
end
local function admit(line, share, backlog, most, most_work)
  while true do
    local task = redis.call('LINDEX', line, 0)
    if not task then return end
    local f = redis.call('HMGET', task, 'held_queue', 'held_counter', 'id', 'state', 'held_all',
                         'lane', 'work', 'audio_seconds', 'created_at')
    local work = tonumber(f[7] or f[8] or '') or 0
    local pending = f[1] and f[2] and f[3] and f[4] == 'PENDING'
    if pending and not fits(share, most, most_work, work) then return end
    redis.call('LPOP', line)
    if f[5] then redis.call('LREM', f[5], 1, task) end
    if pending then
      local seq = redis.call('INCR', f[2])
      local entry
      if tonumber(f[9]) then
        entry = redis.call('XADD', f[1], '*', 'task_id', f[3], 'seq', seq, 'counted', 1,
                           'queued_ms', string.format('%d', tonumber(f[9]) * 1000))
      else  -- (its age is then its entry's)
        entry = redis.call('XADD', f[1], '*', 'task_id', f[3], 'seq', seq, 'counted', 1)
      end
      redis.call('HDEL', task, 'held', 'held_queue', 'held_counter', 'held_all')
      redis.call('HSET', task, 'entry_id', entry, 'queue_seq', seq, 'share', share,
                 'line', line, 'share_most', most, 'share_work', work,
                 'share_work_most', most_work)
      count_in(share, work)
      enqueue(task, backlog, f[6] or 'batch', work)
    end
  end
end
local function unshare(task, backlog)
  local f = redis.call('HMGET', task, 'share', 'line', 'held', 'held_all', 'share_most',
                       'share_work', 'share_work_most')
  if f[1] and redis.call('HDEL', task, 'share', 'line', 'share_most', 'share_work',
                         'share_work_most') > 0 then
    if redis.call('DECR', f[1]) <= 0 then
      redis.call('DEL', f[1], f[1] .. ':work')
    elseif tonumber(f[6] or '') and tonumber(redis.call(
        'INCRBYFLOAT', f[1] .. ':work', -tonumber(f[6]))) <= 1e-6 then
      redis.call('DEL', f[1] .. ':work')
    end
    if f[2] then
      admit(f[2], f[1], backlog, tonumber(f[5] or '') or 1, tonumber(f[7] or '') or 0)
    end
  end
  if f[3] and redis.call('HDEL', task, 'held', 'held_queue', 'held_counter', 'held_all') > 0 then
    redis.call('LREM', f[3], 1, task)
    if f[4] then redis.call('LREM', f[4], 1, task) end
  end
end
"""

# The submit's side (tasks._SUBMIT, after LUA), a function of its KEYS and ARGV:
# share_or_hold(task, stream, counter, share, line, all lines, backlog, lane, work, most,
#   most work, task id, fields...) -> the task in the stream (and the backlog): its entry id
#   and number; or in its owner's line: '' and 0. It waits in line while the line has tasks
#   (a key's own come in in order; `most` 0 or raised since included: a raised limit lets the
#   line in now).
SUBMIT_LUA = """
local function share_or_hold(task, stream, counter, share, line, lines, backlog, lane, work,
                             most, most_work, task_id, ...)
  if redis.call('LLEN', line) == 0
      and (most == 0 or fits(share, most, most_work, tonumber(work) or 0)) then
    local seq = redis.call('INCR', counter)
    local entry
    if most > 0 then
      entry = redis.call('XADD', stream, '*', 'task_id', task_id, 'seq', seq, 'counted', 1)
    else
      entry = redis.call('XADD', stream, '*', 'task_id', task_id, 'seq', seq)
    end
    redis.call('HSET', task, 'entry_id', entry, 'queue_seq', seq, ...)
    if most > 0 then
      count_in(share, tonumber(work) or 0)
      redis.call('HSET', task, 'share', share, 'line', line, 'share_most', most,
                 'share_work', tonumber(work) or 0, 'share_work_most', most_work)
    end
    enqueue(task, backlog, lane, work)
    return entry, seq
  end
  redis.call('RPUSH', line, task)
  redis.call('RPUSH', lines, task)
  redis.call('HSET', task, 'held', line, 'held_queue', stream, 'held_counter', counter,
             'held_all', lines, ...)
  if most > 0 then admit(line, share, backlog, most, most_work) end
  local came = redis.call('HMGET', task, 'entry_id', 'queue_seq')
  if came[1] then return came[1], tonumber(came[2]) end
  return '', 0
end
"""

# KEYS: the backend's backlog, then tasks a worker has just read from the stream (those whose
# entries are `counted`)
# A task read is taken: it waits in the lane no more, so its owner's next one comes in now,
# not when it starts (a worker gathering a batch starts its calls one after another, and a
# share held by entries one worker gathered would starve the others and the batch's size).
# What the worker's start would do anyway, done earlier (and then not again).
TAKEN = admission.BACKLOG_LUA + LUA + """
for i = 2, #KEYS do unshare(KEYS[i], KEYS[1]) end
return 1
"""
