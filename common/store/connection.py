"""Every Redis client of every process is built here, with one retry policy, set explicitly.

Two ways to find Redis: `SPEECH_REDIS_URL`, or Redis Sentinel (`SPEECH_REDIS_SENTINELS` and
`SPEECH_REDIS_SENTINEL_MASTER`; the URL is then unused). With Sentinel, each new connection
asks the sentinels for the primary's address, so a connection that breaks (the primary
died) or hears READONLY (it was demoted to a replica) reconnects to whichever node was
promoted. Scripts need nothing more: redis-py's `Script` loads itself again when a node
answers NOSCRIPT (a promoted replica has an empty script cache).
"""

from __future__ import annotations

import asyncio
import builtins
import re
from collections.abc import Awaitable
from typing import Any, TypeVar

from redis.asyncio import BlockingConnectionPool, ConnectionPool, Redis
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.exceptions import (
    BusyLoadingError,
    ConnectionError,
    MasterDownError,
    OutOfMemoryError,
    ReadOnlyError,
    RedisError,
    ResponseError,
    TimeoutError,
    TryAgainError,
)

from common.settings import Settings

#: what the client itself retries (after reconnecting: with Sentinel, to a primary found
#: again). redis-py's default differs by how a client is built (none for a pool built from
#: a URL, three with up to 10 s of backoff for `Redis.from_url`), so every client here gets
#: this one: two retries, 50 ms then up to 500 ms apart, so a request waits well under a
#: second before it answers "unavailable" and a poll stays quick through a failover.
RETRIES = 2
RETRY_BACKOFF = (0.05, 0.5)  # base, cap (seconds)
#: errors that say "this node cannot take it now", not "this command is wrong": a lost or
#: refused connection, a timeout, a node still loading, a demoted primary, a replica whose
#: primary is gone. Anything else (a script's bug, a wrong type) is surfaced, never retried.
TRANSIENT: tuple[type[RedisError], ...] = (ConnectionError, TimeoutError, BusyLoadingError,
                                            ReadOnlyError, MasterDownError, TryAgainError)
_SOCKET = {"socket_connect_timeout": 2.0, "socket_timeout": 10.0}
#: a sentinel's answers are tiny and its lookups come one sentinel after another (redis-py's
#: `discover_master`): a sentinel that accepts and never answers (its host frozen, or gone
#: with the primary it watched) costs each lookup this long, tried once. With the timeouts
#: and retries above it cost 30 s a lookup, and a failover with it first in the list kept
#: submits hanging for a minute.
_SENTINEL_SOCKET = {"socket_connect_timeout": 0.5, "socket_timeout": 1.0}
#: a read a client is waiting on (a status poll, a task's view) answers within this long,
#: Redis or not: a paused or partitioned Redis keeps its socket open, and the socket timeout
#: times the retries, plus each reconnect's handshake, add up to half a minute
READ_DEADLINE_SECONDS = 2.0
T = TypeVar("T")


async def within_deadline(read: Awaitable[T]) -> T:
    """`read`'s result, or TimeoutError (a RedisError: "unavailable", as any) past
    READ_DEADLINE_SECONDS."""
    try:
        async with asyncio.timeout(READ_DEADLINE_SECONDS):
            return await read
    except builtins.TimeoutError:  # asyncio's; redis-py's own TimeoutError is another class
        raise TimeoutError(f"Redis did not answer within {READ_DEADLINE_SECONDS:g} s") from None


def retry_policy() -> Retry:
    return Retry(ExponentialWithJitterBackoff(base=RETRY_BACKOFF[0], cap=RETRY_BACKOFF[1]),
                 RETRIES, supported_errors=(ConnectionError, TimeoutError))


def transient(exc: BaseException) -> bool:
    """Whether `exc` is worth trying again later (see TRANSIENT)."""
    return isinstance(exc, TRANSIENT) or (
        isinstance(exc, ResponseError) and str(exc).startswith(("NOREPLICAS", "LOADING")))


#: Redis's error replies that a wait cures: memory full (noeviction: tasks expire and
#: finish), persistence failing (the operator's disk), a long script, a cluster re-forming
PASSING_REFUSALS = ("OOM", "MISCONF", "BUSY", "CLUSTERDOWN")
#: … as a Redis before 7.0 words a script's refused write: "ERR Error running script … -OOM …"
_PASSING_IN_TEXT = re.compile(rf"-(?:{'|'.join(PASSING_REFUSALS)})\b")


def error_code(exc: BaseException) -> str:
    """A Redis error's own code (NOPERM, WRONGTYPE, ERR), or its class: never its text, which
    may name keys, users or scripts. (redis-py keeps the code apart from the text of the
    errors it has a class for, OOM's and NOPERM's, and in the text of the others.)"""
    code = getattr(exc, "status_code", None) or str(exc).split(" ", 1)[0]
    return code if re.fullmatch(r"[A-Z]{2,20}", code) else type(exc).__name__


def store_unreachable(exc: BaseException) -> bool:
    """Whether `exc` says Redis cannot take work now (transient, full under noeviction, one
    of PASSING_REFUSALS): a wait, never a task's failure."""
    return transient(exc) or isinstance(exc, OutOfMemoryError) or (
        isinstance(exc, ResponseError) and (error_code(exc) in PASSING_REFUSALS
                                            or bool(_PASSING_IN_TEXT.search(str(exc)))))


def store_refused(exc: BaseException) -> bool:
    """Whether Redis answered with an error that no wait cures (an ACL's NOPERM, another
    application's key: WRONGTYPE, a script's ERR): the operator's to fix."""
    return isinstance(exc, ResponseError) and not store_unreachable(exc)


def sentinel_addresses(settings: Settings) -> list[tuple[str, int]]:
    found = []
    for entry in settings.redis_sentinels:
        host, _, port = entry.rpartition(":")
        found.append((host.strip("[]"), int(port)))
    return found


class BoundedSentinelPool(SentinelConnectionPool, BlockingConnectionPool):  # type: ignore[misc]
    """Sentinel's primary lookup with the bounded pool's waiting (see `bounded_client`)."""


def bounded_client(settings: Settings, client_name: str) -> Redis:
    """A gateway process's client. Past `redis_max_connections` a call waits up to
    `redis_pool_timeout_seconds` for a free connection instead of opening more (redis-py's
    default pool refuses with an error at 100); `client_name` shows in CLIENT LIST, so a
    process's connections can be counted."""
    return _client(settings, client_name, bounded=True,
                   max_connections=settings.redis_max_connections,
                   timeout=settings.redis_pool_timeout_seconds, health_check_interval=15)


def worker_client(settings: Settings, client_name: str) -> Redis:
    """A worker process's client: redis-py's plain pool (a worker holds a few connections)."""
    return _client(settings, client_name, bounded=False)


def _client(settings: Settings, client_name: str, *, bounded: bool, **pool: Any) -> Redis:
    options: dict[str, Any] = {**_SOCKET, "retry": retry_policy(), "client_name": client_name,
                               **pool}
    if settings.redis_password:
        options["password"] = settings.redis_password
    if not settings.redis_sentinels:
        url_pool = BlockingConnectionPool if bounded else ConnectionPool
        return Redis.from_pool(url_pool.from_url(settings.redis_url, **options))
    sentinel_options: dict[str, Any] = {**_SENTINEL_SOCKET, "retry": Retry(NoBackoff(), 0)}
    if settings.redis_sentinel_password:
        sentinel_options["password"] = settings.redis_sentinel_password
    sentinel = Sentinel(sentinel_addresses(settings), sentinel_kwargs=sentinel_options)
    return sentinel.master_for(
        settings.redis_sentinel_master,
        connection_pool_class=BoundedSentinelPool if bounded else SentinelConnectionPool,
        **options)
