"""The Redis client a gateway process holds: one bounded pool, shared by every request."""

from __future__ import annotations

from redis.asyncio import BlockingConnectionPool, Redis

from common.settings import Settings


def bounded_client(settings: Settings, client_name: str) -> Redis:
    """Past `redis_max_connections` a call waits up to `redis_pool_timeout_seconds` for a free
    connection instead of opening more (redis-py's default pool refuses with an error at
    100); `client_name` shows in CLIENT LIST, so a process's connections can be counted."""
    pool = BlockingConnectionPool.from_url(
        settings.redis_url, max_connections=settings.redis_max_connections,
        timeout=settings.redis_pool_timeout_seconds, socket_connect_timeout=2,
        socket_timeout=10, health_check_interval=15, client_name=client_name)
    return Redis.from_pool(pool)
