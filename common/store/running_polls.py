"""A RUNNING task's status poll answered without Redis while its state cannot have changed.

The poll is the Sage contract's most frequent request, and a RUNNING task's reply carries
nothing but its state. A task polled again within `max_age` of its last read gets this
process's subscription to its event channel (through the EventHub's one connection). Every
state change publishes there (TaskStore's start and every terminal write), so a reply read
after the subscription held stays true until a state message arrives, and later polls are
answered from it. On a machine whose cores the engines use, that halves what a poll costs:
the gateway wakes once instead of twice, and Redis not at all.

A kept reply is served for at most `max_age` seconds all the same (a change no message
tells of, a connection that dies without a word), never while the hub is reconnecting, and
dropped by any state message, a RESYNC, or a poll that reads another state.

With a `pace`, a kept task's poll that comes sooner than `pace` after its last reply waits
out the rest of it, or until a state message arrives, whichever is first. While the reply is
kept nothing in it can change before such a message, so the wait hides nothing from the
client, and the message ends it at once: a finished task is seen sooner than by the next
poll. What it saves is the poll after it: a client polling in a loop (Sage at a 10 ms
`query_period`) costs the gateway a wake-up every `pace` instead of every few milliseconds,
CPU the engines share on a GPU box (bench/README.md, issue 24).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from typing import Any

from common.schemas import TaskState
from common.store.events import EventHub
from common.store.poll import Poll, PollReader

#: the longest a kept reply is served without a read, and the gap between two polls of a
#: task that earns it a subscription
MAX_AGE_SECONDS = 1.0
#: tasks one process keeps at most (a subscription each); beyond, polls read Redis
MOST_KEPT = 1000
#: a task not polled for this long is forgotten (its subscription dropped) at the next poll
#: of any task
IDLE_SECONDS = 5.0


@dataclass(eq=False, slots=True)
class _Kept:
    """A task's last RUNNING read; a listener of the hub (`put_nowait`)."""

    read_at: float  # when the last read that found it RUNNING began (monotonic)
    polled_at: float
    answered_at: float
    reply: Poll | None = None  # served while valid
    generation: int = 0  # one more at every message that may change the state
    watched: bool = False
    changed: asyncio.Event | None = None  # set by the next state message (polls waiting)

    def put_nowait(self, event: dict[str, Any], /) -> None:
        if event.get("type") in ("segment", "chunk"):  # output so far: not in a poll's reply
            return
        self.generation += 1
        self.drop()

    def drop(self) -> None:
        self.reply = None
        if self.changed is not None:
            self.changed.set()
            self.changed = None

    async def change(self, seconds: float) -> None:
        """Returns after `seconds`, or sooner at a state message."""
        if self.changed is None:
            self.changed = asyncio.Event()
        changed = self.changed
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(seconds):
                await changed.wait()


class RunningPolls:
    def __init__(self, reader: PollReader, hub: EventHub, max_age: float = MAX_AGE_SECONDS,
                 most: int = MOST_KEPT, pace: float = 0.0) -> None:
        self._reader = reader
        self._hub = hub
        self.max_age = max_age
        self.most = most
        self.pace = pace
        self._kept: dict[str, _Kept] = {}
        self._swept_at = time.monotonic()

    async def read(self, task_id: str) -> Poll | None:
        """What `PollReader.read` would read now; with a pace, perhaps a moment later."""
        now = time.monotonic()
        self._sweep(now)
        kept = self._kept.get(task_id)
        if kept is not None:
            kept.polled_at = now
            if self._serves(kept, task_id, now):
                if (wait := kept.answered_at + self.pace - now) > 0:
                    await kept.change(wait)
                    now = time.monotonic()
                if self._serves(kept, task_id, now):
                    kept.answered_at = now
                    return kept.reply
        # a reply may be kept only if the subscription held before the read was sent
        before = kept if kept is not None and self._hub.subscribed(task_id) else None
        generation = kept.generation if kept is not None else 0
        poll = await self._reader.read(task_id)
        if poll is None or poll.task.state != TaskState.RUNNING:
            self._forget(task_id)
            return poll
        kept = self._kept.get(task_id)
        if kept is None:
            if len(self._kept) < self.most:
                self._kept[task_id] = _Kept(read_at=now, polled_at=now, answered_at=now)
            return poll
        if (kept is before and kept.generation == generation
                and self._hub.subscribed(task_id)):
            kept.reply = poll
        elif not kept.watched and now - kept.read_at <= self.max_age:
            kept.watched = True  # polled again soon: worth a subscription
            self._hub.watch(task_id, kept)
        kept.read_at = kept.answered_at = now
        return poll

    def _serves(self, kept: _Kept, task_id: str, now: float) -> bool:
        return (kept.reply is not None and now - kept.read_at <= self.max_age
                and self._hub.subscribed(task_id))

    def _forget(self, task_id: str) -> None:
        kept = self._kept.pop(task_id, None)
        if kept is None:
            return
        kept.drop()  # a poll waiting on it reads again
        if kept.watched:
            self._hub.unwatch(task_id, kept)

    def _sweep(self, now: float) -> None:
        if now - self._swept_at < IDLE_SECONDS:
            return
        self._swept_at = now
        for task_id in [t for t, kept in self._kept.items() if now - kept.polled_at > IDLE_SECONDS]:
            self._forget(task_id)
