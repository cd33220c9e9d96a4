"""uvicorn's server, woken once a second while nothing happens instead of ten times.

uvicorn's main loop sleeps 0.1 s between ticks only to notice `should_exit` and to refresh
the `date` header once a second. Every gateway and worker process runs one, and on a host
whose cores the engines use each wake-up takes a core from an engine's thread team for a
moment (bench/README.md, issue 24). Here the loop waits up to a second, and a stop (a signal
through uvicorn's own handler, or `stop()`) ends the wait at once, so shutting down is as
prompt as before.
"""

from __future__ import annotations

import asyncio
import contextlib
from types import FrameType

import uvicorn

#: ticks of uvicorn's own 0.1 s count one wait stands for (its `on_tick` refreshes the date
#: header when the count is a multiple of ten)
TICKS_A_WAIT = 10
WAIT_SECONDS = 1.0


class QuietServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None

    async def main_loop(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + TICKS_A_WAIT) % 864000
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(WAIT_SECONDS):
                    await self._stopping.wait()
            should_exit = await self.on_tick(counter)

    def stop(self) -> None:
        """Begin the graceful shutdown; from the loop's thread, another one, or a signal
        handler."""
        self.should_exit = True
        self._wake()

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        self._wake()

    def _wake(self) -> None:
        loop, stopping = self._loop, self._stopping
        if loop is not None and stopping is not None and not loop.is_closed():
            loop.call_soon_threadsafe(stopping.set)
