"""`diarize=true` on an ASR submit (Sage, REST, OpenAI): its options and known speakers'
reference clips, checked before anything is queued.

Options: `num_speakers`, or `min_speakers`/`max_speakers` (1 to 32; absent, the count is
estimated); `known_speaker_names[]` with as many `known_speaker_references[]`: each an
uploaded clip (repeated uploads under that name), an OpenAI-style data URL
(`data:audio/wav;base64,…`) or a path under an allowed root, 2-10 s long.

What the task carries: `diarization` (the options, each reference named `known_speaker_N`);
uploaded references travel in the input blob with the main clip (common/clips.py,
`clips_packed`), paths in `clip_paths` (checked again by the worker as it opens them).
"""

from __future__ import annotations

import base64
import binascii
import re
from pathlib import Path
from typing import Any

from common import clips
from common.catalog import BACKENDS
from common.schemas import (
    AUTOMATIC_LABEL,
    MAX_KNOWN_SPEAKERS,
    MAX_REFERENCE_SECONDS,
    MAX_SPEAKERS,
    MIN_REFERENCE_SECONDS,
)
from common.settings import Settings
from common.store.blobs import BlobStore
from gateway.errors import RequestError
from gateway.submit.asr import asr_params
from gateway.submit.audio import AudioInput, probe_clip, read_audio_input
from gateway.submit.inputs import Params, integer_option, read_upload, resolve_allowed_path

NAMES = ("known_speaker_names[]", "known_speaker_names")
REFERENCES = ("known_speaker_references[]", "known_speaker_references")
COUNTS = ("num_speakers", "min_speakers", "max_speakers")
MAX_NAME_CHARACTERS = 64
_DATA_URL = re.compile(r"data:[\w/+.-]*(;[\w=.-]+)*;base64,", re.IGNORECASE)


async def asr_input(params: Params, settings: Settings, backend: str,
                    blobs: BlobStore | None = None) -> tuple[dict[str, Any], AudioInput]:
    """An ASR task's options and input audio, with its diarization if asked; `blobs` stages
    an upload while it is probed (not a diarized one: its clips are packed into one blob)."""
    options = asr_params(params, settings, backend)
    speakers = diarization_options(params, backend)
    audio = await read_audio_input(params, settings, blobs if speakers is None else None)
    if speakers is None:
        return options, audio
    options["diarization"] = speakers
    references = await _references(params, settings, len(speakers.get("names", [])))
    if not references:
        return options, audio
    uploads: dict[str, bytes] = {}
    paths: dict[str, str] = {}
    if audio.blob is not None:
        uploads["file"] = audio.blob
    else:
        paths["file"] = str(audio.path)
    for index, reference in enumerate(references):
        name = f"known_speaker_{index}"
        if isinstance(reference, bytes):
            uploads[name] = reference
        else:
            paths[name] = str(reference)
    speakers["references"] = [f"known_speaker_{i}" for i in range(len(references))]
    if paths:
        options["clip_paths"] = paths
    options["clips_packed"] = True
    return options, AudioInput(clips.pack(uploads), None, audio.info)


def given(params: Params, *names: str) -> str | None:
    """The first of `names` the request sets (a value, a list or an upload)."""
    for name in names:  # an upload first: `get` refuses a file where it wants a value
        if name in params.files or params.lists.get(name) or params.get(name) is not None:
            return name
    return None


def diarization_options(params: Params, backend: str) -> dict[str, Any] | None:
    """The task's `diarization` options, or None without `diarize`; a 400 naming the
    parameter for anything it would refuse."""
    row = BACKENDS[backend]
    if not params.flag("diarize"):
        if stray := given(params, *COUNTS, *NAMES, *REFERENCES):
            raise RequestError(400, f"{stray} needs diarize=true", param=stray)
        return None
    if not row.diarization:
        raise RequestError(400, f"backend {backend!r} has no speaker diarization",
                           param="diarize")
    options: dict[str, Any] = {}
    for name in COUNTS:
        if (count := integer_option(params, name, 1, MAX_SPEAKERS)) is not None:
            options[name] = count
    if "num_speakers" in options and ("min_speakers" in options or "max_speakers" in options):
        raise RequestError(400, "give num_speakers, or min_speakers/max_speakers, not both",
                           param="num_speakers")
    if options.get("min_speakers", 1) > options.get("max_speakers", MAX_SPEAKERS):
        raise RequestError(400, "min_speakers must not exceed max_speakers",
                           param="min_speakers")
    names = _names(params)
    if names and row.speakers:
        raise RequestError(400, f"{backend} names its own speakers: it takes no known "
                                "speakers", param="known_speaker_names")
    if names:
        options["names"] = names
    return options


def _names(params: Params) -> list[str]:
    name = given(params, *NAMES) or NAMES[0]
    params.check(name)
    names = [value.strip() for value in params.lists.get(name, [])]
    if len(names) > MAX_KNOWN_SPEAKERS:
        raise RequestError(400, f"at most {MAX_KNOWN_SPEAKERS} known speakers", param=name)
    for value in names:
        if (not value or len(value) > MAX_NAME_CHARACTERS or not value.isprintable()
                or any(c in value for c in "<>[]&")):
            raise RequestError(400, f"a known speaker's name is 1 to {MAX_NAME_CHARACTERS} "
                                    "printable characters, without < > [ ] &", param=name)
    if len(set(names)) != len(names):
        raise RequestError(400, "known speakers' names must differ", param=name)
    if any(AUTOMATIC_LABEL.fullmatch(value) for value in names):
        raise RequestError(400, "a known speaker's name cannot look like the labels given to "
                                "unknown speakers (SPEAKER_00, SPEAKER_01, …)", param=name)
    return names


async def _references(params: Params, settings: Settings, count: int) -> list[bytes | Path]:
    """Each known speaker's clip, probed: bytes (an upload or a data URL) or an allowed path."""
    name = given(params, *REFERENCES) or REFERENCES[0]
    uploads = params.file_lists.get(name, [])
    values = [] if uploads else params.listed(name)
    if len(uploads or values) != count:
        raise RequestError(400, f"{name}: {len(uploads or values)} clips for {count} "
                                "known_speaker_names; give one reference clip per name",
                           param=name)
    max_bytes = settings.max_upload_bytes
    references: list[bytes | Path] = []
    for upload in uploads:
        references.append(read_upload(upload, max_bytes, name))
    for value in values:
        if match := _DATA_URL.match(value):
            try:
                data = base64.b64decode(value[match.end():], validate=True)
            except (binascii.Error, ValueError):
                data = b""
            if not data:
                raise RequestError(400, "a known speaker reference is a data URL without "
                                        "base64 audio", param=name)
            references.append(data)
        else:
            try:
                references.append(resolve_allowed_path(value, settings.allowed_roots, name))
            except RequestError as exc:
                exc.message = f"{name}: {exc.message}"
                raise
    for reference in references:
        await _probe(reference, name)
    return references


async def _probe(source: bytes | Path, name: str) -> None:
    info = await probe_clip(source, name, f"a clip of {name}")
    if not MIN_REFERENCE_SECONDS <= info.duration <= MAX_REFERENCE_SECONDS:
        raise RequestError(400, f"{name}: a clip lasts {info.duration:.2f} s; each "
                                f"must last {MIN_REFERENCE_SECONDS:g} to "
                                f"{MAX_REFERENCE_SECONDS:g} s", param=name, code="invalid_audio")
