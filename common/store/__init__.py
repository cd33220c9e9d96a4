"""Everything that reads or writes Redis, and the only code that builds its keys
(`common/keys.py`): task records and their Lua scripts (`tasks`), a worker's side of a
backend's stream (`queue`), metrics every process records (`metrics`), and all of a worker's
side in one object (`worker.WorkerStore`)."""

from common.store.tasks import (
    Admission,
    Breaker,
    BreakerPolicy,
    Duplicate,
    Task,
    TaskStore,
    live_workers,
    new_task_id,
    write_heartbeat,
)
from common.store.worker import WorkerStore

__all__ = ["Admission", "Breaker", "BreakerPolicy", "Duplicate", "Task", "TaskStore",
           "WorkerStore", "live_workers", "new_task_id", "write_heartbeat"]
