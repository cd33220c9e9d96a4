"""Cancelling asyncio tasks that may not take a cancel the first time."""

from __future__ import annotations

import asyncio

#: how long a cancelled loop has to end before it is cancelled again (the HTTP server's
#: graceful shutdown, workers/http.py, fits in it)
RECANCEL_SECONDS = 3.0


async def cancel_all(tasks: set[asyncio.Task], every: float = RECANCEL_SECONDS) -> None:
    """Cancel every task and wait until all have ended. A cancel can be lost: redis-py (8.1)
    may finish a command it was cancelled in and return normally, and a loop around it (the
    heartbeat's, a lease keeper's) would then run on for ever, the worker never leaving; so
    whatever still runs `every` seconds later is cancelled again."""
    pending = tasks
    while pending:
        for task in pending:
            task.cancel()
        _, pending = await asyncio.wait(pending, timeout=every)
    for task in tasks:  # retrieved, so none is logged as never retrieved
        if not task.cancelled():
            task.exception()
