"""Everything that reads or writes Redis, and the only code that builds its keys
(`common/keys.py`): task records and their Lua scripts (`tasks`), a worker's side of a
backend's stream (`queue`), metrics every process records (`metrics`)."""

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

__all__ = ["Admission", "Breaker", "BreakerPolicy", "Duplicate", "Task", "TaskStore",
           "live_workers", "new_task_id", "write_heartbeat"]
