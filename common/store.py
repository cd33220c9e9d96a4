"""The Redis task store: task records, their queue entries and blobs, written atomically.

Every state change that must be atomic with another write (submit + enqueue, terminal
state + ack, cancel + dequeue) is one Lua call, so no crash can leave half of it.
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError

from common import keys
from common.schemas import TERMINAL_STATES, TaskState

# KEYS: task, queue, input blob | ARGV: task_id, blob_ttl, blob ("" = none), field, value, ...
# The entry's place in the stream's add order ("entries-added" right after XADD) makes the
# queue position one subtraction from the group's "entries-read" (see queue_position).
_SUBMIT = """
local entry = redis.call('XADD', KEYS[2], '*', 'task_id', ARGV[1])
local info = redis.call('XINFO', 'STREAM', KEYS[2])
local seq = 0
for i = 1, #info, 2 do
  if info[i] == 'entries-added' then seq = info[i + 1] end
end
redis.call('HSET', KEYS[1], 'entry_id', entry, 'queue_seq', seq, unpack(ARGV, 4))
if ARGV[3] ~= '' then
  redis.call('SET', KEYS[3], ARGV[3], 'EX', ARGV[2])
end
return entry
"""

# KEYS: task, events | ARGV: worker, now, deliveries -> new attempt, 0 if terminal, -1 if missing
_START = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return -1 end
if state ~= 'PENDING' and state ~= 'RUNNING' then return 0 end
local attempt = redis.call('HINCRBY', KEYS[1], 'attempt', 1)
redis.call('HSET', KEYS[1], 'state', 'RUNNING', 'worker', ARGV[1], 'started_at', ARGV[2],
           'deliveries', ARGV[3])
redis.call('PUBLISH', KEYS[2], '{"type":"state","status":"RUNNING"}')
return attempt
"""

# KEYS: task, queue, events, input blob, output blob
# ARGV: attempt (or "" = unfenced), entry, group, state, now, retention, result, error, code
# -> 1 stored, 0 stale attempt or already terminal. Acks only after the state is stored.
_FINISH = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return 0 end
if ARGV[1] ~= '' and redis.call('HGET', KEYS[1], 'attempt') ~= ARGV[1] then return 0 end
if state ~= 'PENDING' and state ~= 'RUNNING' then
  if ARGV[2] ~= '' then redis.call('XACK', KEYS[2], ARGV[3], ARGV[2]) end
  return 0
end
redis.call('HSET', KEYS[1], 'state', ARGV[4], 'finished_at', ARGV[5])
if ARGV[7] ~= '' then redis.call('HSET', KEYS[1], 'result', ARGV[7]) end
if ARGV[8] ~= '' then redis.call('HSET', KEYS[1], 'error', ARGV[8], 'error_code', ARGV[9]) end
redis.call('EXPIRE', KEYS[1], ARGV[6])
redis.call('EXPIRE', KEYS[4], ARGV[6])
redis.call('EXPIRE', KEYS[5], ARGV[6])
if ARGV[2] ~= '' then redis.call('XACK', KEYS[2], ARGV[3], ARGV[2]) end
redis.call('PUBLISH', KEYS[3], cjson.encode({type='state', status=ARGV[4]}))
return 1
"""

# KEYS: task, queue, events, input blob | ARGV: now, retention -> the state after the call
# The stream entry stays: a worker that reads it finds the task terminal and acks it. (An
# XDEL would leave a tombstone that breaks the group's entries-read count, see queue_position.)
_CANCEL = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return '' end
if state ~= 'PENDING' then return state end
redis.call('HSET', KEYS[1], 'state', 'CANCELLED', 'finished_at', ARGV[1],
           'error', 'task was cancelled before it started')
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('DEL', KEYS[4])
redis.call('PUBLISH', KEYS[3], '{"type":"state","status":"CANCELLED"}')
return 'CANCELLED'
"""

# KEYS: breaker | ARGV: now, window, threshold, error -> 1 if the breaker is (now) open
_LOAD_FAILED = """
local first = tonumber(redis.call('HGET', KEYS[1], 'first_failure') or '0')
if first == 0 or tonumber(ARGV[1]) - first > tonumber(ARGV[2]) then
  redis.call('HSET', KEYS[1], 'first_failure', ARGV[1], 'failures', 0, 'open', 0)
end
local failures = redis.call('HINCRBY', KEYS[1], 'failures', 1)
redis.call('HSET', KEYS[1], 'error', ARGV[4], 'last_failure', ARGV[1])
if failures >= tonumber(ARGV[3]) then redis.call('HSET', KEYS[1], 'open', 1) end
return tonumber(redis.call('HGET', KEYS[1], 'open'))
"""


def new_task_id() -> str:
    """Unguessable, URL-safe, fleet-unique (144 random bits), 24 characters."""
    return secrets.token_urlsafe(18)


@dataclass(slots=True)
class Task:
    id: str
    backend: str
    model: str
    state: TaskState
    params: dict[str, Any] = field(default_factory=dict)
    input_path: str = ""  # a file under an allowed root; empty when the input is a blob
    owner: str = ""
    created_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    attempt: int = 0
    deliveries: int = 0
    entry_id: str = ""
    queue_seq: int = 0  # this entry's number in its stream's add order
    worker: str = ""
    result: dict[str, Any] | None = None
    error: str = ""
    error_code: str = ""
    last_error: str = ""
    audio_seconds: float | None = None

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes]) -> Task:
        data = {k.decode(): v.decode() for k, v in raw.items()}

        def number(name: str) -> float | None:
            return float(data[name]) if data.get(name) else None

        return cls(
            id=data["id"],
            backend=data["backend"],
            model=data.get("model", ""),
            state=TaskState(data["state"]),
            params=json.loads(data.get("params") or "{}"),
            input_path=data.get("input_path", ""),
            owner=data.get("owner", ""),
            created_at=float(data.get("created_at", 0)),
            started_at=number("started_at"),
            finished_at=number("finished_at"),
            attempt=int(data.get("attempt", 0)),
            deliveries=int(data.get("deliveries", 0)),
            entry_id=data.get("entry_id", ""),
            queue_seq=int(data.get("queue_seq") or 0),
            worker=data.get("worker", ""),
            result=json.loads(data["result"]) if data.get("result") else None,
            error=data.get("error", ""),
            error_code=data.get("error_code", ""),
            last_error=data.get("last_error", ""),
            audio_seconds=number("audio_seconds"),
        )

    def public_view(self) -> dict[str, Any]:
        """The REST view of `/v1/tasks/{id}`."""
        view: dict[str, Any] = {
            "id": self.id,
            "status": self.state.value,
            "backend": self.backend,
            "model": self.model,
            "created_at": self.created_at,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "attempts": self.attempt,
            "deliveries": self.deliveries,
            "worker": self.worker,
        }
        if self.state == TaskState.SUCCEEDED:
            view["result"] = self.result
        if self.error:
            view["error"] = self.error
            view["error_code"] = self.error_code or None
        return view


class TaskStore:
    def __init__(self, redis: Redis, retention_seconds: int) -> None:
        self.redis = redis
        self.retention = retention_seconds
        self._submit = redis.register_script(_SUBMIT)
        self._start = redis.register_script(_START)
        self._finish = redis.register_script(_FINISH)
        self._cancel = redis.register_script(_CANCEL)
        self._load_failed = redis.register_script(_LOAD_FAILED)

    async def ensure_queue(self, backend: str) -> None:
        try:
            await self.redis.xgroup_create(keys.queue(backend), keys.WORKER_GROUP, id="0",
                                           mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def submit(self, task: Task, blob: bytes | None) -> None:
        """Write the task record, its queue entry and its input blob in one atomic step."""
        record = {
            "id": task.id,
            "backend": task.backend,
            "model": task.model,
            "state": TaskState.PENDING.value,
            "params": json.dumps(task.params),
            "input_path": task.input_path,
            "owner": task.owner,
            "created_at": repr(time.time()),
            "attempt": 0,
            "audio_seconds": "" if task.audio_seconds is None else repr(task.audio_seconds),
        }
        flat = [str(item) for pair in record.items() for item in pair]
        await self._submit(
            keys=[keys.task(task.id), keys.queue(task.backend), keys.input_blob(task.id)],
            args=[task.id, self.retention, blob or b"", *flat],
        )

    async def get(self, task_id: str) -> Task | None:
        raw = await self.redis.hgetall(keys.task(task_id))
        return Task.from_hash(raw) if raw else None

    async def input_blob(self, task_id: str) -> bytes | None:
        return await self.redis.get(keys.input_blob(task_id))

    async def start(self, task_id: str, worker: str, deliveries: int) -> int:
        """Mark RUNNING and open a new attempt: its number, 0 if already terminal, -1 if gone."""
        return int(await self._start(keys=[keys.task(task_id), keys.events(task_id)],
                                     args=[worker, repr(time.time()), deliveries]))

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
    ) -> bool:
        """Store the terminal state (fenced by attempt), then ack; False if this write lost."""
        assert state in TERMINAL_STATES
        if output is not None:
            await self.redis.set(keys.output_blob(task.id), output, ex=self.retention)
        stored = await self._finish(
            keys=[keys.task(task.id), keys.queue(task.backend), keys.events(task.id),
                  keys.input_blob(task.id), keys.output_blob(task.id)],
            args=["" if attempt is None else attempt, entry_id, keys.WORKER_GROUP, state.value,
                  repr(time.time()), self.retention,
                  json.dumps(result) if result is not None else "", _one_line(error),
                  error_code],
        )
        return bool(stored)

    async def cancel(self, task_id: str, backend: str) -> str:
        """Cancel a PENDING task; returns the task's state afterwards ("" if unknown)."""
        state = await self._cancel(
            keys=[keys.task(task_id), keys.queue(backend), keys.events(task_id),
                  keys.input_blob(task_id)],
            args=[repr(time.time()), self.retention],
        )
        return state.decode() if isinstance(state, bytes) else str(state)

    async def note_error(self, task_id: str, error: str) -> None:
        """Remember why an attempt died, for the FAILED reason if the task runs out of tries."""
        await self.redis.hset(keys.task(task_id), "last_error", _one_line(error))

    async def publish(self, task_id: str, event: dict[str, Any]) -> None:
        await self.redis.publish(keys.events(task_id), json.dumps(event))

    async def output_blob(self, task_id: str) -> bytes | None:
        return await self.redis.get(keys.output_blob(task_id))

    async def queue_position(self, task: Task) -> int | None:
        """Entries ahead of this one not yet handed to a worker (0 = next), in O(1)."""
        if not task.entry_id:
            return None
        groups = await self.redis.xinfo_groups(keys.queue(task.backend))
        group = next((g for g in groups if g["name"] == keys.WORKER_GROUP.encode()), None)
        if group is None:
            return None
        if _stream_id(task.entry_id) <= _stream_id(group["last-delivered-id"].decode()):
            return 0  # delivered; waiting for its worker to pick it up
        read = group.get("entries-read")
        if read is None or not task.queue_seq:
            return None  # Redis cannot tell (see XINFO GROUPS): better none than a guess
        return max(0, task.queue_seq - int(read) - 1)

    # --- breaker ---
    async def record_load_failure(self, backend: str, model: str, error: str, *,
                                  threshold: int, window: float) -> bool:
        opened = await self._load_failed(keys=[keys.breaker(backend, model)],
                                         args=[repr(time.time()), window, threshold,
                                               _one_line(error)])
        return bool(opened)

    async def breaker_error(self, backend: str, model: str) -> str | None:
        """The load error if this model's breaker is open, else None."""
        raw = await self.redis.hmget(keys.breaker(backend, model), "open", "error")
        if raw[0] == b"1":
            return (raw[1] or b"model failed to load").decode()
        return None

    async def clear_breaker(self, backend: str, model: str) -> None:
        await self.redis.delete(keys.breaker(backend, model))


def _stream_id(entry: str) -> tuple[int, int]:
    millis, _, seq = entry.partition("-")
    return int(millis), int(seq or 0)


def _one_line(text: str) -> str:
    return " ".join(text.split())[:1000]


async def live_workers(redis: Redis) -> list[dict[str, Any]]:
    """Health snapshots of every worker whose heartbeat has not expired."""
    names = [name async for name in redis.scan_iter(match=keys.heartbeat_pattern(), count=200)]
    if not names:
        return []
    return [json.loads(raw) for raw in await redis.mget(names) if raw]


async def write_heartbeat(redis: Redis, backend: str, consumer: str, snapshot: dict[str, Any],
                          ttl_seconds: float) -> None:
    await redis.set(keys.heartbeat(backend, consumer), json.dumps(snapshot),
                    px=int(ttl_seconds * 1000))
