"""Waiting for a task without busy polling: Redis pub/sub on the task's event channel.

Subscribe first, then read the state, so a task finishing in between is never missed.
If Redis drops the subscription (a restart), fall back to reading the state twice a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import RedisError

from common import keys
from common.store import Task, TaskStore


async def task_events(redis: Redis, store: TaskStore, task_id: str,
                      timeout: float) -> AsyncIterator[dict[str, Any]]:
    """Segment events as the worker publishes them, then one {"type": "done", "task": Task}.

    Ends with {"type": "timeout"} if the task is not finished within `timeout` seconds.
    The caller may subscribe before the task is submitted (so no segment is missed).
    """
    deadline = time.monotonic() + timeout
    pubsub = redis.pubsub()
    try:
        await pubsub.subscribe(keys.events(task_id))
        yield {"type": "subscribed"}
        while (remaining := deadline - time.monotonic()) > 0:
            try:
                message = await pubsub.get_message(ignore_subscribe_messages=True,
                                                   timeout=min(remaining, 1.0))
            except RedisError:
                await asyncio.sleep(min(remaining, 0.5))
                message = None
            if message is not None:
                event = json.loads(message["data"])
                if event.get("type") == "segment":
                    yield event
                    continue
            task = await _state(store, task_id)
            if task is not None and task.state.terminal:
                yield {"type": "done", "task": task}
                return
        yield {"type": "timeout"}
    finally:
        with contextlib.suppress(RedisError):
            await pubsub.aclose()


async def _state(store: TaskStore, task_id: str) -> Task | None:
    try:
        return await store.get(task_id)
    except RedisError:
        return None
