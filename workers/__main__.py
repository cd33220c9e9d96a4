"""Entry point of one worker process: `python -m workers` (settings from SPEECH_* env).

The process edge: it builds the Redis client and the engine, lets the worker handle
SIGTERM/SIGINT, and gives it the exit policy (`exit_process`) and the re-exec one
(`reexec_process`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys

from common import logs
from common.settings import get_settings
from workers import memory, openmp


def main() -> None:
    settings = get_settings()
    logs.configure(f"worker:{settings.backend}", settings.log_level)
    if settings.gpu:  # before any library reads it (CUDA reads it once, at its first call)
        os.environ["CUDA_VISIBLE_DEVICES"] = settings.gpu
    # CTranslate2 reads its allocator settings when it first touches the GPU, and OpenMP its
    # wait policy when the engine's library loads: both before create_engine imports it.
    memory.configure_ctranslate2_allocator(settings.memory_cap_mib)
    omp_policy = openmp.configure(settings.omp_wait_policy, settings.host_workers)
    logging.getLogger(__name__).info("OpenMP wait policy: %s", omp_policy)
    from common.store.connection import worker_client
    from workers.engines import create_engine
    from workers.http import serve_http
    from workers.runtime import Handover, Worker

    handover = Handover.take()  # out of the environment before any child process starts
    redis = worker_client(settings, f"worker-{settings.consumer_name()}")
    worker = Worker(settings, create_engine(settings.backend, settings), redis,
                    handle_signals=True, exit=exit_process, reexec=reexec_process,
                    handover=handover)
    asyncio.run(worker.run(serve_http))


def exit_process(code: int) -> None:
    """End the process now. os._exit skips waiting for the engine thread, which may still
    run; after a failed load only an exit returns what a half-built model may hold."""
    logging.shutdown()
    os._exit(code)


def reexec_process(environment: dict[str, str]) -> None:
    """Become a fresh image of this worker in the same process (same pid, so supervisord
    and whoever tracks it see no restart): the interpreter and command line it was started
    with, the code now on disk, this environment plus `environment`. Every other thread
    ends; descriptors not marked inheritable close. A failed exec exits (a restart)."""
    logging.shutdown()
    try:
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]],
                  {**os.environ, **environment})
    except OSError as exc:
        print(f"worker: re-exec failed ({exc}); exiting", file=sys.stderr, flush=True)
        os._exit(1)


if __name__ == "__main__":
    main()
