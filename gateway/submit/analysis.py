"""Submits to an `analysis` backend (audio in, a JSON result out): every clip and param its
row declares (common/backends.py), checked before anything is queued.

The main clip comes like an ASR input (a `file` upload, `audio_path`, `audio_url`); each
other clip is an upload under its name or an allowed path given as its value. Uploaded clips
travel in the task's one input blob (common/clips.py); paths travel in the task's options
(`clip_paths`), and the worker checks them against the allowed roots again as it opens them.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from common import clips
from common.catalog import BACKENDS
from common.settings import Settings
from gateway.errors import RequestError
from gateway.submit.audio import AudioInput, probe_clip, read_audio_input
from gateway.submit.inputs import Params, read_upload, resolve_allowed_path


async def analysis_input(params: Params, settings: Settings,
                         backend: str) -> tuple[dict[str, Any], AudioInput]:
    row = BACKENDS[backend]
    options: dict[str, Any] = {}
    for param in row.params:
        try:
            value = param.value(params.get(param.name))
        except ValueError as exc:
            raise RequestError(400, str(exc), param=param.name) from None
        if value is not None:
            options[param.name] = value
    main, *others = row.inputs
    audio = await read_audio_input(params, settings)
    uploads: dict[str, bytes] = {}
    paths: dict[str, str] = {}
    seconds = audio.info.duration
    if audio.blob is not None:
        uploads[main.name] = audio.blob
    else:
        paths[main.name] = str(audio.path)
    for clip in others:
        upload = params.upload(clip.name)
        raw_path = None if upload is not None else params.get(clip.name)
        if upload is not None:
            uploads[clip.name] = read_upload(upload, _max_bytes(settings), clip.name)
            seconds += await _probe(uploads[clip.name], clip.name, settings)
        elif raw_path:
            try:
                path = resolve_allowed_path(raw_path, settings.allowed_roots, clip.name)
            except RequestError as exc:
                exc.message = f"the '{clip.name}' clip: {exc.message}"
                raise
            seconds += await _probe(path, clip.name, settings)
            paths[clip.name] = str(path)
        elif clip.required:
            raise RequestError(400, f"no '{clip.name}' clip: upload it under that name or give "
                                    "a path under an allowed root", param=clip.name)
    if paths:
        options["clip_paths"] = paths
    # every clip is decoded, scored and charged: the task's audio_seconds (its charge, its
    # size in the backlog, its memory class) are all of them
    return options, AudioInput(clips.pack(uploads) if uploads else None, None,
                               dataclasses.replace(audio.info, duration=seconds))


def _max_bytes(settings: Settings) -> int:
    return settings.max_upload_bytes


async def _probe(source: bytes | Path, name: str, settings: Settings) -> float:
    """Garbage never reaches a queue: each clip is demuxed here, as the main one is; its
    length."""
    info = await probe_clip(source, name, f"the '{name}' clip")
    if info.duration > settings.max_audio_seconds:
        raise RequestError(413, f"the '{name}' clip lasts {info.duration:.0f} s; the limit is "
                                f"{settings.max_audio_seconds:.0f} s", param=name)
    return info.duration
