"""A worker's whole side of Redis, for one backend and one consumer name: its stream (read,
claim, lease, ack, dead-letter), its tasks (start, finish, note, publish, the audio a TTS
task has spoken so far), the breakers of its models, its metrics and its heartbeat.

A worker process holds this one object and nothing else of Redis: it never sees a key or the
client, so the key layout (`common/keys.py`) stays inside this package.
"""

from __future__ import annotations

import json
from typing import Any

from redis.asyncio import Redis

from common import keys
from common.schemas import SpeechChunk, TaskState
from common.settings import Settings
from common.store import admission, metrics, shares
from common.store.breakers import Admission, Breaker, BreakerPolicy, BreakerStore
from common.store.devices import DeviceLedger
from common.store.queue import Delivery, Lease, Queue
from common.store.record import Task
from common.store.segments import SegmentPublisher
from common.store.tasks import TaskStore
from common.store.usage import TopUpRefused, TopUps
from common.store.values import LUA_NOW_MS

# KEYS: heartbeat, live set | ARGV: snapshot, ttl ms, consumer
# The expiry in the live set is on Redis's clock, so hosts with skewed clocks agree.
_HEARTBEAT = LUA_NOW_MS + """
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[3])
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
redis.call('PEXPIRE', KEYS[2], ARGV[2])
return 1
"""


class WorkerStore:
    def __init__(self, redis: Redis, settings: Settings, consumer: str) -> None:
        self.backend = settings.backend
        self.consumer = consumer
        self.breaker_policy = BreakerPolicy.of(settings)
        self.heartbeat_ttl = 3 * settings.heartbeat_seconds
        self._redis = redis
        self._rate = admission.RateRecorder(redis, settings.backend)
        self._beat = redis.register_script(_HEARTBEAT)
        self._tasks = TaskStore.for_settings(redis, settings)
        self._breakers = BreakerStore(redis)
        self._segments = SegmentPublisher(redis)
        self._top_ups = TopUps(redis)
        self._queue = Queue(redis, self.backend, consumer,
                            settings.batch_promotion_seconds, settings.batch_promotion_every)
        self._taken = redis.register_script(shares.TAKEN)

    # --- the stream ---
    #: the backend's priority lanes (one stream each), in reading order
    lanes = keys.LANES

    async def ensure_queue(self) -> None:
        """Create the backend's stream and consumer group unless they exist."""
        await self._tasks.ensure_queue(self.backend)

    async def read(self, *, after: str | None = None, lane: str = keys.BATCH,
                   block_ms: int | None = 1000) -> list[Delivery]:
        """With `after`: our own unacked entries of `lane` past that id. Without: one new
        entry of either lane (an overdue batch entry, else interactive, else batch), waiting
        up to `block_ms` (None: not at all)."""
        return await self._queue.read(after=after, lane=lane, block_ms=block_ms)

    async def sweep(self, count: int, block_ms: int | None = None) -> list[Delivery]:
        """Up to `count` new entries a lane in one round trip, interactive first."""
        return await self._queue.sweep(count, block_ms)

    async def take(self, lane: str, count: int) -> list[Delivery]:
        """Up to `count` new entries of `lane`, not waiting."""
        return await self._queue.take(lane, count)

    async def claim_abandoned(self, min_idle_seconds: float) -> list[Delivery]:
        return await self._queue.claim_abandoned(min_idle_seconds)

    async def taken(self, deliveries: list[Delivery]) -> None:
        """New entries this worker read wait in the lane no more: their owners' next tasks in
        line come in (common/store/shares.py; their starts would, later)."""
        tasks = [keys.task(d.task_id) for d in deliveries
                 if d.task_id is not None and d.counted]
        if tasks:
            await self._taken(keys=[keys.backlog(self.backend), *tasks])

    async def release(self, deliveries: list[Delivery], idle_seconds: float,
                      ) -> list[Delivery]:
        """Entries taken but not to be run here, back to the other workers (Queue.release):
        those released."""
        return await self._queue.release(deliveries, idle_seconds)

    async def deliveries(self, delivery: Delivery) -> tuple[int, bool]:
        return await self._queue.deliveries(delivery)

    async def extend_lease(self, delivery: Delivery) -> Lease:
        return await self._queue.extend_lease(delivery)

    async def ack(self, delivery: Delivery) -> None:
        await self._queue.ack(delivery)

    async def dead_letter(self, task_id: str, reason: str, deliveries: int) -> None:
        await self._queue.dead_letter(task_id, reason, deliveries)

    # --- tasks ---
    async def get(self, task_id: str) -> Task | None:
        return await self._tasks.get(task_id)

    async def input_blob(self, task_id: str) -> bytes | None:
        return await self._tasks.blobs.input(task_id)

    async def voice_stands(self, owner: str, voice_id: str, consent_id: str) -> bool:
        """The owner's custom voice and its consent both still exist (neither deleted)."""
        found = await self._redis.exists(keys.custom_voice(owner, voice_id),
                                         keys.voice_consent(owner, consent_id))
        return int(found) == 2

    async def start(self, task_id: str, deliveries: int, unconfirmed_too: bool = False) -> int:
        """Mark RUNNING by this consumer and open a new attempt: its number, 0 if the task is
        already terminal, -1 if it is gone, -2 if its deadline passed, -3 if its submit is
        not confirmed yet (unless `unconfirmed_too`)."""
        return await self._tasks.start(task_id, self.consumer, deliveries, self.backend,
                                       unconfirmed_too)

    async def finish(self, task: Task, state: TaskState, *, attempt: int | None, entry_id: str,
                     result: dict[str, Any] | None = None, error: str = "", error_code: str = "",
                     output: bytes | None = None, again: bool = False) -> bool:
        """The terminal state, fenced by `attempt` (None: unfenced) and this consumer, then
        the ack; False when this write lost (`again`: TaskStore.finish)."""
        return await self._tasks.finish(task, state, attempt=attempt, entry_id=entry_id,
                                        result=result, error=error, error_code=error_code,
                                        output=output, worker=self.consumer, again=again)

    async def top_up(self, task_id: str, attempt: int, audio_seconds: float,
                     ) -> TopUpRefused | None:
        """Charge a running attempt's task up to the audio it decoded (common/store/usage.py,
        TOP_UP); the quota it would pass, if any (nothing charged then)."""
        return await self._top_ups.top_up(task_id, attempt, audio_seconds, self.consumer)

    # --- a TTS task's audio as it is spoken (common/store/chunks.py) ---
    async def speech_chunks(self, task_id: str) -> list[SpeechChunk]:
        """Every piece stored so far, in order (what a new attempt resumes after)."""
        return await self._tasks.speech.read(task_id, count=None)

    async def append_chunk(self, task_id: str, attempt: int, chunk: SpeechChunk) -> None:
        """StaleAttempt when `attempt` (by this consumer) is no longer the task's running
        attempt."""
        await self._tasks.speech.append(task_id, attempt, chunk, self.consumer)

    async def spare_deliveries(self, task_ids: list[str]) -> None:
        await self._tasks.spare_deliveries(task_ids)

    async def publish(self, task_id: str, event: dict[str, Any]) -> None:
        await self._tasks.publish(task_id, event)

    async def publish_segment(self, task_id: str, attempt: int, end: float,
                              event: dict[str, Any]) -> None:
        """Publish a segment of `attempt` and count it delivered up to `end` seconds."""
        await self._segments.publish(task_id, attempt, end, event, self.consumer)

    # --- breakers ---
    async def admit(self, model: str, source: str) -> Admission:
        return await self._breakers.admit(self.backend, model, source, self.consumer,
                                          self.breaker_policy)

    async def record_load_failure(self, model: str, source: str, error: str) -> bool:
        """Count a load failure; True when the model's breaker is open after it."""
        return await self._breakers.record_load_failure(self.backend, model, source, error,
                                                        self.breaker_policy)

    async def clear_breaker(self, model: str) -> bool:
        return await self._breakers.clear(self.backend, model)

    async def breakers(self, sources: dict[str, str]) -> dict[str, Breaker]:
        return await self._breakers.read(self.backend, sources, self.breaker_policy)

    # --- the device memory broker ---
    def device_ledger(self, device_id: str) -> DeviceLedger:
        """This worker's reservations on device `device_id` (common/store/devices.py)."""
        return DeviceLedger(self._redis, device_id, self.consumer)

    # --- metrics and heartbeat ---
    async def record(self, counters: tuple[str, ...] = (),
                     observations: dict[str, float] | None = None) -> None:
        await metrics.record(self._redis, self.backend, counters, observations)

    async def record_rate(self, model: str, audio_seconds: float, wall_seconds: float) -> None:
        """One finished task's model, audio-seconds and wall time, for predicted waits."""
        await self._rate.record(model, audio_seconds, wall_seconds)

    async def beat(self, snapshot: dict[str, Any], ttl_seconds: float | None = None) -> None:
        """Publish this worker's health snapshot; it expires unless renewed (after the
        heartbeat TTL, or `ttl_seconds`)."""
        ttl = self.heartbeat_ttl if ttl_seconds is None else ttl_seconds
        await self._beat(keys=[keys.heartbeat(self.backend, self.consumer),
                               keys.live(self.backend)],
                         args=[json.dumps(snapshot), int(ttl * 1000), self.consumer])

    async def forget_heartbeat(self) -> None:
        """This worker is leaving: stop counting it as live at once, not at the TTL, and its
        consumer leaves the group unless entries are pending to it."""
        await self._redis.delete(keys.heartbeat(self.backend, self.consumer))
        await self._redis.zrem(keys.live(self.backend), self.consumer)
        await self._queue.forget_me()
