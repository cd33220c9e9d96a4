"""Engine registry: backend name -> engine class, imported only by the worker that runs it."""

from __future__ import annotations

import importlib

from common.settings import Settings
from workers.engines.base import Engine

ENGINE_CLASSES: dict[str, str] = {
    "faster-whisper": "workers.engines.faster_whisper:FasterWhisperEngine",
    "qwen3": "workers.engines.qwen3:Qwen3Engine",
    "vibevoice": "workers.engines.vibevoice:VibeVoiceEngine",
    "parakeet": "workers.engines.parakeet:ParakeetEngine",
    "xtts": "workers.engines.xtts:XttsEngine",
}


def create_engine(backend: str, settings: Settings) -> Engine:
    """The engine of `backend`, given the settings it reads its options from."""
    module_name, class_name = ENGINE_CLASSES[backend].split(":")
    return getattr(importlib.import_module(module_name), class_name)(settings)
