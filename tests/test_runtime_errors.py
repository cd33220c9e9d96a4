"""How the worker's engine host turns an engine's failure into a task error, on the real
faster-whisper engine with a GPU out-of-memory injected (this machine has no GPU to exhaust)."""

from __future__ import annotations

import asyncio
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from common.audio import decode_audio, encode_wav
from common.schemas import ErrorCode, Segment, Transcription, TranscriptionOptions
from common.settings import Settings
from tests.helpers import JFK, JFK_TEXT, wer
from workers.engine_host import EngineHost
from workers.engines.faster_whisper import FasterWhisperEngine
from workers.execute import MEMORY_LIMIT_ERROR, TaskError

held: list[weakref.ref] = []


class ExhaustedOnce(FasterWhisperEngine):
    """The real engine; its first transcription dies the way CUDA does when memory runs out."""

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        self.failed = False

    def transcribe(self, handle: Any, audio: np.ndarray, options: TranscriptionOptions,
                   on_segment: Callable[[Segment], None]) -> Transcription:
        if not self.failed:
            self.failed = True
            activations = np.ones(4_000_000, dtype=np.float32)  # what a traceback would pin
            held.append(weakref.ref(activations))
            raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return super().transcribe(handle, audio, options, on_segment)


def test_out_of_memory_is_a_clear_error_that_frees_the_call_and_keeps_serving() -> None:
    settings = Settings(redis_url="redis://127.0.0.1:1/0", idle_unload_seconds=-1)
    host = EngineHost(settings, ExhaustedOnce(settings))

    async def run() -> Any:
        return await host.execute("tiny.en", {}, JFK.read_bytes(), lambda s: None)

    with pytest.raises(TaskError) as failure:
        asyncio.run(run())
    error = failure.value
    assert str(error) == MEMORY_LIMIT_ERROR and error.code == ErrorCode.OUT_OF_MEMORY
    assert error.code.http_status == 503  # the server is short of memory, not the upload too big
    assert error.__context__ is None and error.__cause__ is None
    assert held[0]() is None, "the failed call's tensors outlived it"
    assert host.running_calls == 0 and host.slot.loaded_models == ["tiny.en"]
    outcome = asyncio.run(run())  # the worker goes on with the next task
    assert wer(JFK_TEXT, outcome.result["text"]) <= 0.10


def test_a_model_is_idle_from_the_end_of_its_last_call_not_its_start() -> None:
    """A call that lasts longer than `idle_unload_seconds` (1 s) leaves its model resident
    for that long after it ends, for the next task, not unloaded the moment it returns."""
    settings = Settings(redis_url="redis://127.0.0.1:1/0", idle_unload_seconds=1.0)
    host = EngineHost(settings, FasterWhisperEngine(settings))
    speech = decode_audio(JFK.read_bytes(), 16000, None)
    long_clip = encode_wav(np.concatenate([speech] * 12), 16000)  # 132 s: seconds on a cpu

    async def scenario() -> tuple[float, float, float]:
        await host.execute("tiny.en", {"beam_size": 1}, JFK.read_bytes(), lambda s: None)
        watcher = asyncio.create_task(host.unload_when_idle())
        began = time.monotonic()
        await host.execute("tiny.en", {"beam_size": 5}, long_clip, lambda s: None)
        ended = time.monotonic()
        await watcher
        return began, ended, time.monotonic()

    began, ended, unloaded = asyncio.run(scenario())
    assert ended - began > 1.5  # else the check proves nothing
    assert unloaded - ended >= 0.9, (ended - began, unloaded - ended)
    assert host.slot.loaded_models == []
