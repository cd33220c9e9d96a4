"""Waiting for tasks without busy polling and without a Redis connection per waiting client.

One `EventHub` per gateway process holds one pub/sub connection. A waiter subscribes its
task's channel through it (SUBSCRIBE when the first waiter of a channel arrives, UNSUBSCRIBE
when the last one leaves) and gets the channel's messages on its own asyncio queue.
Subscribe first, then read the state, so a task finishing in between is never missed. If
the connection drops (a Redis restart), the hub reconnects, subscribes every channel again
and tells each waiter to re-read its task's state, which is what decides; waiters also
re-read it after `POLL_SECONDS` of silence.

A listener that is not a waiter (`watch`: common/store/running_polls.py) hears a channel's
messages the same way without waiting for its subscription; `subscribed` says whether the
subscription holds on the connection the hub has now.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Coroutine
from typing import Any, Protocol

from redis.asyncio.connection import AbstractConnection
from redis.exceptions import RedisError

from common import keys
from common.store.record import Task
from common.store.tasks import TaskStore

log = logging.getLogger("gateway.waiting")

POLL_SECONDS = 5.0  # silence after which a waiter re-reads its task's state anyway
PING_SECONDS = 10.0  # the hub's keep-alive: a connection silent for 3x this is dropped
RECONNECT_SECONDS = 0.5
SUBSCRIBE_WAIT_SECONDS = 2.0  # then the waiter goes on (it still reads the state)
RETRY_AFTER_SECONDS = 2
RESYNC: dict[str, Any] = {"type": "resync"}  # the hub reconnected: re-read the state
TICK: dict[str, Any] = {"type": "tick"}  # to a waiter: look again, a message may be lost
_SUBSCRIBED: dict[str, Any] = {"type": "subscribed"}


class Listener(Protocol):
    """What the hub hands a channel's messages to (an asyncio.Queue is one)."""

    def put_nowait(self, item: dict[str, Any], /) -> None: ...


class Overloaded(Exception):
    """This process already has `max_waiters` waiters: retry after `retry_after` seconds."""

    def __init__(self, retry_after: int) -> None:
        super().__init__(f"too many waiters; retry after {retry_after} s")
        self.retry_after = retry_after


class EventHub:
    def __init__(self, store: TaskStore, max_waiters: int,
                 tick_seconds: float = POLL_SECONDS) -> None:
        # its own connection, outside the store's pool; no health-check PINGs from redis-py,
        # whose replies would arrive among the messages this hub reads
        self.store = store
        pool = store.redis.connection_pool
        self._connection_kwargs = {**pool.connection_kwargs, "health_check_interval": 0,
                                   "socket_timeout": None}
        self._connection_class = pool.connection_class
        self.max_waiters = max_waiters
        #: silence after which a waiter re-reads the state and is told (a `tick`)
        self.tick_seconds = min(tick_seconds, POLL_SECONDS)
        self.waiters = 0
        self._queues: dict[bytes, set[Listener]] = {}
        self._confirmed: dict[bytes, asyncio.Event] = {}
        #: channel -> the connection (its `_epoch`) that confirmed its subscription
        self._confirmed_on: dict[bytes, int] = {}
        self._epoch = 0  # one more at every connect and every drop
        self._connection: AbstractConnection | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: set[asyncio.Task[None]] = set()  # (UN)SUBSCRIBEs on their way

    async def start(self) -> None:
        self._reader = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
        await self._drop()

    # --- the waiter's side -----------------------------------------------------------------

    async def events(self, task_id: str, timeout: float) -> AsyncIterator[dict[str, Any]]:
        """First {"type": "subscribed"}, then segment and chunk events as the worker
        publishes them, each segment id once (a redelivered task publishes its segments again
        from id 0), and a {"type": "tick"} when messages may have been missed (after a
        reconnect) or after `tick_seconds` of silence, then one {"type": "done", "task":
        Task}, or {"type": "timeout"} after `timeout` s. A task already finished when the
        waiter subscribed is `done` at once (an idempotent replay).

        Overloaded (the caller answers 503 with Retry-After) when this process already has
        `max_waiters` waiters. Leaving the loop early (or cancelling it) releases the waiter.
        """
        if self.waiters >= self.max_waiters:
            raise Overloaded(RETRY_AFTER_SECONDS)
        deadline = time.monotonic() + timeout
        channel = keys.events(task_id).encode()
        queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        segments: set[Any] = set()
        self.waiters += 1
        try:
            await self._subscribe(channel, queue)
            yield {"type": "subscribed"}
            event: dict[str, Any] | None = _SUBSCRIBED  # now the state decides
            while True:
                if event is not None and event.get("type") in ("segment", "chunk"):
                    number = event.get("id") if event["type"] == "segment" else None
                    if number is None or number not in segments:
                        segments.add(number)
                        yield event
                else:
                    task = await _state(self.store, task_id)
                    if task is not None and task.state.terminal:
                        yield {"type": "done", "task": task}
                        return
                    if event is None or event is RESYNC:
                        yield TICK
                if (remaining := deadline - time.monotonic()) <= 0:
                    break
                try:
                    async with asyncio.timeout(min(remaining, self.tick_seconds)):
                        event = await queue.get()
                except TimeoutError:
                    event = None
            yield {"type": "timeout"}
        finally:
            self.waiters -= 1
            self._unsubscribe(channel, queue)

    # --- a listener that does not wait (common/store/running_polls.py) ---------------------

    def watch(self, task_id: str, listener: Listener) -> None:
        """`listener` hears the task's channel from when `subscribed(task_id)` is true."""
        channel = keys.events(task_id).encode()
        if self._listen(channel, listener):
            self._background(self._send_subscribe(channel))

    def unwatch(self, task_id: str, listener: Listener) -> None:
        self._unsubscribe(keys.events(task_id).encode(), listener)

    def subscribed(self, task_id: str) -> bool:
        """Whether the task's channel is subscribed on the connection the hub holds now: if
        so, no message published on it from then on is missed without a RESYNC."""
        channel = keys.events(task_id).encode()
        return self._connection is not None and self._confirmed_on.get(channel) == self._epoch

    # --- both -------------------------------------------------------------------------------

    def _listen(self, channel: bytes, listener: Listener) -> bool:
        """Adds a listener; True when it is the channel's first (then it needs a SUBSCRIBE)."""
        listeners = self._queues.setdefault(channel, set())
        listeners.add(listener)
        if len(listeners) > 1:
            return False
        self._confirmed[channel] = asyncio.Event()
        return True

    async def _send_subscribe(self, channel: bytes) -> None:
        if self._connection is not None:  # else the hub subscribes it when it reconnects
            with contextlib.suppress(RedisError, OSError):
                await self._connection.send_command("SUBSCRIBE", channel, check_health=False)

    def _background(self, work: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _subscribe(self, channel: bytes, queue: asyncio.Queue[dict[str, Any]]) -> None:
        if self._listen(channel, queue):
            await self._send_subscribe(channel)
        confirmed = self._confirmed.get(channel)
        if confirmed is None or self._connection is None:
            return  # no connection now: the hub subscribes it when it reconnects
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(SUBSCRIBE_WAIT_SECONDS):
                await confirmed.wait()

    def _unsubscribe(self, channel: bytes, listener: Listener) -> None:
        listeners = self._queues.get(channel)
        if listeners is None:
            return
        listeners.discard(listener)
        if listeners:
            return
        del self._queues[channel]
        self._confirmed.pop(channel, None)
        self._confirmed_on.pop(channel, None)
        if self._connection is not None:
            # not awaited by the waiter: a client that hung up is released at once
            self._background(self._send_unsubscribe(channel))

    async def _send_unsubscribe(self, channel: bytes) -> None:
        connection = self._connection
        if connection is None or channel in self._queues:  # a new waiter took it meanwhile
            return
        with contextlib.suppress(RedisError, OSError):
            await connection.send_command("UNSUBSCRIBE", channel, check_health=False)

    # --- the hub's reader ----------------------------------------------------------------

    async def _run(self) -> None:
        while True:
            try:
                await self._connect()
                await self._read_forever()
            except (RedisError, OSError) as exc:
                if self._connection is not None:
                    log.warning("event subscription lost (%s); reconnecting", type(exc).__name__)
            await self._drop()
            await asyncio.sleep(RECONNECT_SECONDS)

    async def _connect(self) -> None:
        connection = self._connection_class(**self._connection_kwargs)
        await connection.connect()
        self._connection = connection
        self._epoch += 1
        channels = list(self._queues)
        for start in range(0, len(channels), 500):
            await connection.send_command("SUBSCRIBE", *channels[start:start + 500],
                                          check_health=False)
        for listeners in self._queues.values():  # whatever happened meanwhile: look again
            for queue in listeners:
                queue.put_nowait(RESYNC)

    async def _read_forever(self) -> None:
        assert self._connection is not None
        last_ping = time.monotonic()
        while True:
            if time.monotonic() - last_ping >= PING_SECONDS:
                await self._connection.send_command("PING", check_health=False)
                last_ping = time.monotonic()
            # silent for this long despite the PINGs: redis-py's TimeoutError, a reconnect
            self._dispatch(await self._connection.read_response(timeout=3 * PING_SECONDS,
                                                                push_request=True))

    def _dispatch(self, reply: Any) -> None:
        if not isinstance(reply, list) or len(reply) < 2:
            return
        kind = reply[0]
        if kind == b"message" and len(reply) == 3:
            try:
                event = json.loads(reply[2])
            except ValueError:
                return
            if not isinstance(event, dict):
                return
            for queue in self._queues.get(reply[1], ()):
                queue.put_nowait(event)
        elif kind == b"subscribe" and (confirmed := self._confirmed.get(reply[1])):
            self._confirmed_on[reply[1]] = self._epoch
            confirmed.set()

    async def _drop(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            self._epoch += 1
            with contextlib.suppress(RedisError, OSError):
                await connection.disconnect(nowait=True)


async def _state(store: TaskStore, task_id: str) -> Task | None:
    try:
        return await store.get(task_id)
    except RedisError:
        return None

