"""Engine registry: backend name -> engine class, imported only by the worker that runs it."""

from __future__ import annotations

import importlib

from common.backends import BACKENDS
from common.settings import Settings
from workers.engines.base import Engine

#: backend -> "module:Class", from the backend table (common/backends.py)
ENGINE_CLASSES: dict[str, str] = {name: row.engine for name, row in BACKENDS.items()}


def create_engine(backend: str, settings: Settings) -> Engine:
    """The engine of `backend`, given the settings it reads its options from."""
    module_name, class_name = ENGINE_CLASSES[backend].split(":")
    return getattr(importlib.import_module(module_name), class_name)(settings)
