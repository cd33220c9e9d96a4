"""Every Redis key and stream name the service uses. Nothing else builds key strings."""

PREFIX = "sg:"
WORKER_GROUP = "workers"


def task(task_id: str) -> str:
    """Hash: one task's record (state, params, attempt, result, error …)."""
    return f"{PREFIX}task:{task_id}"


def task_pattern() -> str:
    return f"{PREFIX}task:*"


def queue(backend: str) -> str:
    """Stream of task ids for one backend, consumed by the group WORKER_GROUP."""
    return f"{PREFIX}queue:{backend}"


def dead_letter(backend: str) -> str:
    """Stream of tasks that exhausted their deliveries."""
    return f"{PREFIX}dead:{backend}"


def input_blob(task_id: str) -> str:
    return f"{PREFIX}blob:{task_id}:input"


def output_blob(task_id: str) -> str:
    return f"{PREFIX}blob:{task_id}:output"


def events(task_id: str) -> str:
    """Pub/sub channel: segments as they are produced, then the terminal state."""
    return f"{PREFIX}events:{task_id}"


def heartbeat(backend: str, consumer: str) -> str:
    """String with a TTL: a live worker's /health snapshot."""
    return f"{PREFIX}heartbeat:{backend}:{consumer}"


def heartbeat_pattern() -> str:
    return f"{PREFIX}heartbeat:*"


def breaker(backend: str, model: str) -> str:
    """Hash: consecutive load failures of one model, and whether it is marked unavailable."""
    return f"{PREFIX}breaker:{backend}:{model}"


def breaker_pattern() -> str:
    return f"{PREFIX}breaker:*"


def breaker_parts(key: str) -> tuple[str, str]:
    """(backend, model) of a breaker key."""
    backend, _, model = key.removeprefix(f"{PREFIX}breaker:").partition(":")
    return backend, model


def counters(backend: str) -> str:
    """Hash: per-backend counters (tasks by outcome, load failures, worker starts)."""
    return f"{PREFIX}stats:{backend}"


def histogram(backend: str, metric: str) -> str:
    """Hash: one latency histogram's cumulative buckets, sum and count."""
    return f"{PREFIX}hist:{backend}:{metric}"
