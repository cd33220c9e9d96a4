"""A write that counts as done only once a replica holds it (Redis's WAIT).

Replication is asynchronous: a primary that dies right after answering takes the writes its
replica had not received yet, and Sentinel promotes that replica. So a submit (the task and
its queue entry) and a terminal write are followed by WAIT, on the same connection (WAIT
counts the replicas that have this connection's writes so far), before the caller is told.
The cost, measured by bench/redis_wait.py, is one more round trip to the primary plus the
replica's acknowledgement: see bench/README.md.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.commands.core import AsyncScript
from redis.exceptions import RedisError

from common.settings import Settings


class NotReplicated(RedisError):
    """The write is on the primary, but fewer than the required replicas confirmed it in
    time. `result` is what the script returned there."""

    def __init__(self, result: Any, confirmed: int, required: int) -> None:
        super().__init__(f"{confirmed} of {required} replicas confirmed the write in time")
        self.result = result


@dataclass(frozen=True, slots=True)
class ReplicaWait:
    replicas: int = 0  # 0: no wait
    timeout_ms: int = 500

    @classmethod
    def of(cls, settings: Settings) -> ReplicaWait:
        return cls(settings.wait_replicas, settings.redis_wait_timeout_ms)

    async def call(self, redis: Redis, script: AsyncScript, keys: list[Any], args: list[Any],
                   *, tries: int = 1, wrote: Callable[[Any], bool] | None = None) -> Any:
        """`script`'s result once `replicas` replicas hold its writes, waiting up to `tries`
        timeouts; NotReplicated (carrying the result) past them. `wrote`: whether a result
        means the script wrote anything (one that did not is returned as it is)."""
        if self.replicas <= 0:
            return await script(keys=keys, args=args)
        async with redis.client() as connection:  # one connection: WAIT counts its writes
            result = await script(keys=keys, args=args, client=connection)
            if wrote is not None and not wrote(result):
                return result
            # a connection the retry policy re-opened has no writes for WAIT to count: it
            # would confirm at once, so a reconnect between the write and WAIT confirms nothing
            reconnects, held = _Reconnects(), connection.connection
            assert held is not None
            held.register_connect_callback(reconnects.seen)
            try:
                for _ in range(tries):
                    confirmed = int(await connection.wait(self.replicas, self.timeout_ms))
                    if reconnects.count:
                        confirmed = 0
                        break
                    if confirmed >= self.replicas:
                        return result
            finally:
                held.deregister_connect_callback(reconnects.seen)
        raise NotReplicated(result, confirmed, self.replicas)


class _Reconnects:
    count = 0

    def seen(self, _connection: object) -> None:  # a bound method: redis-py keeps a weakref
        self.count += 1
