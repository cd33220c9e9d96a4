"""Entry point of one worker process: `python -m workers` (settings from SPEECH_* env).

The process edge: it builds the Redis client and the engine, lets the worker handle
SIGTERM/SIGINT, and gives it the exit policy (`exit_process`).
"""

from __future__ import annotations

import asyncio
import logging
import os

from common import logs
from common.settings import get_settings
from workers import memory


def main() -> None:
    settings = get_settings()
    logs.configure(f"worker:{settings.backend}", settings.log_level)
    # CTranslate2 reads its allocator settings when it first touches the GPU.
    memory.configure_ctranslate2_allocator(settings.memory_cap_mib)
    from common.store.connection import worker_client
    from workers.engines import create_engine
    from workers.http import serve_http
    from workers.runtime import Worker

    redis = worker_client(settings, f"worker-{settings.consumer_name()}")
    worker = Worker(settings, create_engine(settings.backend, settings), redis,
                    handle_signals=True, exit=exit_process)
    asyncio.run(worker.run(serve_http))


def exit_process(code: int) -> None:
    """End the process now. os._exit skips waiting for the engine thread, which may still
    run; after a failed load only an exit returns what a half-built model may hold."""
    logging.shutdown()
    os._exit(code)


if __name__ == "__main__":
    main()
