"""A TTS task's audio as it is spoken: one stream entry per piece (a sentence), in order,
with the entry id `0-N` for the N-th piece (from 1), so a reader asks for "piece i on" and
never gets one twice.

Only the task's current attempt may append (fenced like the terminal write), and only the
next piece: an append repeated after a lost reply is a no-op, and an attempt the janitor
has redelivered (a worker that froze and woke up) is refused. A new attempt reads what is
stored and resumes after it, so every piece is spoken once and the final WAV is exactly the
stored pieces joined. The pieces expire with the task's retention, and go with its terminal write
(`close()` in tasks.py: the WAV holds the same samples from then on).
"""

from __future__ import annotations

from redis.asyncio import Redis

from common import keys
from common.schemas import SpeechChunk
from common.store import fence

#: pieces one read returns at most (a reader asks again for the rest)
READ_COUNT = 16

# KEYS: task, chunks, events | ARGV: attempt, index (from 0), pcm, sample rate, retention,
#       the piece's characters (added to the task's `delivered`: what it is charged for if
#       it fails later), the worker that started the attempt ("" = any)
# -> pieces stored after the call (index + 1 when this one is stored, also when this attempt
#    already had stored it: a retry after a lost reply), -1 when the attempt is stale or the
#    task is not RUNNING, -2 when another attempt stored that piece.
_APPEND = fence.LUA + """
if not runs(KEYS[1], ARGV[1], ARGV[7]) then return -1 end
local stored = redis.call('XLEN', KEYS[2])
local index = tonumber(ARGV[2])
if stored == index + 1 then
  local last = redis.call('XREVRANGE', KEYS[2], '+', '-', 'COUNT', 1)[1][2]
  for i = 1, #last, 2 do
    if last[i] == 'attempt' and last[i + 1] ~= ARGV[1] then return -2 end
  end
end
if stored ~= index then return stored end
redis.call('XADD', KEYS[2], '0-' .. (stored + 1), 'pcm', ARGV[3], 'rate', ARGV[4],
           'attempt', ARGV[1])
redis.call('EXPIRE', KEYS[2], ARGV[5])
redis.call('HINCRBYFLOAT', KEYS[1], 'delivered', tonumber(ARGV[6]) or 0)
redis.call('PUBLISH', KEYS[3], cjson.encode({type='chunk', index=stored}))
return stored + 1
"""


class StaleAttempt(Exception):
    """The task has a newer attempt, or is no longer RUNNING: this one must stop."""


class PiecesLost(RuntimeError):
    """Fewer pieces are stored than the attempt appended before this one: a failover's new
    primary lacks the last appends the old one acknowledged. The attempt stores them again
    from `stored` on (it holds them) before this one."""

    def __init__(self, task_id: str, index: int, stored: int) -> None:
        super().__init__(f"speech piece {index} of {task_id} is out of order ({stored} "
                         "stored)")
        self.stored = stored


class SpeechChunks:
    def __init__(self, redis: Redis, retention_seconds: int) -> None:
        self.redis = redis
        self.retention = retention_seconds
        self._append = redis.register_script(_APPEND)

    async def append(self, task_id: str, attempt: int, chunk: SpeechChunk,
                     worker: str = "") -> None:
        """Store piece `chunk.index` for `attempt` (started by `worker`; "" = any);
        StaleAttempt when the attempt lost."""
        stored = int(await self._append(
            keys=[keys.task(task_id), keys.speech_chunks(task_id), keys.events(task_id)],
            args=[attempt, chunk.index, chunk.pcm, chunk.sample_rate, self.retention,
                  chunk.characters, worker]))
        if stored == -1:
            raise StaleAttempt(task_id)
        if stored == -2:
            raise RuntimeError(f"speech piece {chunk.index} of {task_id} was stored by "
                               "another attempt")
        if stored < chunk.index:
            raise PiecesLost(task_id, chunk.index, stored)
        if stored != chunk.index + 1:  # an attempt appends after what is stored, in order
            raise RuntimeError(f"speech piece {chunk.index} of {task_id} is out of order "
                               f"({stored} stored)")

    async def read(self, task_id: str, start: int = 0,
                   count: int | None = READ_COUNT) -> list[SpeechChunk]:
        """Pieces `start`, `start + 1` … stored so far (at most `count`; None: all)."""
        entries = await self.redis.xrange(keys.speech_chunks(task_id), f"0-{start + 1}", "+",
                                          count=count)
        return [SpeechChunk(int(entry_id.split(b"-")[1]) - 1, fields[b"pcm"],
                            int(fields[b"rate"]))
                for entry_id, fields in entries]
