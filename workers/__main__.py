"""Entry point of one worker process: `python -m workers` (settings from SPEECH_* env)."""

from __future__ import annotations

import asyncio

from common import logs
from common.settings import get_settings
from workers import memory


def main() -> None:
    settings = get_settings()
    logs.configure(f"worker:{settings.backend}", settings.log_level)
    # CTranslate2 reads its allocator settings when it first touches the GPU.
    memory.configure_ctranslate2_allocator(settings.memory_cap_mib)
    from workers.engines import create_engine
    from workers.http import serve_http
    from workers.runtime import Worker

    worker = Worker(settings, create_engine(settings.backend, settings))
    asyncio.run(worker.run(serve_http))


if __name__ == "__main__":
    main()
