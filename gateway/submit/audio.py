"""A submit's audio: an upload, a path under an allowed root or an `audio_url`, probed (demux
and a few packets) so garbage never reaches a queue; further clips probed the same way."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from common.audio import AudioError, AudioInfo, probe_audio
from common.settings import Settings
from common.store.blobs import BlobStore
from gateway.errors import RequestError
from gateway.submit.fetch import fetch_audio_url
from gateway.submit.inputs import Params, read_upload, resolve_allowed_path


@dataclass(slots=True)
class AudioInput:
    blob: bytes | None
    path: Path | None
    info: AudioInfo
    #: the key `blob` is staged under in Redis (BlobStore.stage): the submit renames it; a
    #: refusal after the read drops it (`unstage`). "" = not staged.
    staged: str = ""


async def read_audio_input(params: Params, settings: Settings,
                           blobs: BlobStore | None = None) -> AudioInput:
    """The request's audio (upload or allowed path), probed so garbage never reaches a queue;
    with `blobs`, an upload is staged in Redis while it is probed (dropped if refused)."""
    upload = params.upload("file")
    raw_path = params.get("audio_file", "audio_path")
    if upload is not None:
        blob = read_upload(upload, settings.max_upload_bytes)
        source: bytes | Path = blob
        path = None
    elif raw_path is not None:
        path = resolve_allowed_path(raw_path, settings.allowed_roots,
                                    "audio_file" if params.get("audio_file") else "audio_path")
        blob, source = None, path
    elif audio_url := params.get("audio_url"):
        blob = await fetch_audio_url(audio_url, settings, params.hold_more)
        source, path = blob, None
    else:
        raise RequestError(400, "no audio given: send a 'file' upload or an 'audio_path'",
                           param="file")
    staging = None if blobs is None or blob is None else asyncio.create_task(blobs.stage(blob))
    if staging is not None:
        # let it send the SET before the probe's thread takes the GIL (PyAV's demux holds it
        # for the whole probe): Redis then writes the blob while the probe runs
        await asyncio.sleep(0)
    try:
        info = await _probed(source, settings)
    except BaseException:
        if staging is not None and blobs is not None:
            await blobs.unstage(await staging)
        raise
    return AudioInput(blob, path, info, "" if staging is None else await staging)


async def _probed(source: bytes | Path, settings: Settings) -> AudioInfo:
    param = "audio_path" if isinstance(source, Path) else "file"
    try:
        info = await asyncio.to_thread(probe_audio, source)
    except AudioError as exc:
        raise RequestError(400, str(exc), param=param, code="invalid_audio") from None
    except OSError as exc:
        raise RequestError(400, f"cannot read the audio file ({exc.strerror})") from None
    if info.duration > settings.max_audio_seconds:
        raise RequestError(413, f"the audio lasts {info.duration:.0f} s; the limit is "
                                f"{settings.max_audio_seconds:.0f} s", param="file",
                           code="audio_too_long")
    return info


async def probe_clip(source: bytes | Path, param: str, what: str) -> AudioInfo:
    """Demux a further clip (a reference, a second input) before queueing, as the main input
    is: a 400 naming `param` when it is unusable; `what` names the clip in the message."""
    try:
        return await asyncio.to_thread(probe_audio, source)
    except AudioError as exc:
        raise RequestError(400, f"{what} is unusable: {exc}", param=param,
                           code="invalid_audio") from None
    except OSError as exc:
        raise RequestError(400, f"cannot read {what} ({exc.strerror})", param=param) from None
