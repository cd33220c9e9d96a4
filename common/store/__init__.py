"""Everything that reads or writes Redis, and the only code that builds its keys
(`common/keys.py`): the task record (`record`), its lifecycle scripts (`tasks`), queue
positions and depths (`positions`), input and output blobs (`blobs`), live workers
(`live`), the models' circuit breakers (`breakers`), a worker's side of a backend's stream
(`queue`), metrics every process records and the gateway reads (`metrics`), usage and
quotas per key (`usage`), all of a worker's side in one object (`worker.WorkerStore`), the
gateway's pub/sub multiplexer (`events`), the sweeper's stream reads (`upkeep`), custom
voices and their consents (`voices`), ephemeral realtime keys (`client_secrets`), every
process's Redis client, plain or through Sentinel, with its one retry policy (`connection`)
and the wait for a replica after a submit or a terminal write (`replicas`)."""

# what any store call raises when Redis is unreachable, too slow, or its pool exhausted:
# callers answer "unavailable" and never need to import redis themselves
from redis.exceptions import RedisError as StoreError

from common.store.breakers import Admission, Breaker, BreakerPolicy
from common.store.record import (
    Duplicate,
    InputsFull,
    QueueFull,
    Task,
    TooManyInFlight,
    TooManySubmits,
    new_task_id,
)
from common.store.tasks import TaskStore
from common.store.usage import Charge, QuotaExceeded
from common.store.worker import WorkerStore

__all__ = ["Admission", "Breaker", "BreakerPolicy", "Charge", "Duplicate", "InputsFull",
           "QueueFull", "QuotaExceeded", "StoreError", "Task", "TaskStore", "TooManyInFlight",
           "TooManySubmits", "WorkerStore", "new_task_id"]
