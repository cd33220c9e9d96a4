"""What a submit reads for each kind of backend (common/backends.py KINDS).

A new backend of an existing kind needs no edit here: what differs between backends of a
kind is in their rows. A new kind adds its reader to READERS.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from common.catalog import KINDS, UnknownBackend, UnknownModel, backend_info, resolve_model
from common.settings import Settings
from common.store.blobs import BlobStore
from gateway.errors import RequestError
from gateway.submit.analysis import analysis_input
from gateway.submit.audio import AudioInput
from gateway.submit.diarization import asr_input
from gateway.submit.inputs import Params
from gateway.submit.speech import tts_input

#: (request params, settings, backend, where an upload may be staged) -> (the task's options,
#: its input audio)
Reader = Callable[[Params, Settings, str, BlobStore | None],
                  Awaitable[tuple[dict[str, Any], AudioInput]]]


async def _tts_input(params: Params, settings: Settings, backend: str,
                     blobs: BlobStore | None) -> tuple[dict[str, Any], AudioInput]:
    del blobs  # a voice clip is small: carried by the submit itself
    return await tts_input(params, settings, backend)


async def _analysis_input(params: Params, settings: Settings, backend: str,
                          blobs: BlobStore | None) -> tuple[dict[str, Any], AudioInput]:
    del blobs  # its clips are packed into one blob after they are read
    return await analysis_input(params, settings, backend)


READERS: dict[str, Reader] = {"asr": asr_input, "tts": _tts_input, "analysis": _analysis_input}
if missing := sorted(set(KINDS) - set(READERS)):  # a kind no submit could read: fail at start
    raise RuntimeError(f"no gateway reader for the kinds {missing}")


async def read_task_input(params: Params, settings: Settings, backend: str,
                          blobs: BlobStore | None = None) -> tuple[dict[str, Any], AudioInput]:
    """The options and input audio of a task for `backend`, checked as its kind requires;
    RequestError (nothing queued) for anything it would refuse. `blobs`: where an upload
    may be staged while it is probed (AudioInput.staged)."""
    try:
        kind = backend_info(settings, backend).kind
    except UnknownBackend as exc:
        raise RequestError(404, str(exc), param="backend", code="unknown_backend") from None
    if kind != "asr" and params.flag("diarize"):
        raise RequestError(400, f"backend {backend!r} does not transcribe: diarize is for ASR "
                                "backends", param="diarize")
    return await READERS[kind](params, settings, backend, blobs)


def resolve_backend_model(settings: Settings, backend: str, model: str | None) -> str:
    try:
        return resolve_model(settings, backend, model)
    except UnknownBackend as exc:
        raise RequestError(404, str(exc), param="backend", code="unknown_backend") from None
    except UnknownModel as exc:
        raise RequestError(404, str(exc), param="model", code="model_not_found") from None
