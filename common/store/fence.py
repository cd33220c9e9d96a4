"""The fence every write of a running attempt passes (Lua, for the scripts that use it).

A worker's writes for a task (its terminal write, a spoken piece, a segment's delivered mark,
a charge's top-up) count only while the task record still names that attempt and the worker
that opened it: the sweeper may have redelivered the task (a newer attempt), and a failover
that lost a start can hand one attempt number to two workers, whom only the worker field
tells apart.
"""

# `holds(task, attempt, worker)`: the record names `attempt` and, unless `worker` is nil or
# "" (a caller that does not say), `worker`. `runs(...)`: that, and the task is RUNNING.
LUA = """
local function holds(task, attempt, worker)
  local f = redis.call('HMGET', task, 'attempt', 'worker')
  return f[1] == attempt and (not worker or worker == '' or f[2] == worker)
end
local function runs(task, attempt, worker)
  return redis.call('HGET', task, 'state') == 'RUNNING' and holds(task, attempt, worker)
end
"""
