"""The background jobs every gateway process runs beside its routes (no leader: each is safe
to run in every replica). The app's lifespan starts them all, and at shutdown cancels and
awaits them all, so none outlives the store it uses."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from common.settings import Settings
from common.store import TaskStore
from common.store.webhooks import WebhookStore
from gateway.jobs.deliverer import deliver_forever
from gateway.jobs.sweeper import sweep_forever

Job = Callable[[TaskStore, WebhookStore, Settings], Awaitable[None]]

#: sweeper: stale PENDING/RUNNING tasks, leases, dead letters; deliverer: owed webhooks
JOBS: dict[str, Job] = {
    "sweeper": lambda store, _webhooks, settings: sweep_forever(store, settings),
    "deliverer": lambda _store, webhooks, settings: deliver_forever(webhooks, settings),
}


@asynccontextmanager
async def running_jobs(store: TaskStore, webhooks: WebhookStore,
                       settings: Settings) -> AsyncIterator[None]:
    tasks = [asyncio.create_task(job(store, webhooks, settings), name=f"gateway-{name}")
             for name, job in JOBS.items()]
    try:
        yield
    finally:
        for task in tasks:
            task.cancel()
        # awaited, so the deliverer closes its HTTP client before the store goes
        await asyncio.gather(*tasks, return_exceptions=True)
