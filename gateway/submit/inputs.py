"""Request parameters and audio inputs: query string, form or JSON; uploads and allowed paths."""

from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from common import paths
from common.body_limit import HOLD_MORE, HoldMore
from common.schemas import text_problem
from gateway.errors import RequestError
from gateway.process.limits import BodyRefused
from gateway.submit.multipart import FormError, Upload, parse_form

MAX_FORM_FIELDS = 64
#: the audio and up to 4 known speakers' reference clips (gateway/submit/diarization.py), and room
MAX_FORM_FILES = 8
#: the largest form field that is not a file: a known speaker's reference as a data URL (up
#: to 10 s, 48 kHz stereo 32-bit float is 5.1 MB of base64); Starlette's default is 1 MB. The
#: whole body stays bounded by SPEECH_MAX_UPLOAD_MIB.
MAX_FIELD_BYTES = 8 * 1024 * 1024
#: parameters that may repeat (form, query) or be a JSON list; every other one is one value
LIST_PARAMS = frozenset({"timestamp_granularities", "timestamp_granularities[]",
                         "known_speaker_names", "known_speaker_names[]",
                         "known_speaker_references", "known_speaker_references[]"})

#: parameters that may be a JSON object naming an id (`{"id": …}`), read as that id
ID_OBJECT_PARAMS = frozenset({"voice"})


@dataclass(slots=True)
class Params:
    values: dict[str, str]
    files: dict[str, Upload]
    lists: dict[str, list[str]]
    #: why a parameter's value is unusable (a list or object for a scalar, repeated, NUL …):
    #: reported as a 400 naming it when a route reads it
    problems: dict[str, str] = field(default_factory=dict)
    #: every upload under each name, in order (`files` keeps the last)
    file_lists: dict[str, list[Upload]] = field(default_factory=dict)
    #: a custom voice's sample (`voice` = "voice_…"), read by the route that owns the voices
    voice_sample: bytes | None = None
    #: … and that voice's id and its consent's: the task names them (an audit of what spoke,
    #: and its worker refuses to speak once either is gone)
    custom_voice: tuple[str, str] | None = None
    #: what else the request may hold in memory, in its process's upload budget (an
    #: `audio_url` download; None: no budget, as in a worker's own server or a test)
    hold_more: HoldMore | None = None

    def get(self, *names: str) -> str | None:
        for name in names:
            self.check(name)
            value = self.values.get(name)
            if value is not None and value != "":
                return value
        return None

    def check(self, name: str) -> None:
        self._usable(name)
        if name in self.files:
            raise RequestError(400, f"{name} must be a value, not a file upload", param=name)

    def listed(self, name: str) -> list[str]:
        """Every value given for `name` (a list parameter); a 400 when one is unusable."""
        self._usable(name)
        return self.lists.get(name, [])

    def _usable(self, name: str) -> None:
        if name in self.problems:
            raise RequestError(400, f"{name} {self.problems[name]}", param=name)

    def upload(self, name: str) -> Upload | None:
        """The file uploaded as `name`, if any; a 400 when it came more than once (which
        one was meant is unknowable)."""
        if len(self.file_lists.get(name, ())) > 1:
            raise RequestError(400, f"{name} was uploaded more than once", param=name)
        return self.files.get(name)

    def flag(self, name: str) -> bool:
        value = (self.get(name) or "").strip().lower()
        if value in ("", "0", "false", "no", "off"):
            return False
        if value in ("1", "true", "yes", "on"):
            return True
        raise RequestError(400, f"{name} must be true or false, not {value[:40]!r}", param=name)

    def override(self, name: str, value: str | None) -> None:
        """Set (or, with None, remove) a parameter the route decides, whatever was sent."""
        self.problems.pop(name, None)
        self.lists.pop(name, None)
        if value is None:
            self.values.pop(name, None)
        else:
            self.values[name] = value


async def read_params(request: Request) -> Params:
    """Merge the query string with a form or JSON body (the body wins), for GET and POST
    alike (SPEC: a client may send either, with its params in either place)."""
    params = Params({}, {}, {}, hold_more=request.scope.get(HOLD_MORE))
    _add_pairs(params, request.query_params.multi_items())
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type == "multipart/form-data":
        try:
            items = await parse_form(request.headers["content-type"], request.stream(),
                                     max_files=MAX_FORM_FILES, max_fields=MAX_FORM_FIELDS,
                                     max_field_bytes=MAX_FIELD_BYTES)
        except FormError as exc:
            raise RequestError(400, f"malformed form body: {exc}") from None
        except ClientDisconnect:  # answered to no one; logged as a refusal, not a crash
            raise RequestError(400, "the client left before its body ended") from None
        fields = []
        for key, value in items:
            if isinstance(value, Upload):
                params.files[key] = value
                params.file_lists.setdefault(key, []).append(value)
            else:
                fields.append((key, value))
        _add_pairs(params, fields)
    elif content_type == "application/x-www-form-urlencoded":
        try:
            form = await request.form(max_fields=MAX_FORM_FIELDS, max_part_size=MAX_FIELD_BYTES)
        except BodyRefused:
            raise
        except Exception as exc:  # starlette raises HTTPException/MultiPartException variants
            raise RequestError(400, f"malformed form body: {getattr(exc, 'detail', exc)}") from None
        _add_pairs(params, [(key, value) for key, value in form.multi_items()
                            if isinstance(value, str)])
    elif content_type == "application/json":
        raw = await request.body()
        try:
            body: Any = json.loads(raw or b"{}")
        except (ValueError, RecursionError):  # RecursionError: nested deeper than the parser goes
            raise RequestError(400, "the JSON body is not valid JSON") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the JSON body must be an object")
        for key, value in body.items():
            _add_json(params, key, value)
    return params


def _add_pairs(params: Params, pairs: list[tuple[str, str]]) -> None:
    """Query or form fields; a scalar parameter given twice is ambiguous, so unusable."""
    counts = Counter(key for key, _ in pairs)
    for key in counts:  # what this source says replaces what an earlier one said
        params.problems.pop(key, None)
        params.lists.pop(key, None)  # a list too: the body's, not the query's and the body's
    for key, value in pairs:
        params.values[key] = value
        params.lists.setdefault(key, []).append(value)
        if counts[key] > 1 and key not in LIST_PARAMS:
            params.problems[key] = "was given more than once"
        elif problem := text_problem(value):
            params.problems[key] = problem


def _add_json(params: Params, key: str, value: Any) -> None:
    params.problems.pop(key, None)
    if key in ID_OBJECT_PARAMS and isinstance(value, dict) and isinstance(value.get("id"), str):
        value = value["id"]  # OpenAI's `voice: {"id": "voice_…"}`: a custom voice
    if key in LIST_PARAMS:
        items = value if isinstance(value, list) else [value]
        if any(isinstance(item, list | dict) for item in items):
            params.problems[key] = "must be a list of strings"
            return
        params.lists[key] = [_scalar(item) for item in items if item is not None]
        if problem := next(filter(None, map(text_problem, params.lists[key])), None):
            params.problems[key] = problem
    elif isinstance(value, list | dict):
        kind = "list" if isinstance(value, list) else "object"
        params.problems[key] = f"must be a single value, not a JSON {kind}"
    elif value is not None:
        params.values[key] = _scalar(value)
        if problem := text_problem(params.values[key]):
            params.problems[key] = problem


_INTEGER = re.compile(r"\+?[0-9]{1,4}")


def integer_option(params: Params, name: str, low: int, high: int) -> int | None:
    """The integer option `name` (None when absent), from `low` to `high`; a 400 naming it
    otherwise. Read as stripped, as its check reads it (int() refuses what strip() takes
    off: U+001C-U+001F)."""
    if (raw := params.get(name)) is None:
        return None
    raw = raw.strip()
    if not _INTEGER.fullmatch(raw) or not low <= int(raw) <= high:
        raise RequestError(400, f"{name} must be an integer from {low} to {high}", param=name)
    return int(raw)


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else json.dumps(value)


def read_upload(upload: Upload, max_bytes: int, param: str = "file") -> bytes:
    """The upload's bytes; a 413 or 400 naming `param` (the field it came in) if it is
    larger than `max_bytes` or empty."""
    data = upload.data
    what = "the uploaded file" if param == "file" else f"the '{param}' upload"
    if len(data) > max_bytes:
        raise RequestError(413, f"{what} is larger than {max_bytes} bytes", param=param)
    if not data:
        raise RequestError(400, f"{what} is empty", param=param)
    return data


def resolve_allowed_path(raw: str, roots: list[Path], param: str = "audio_path") -> Path:
    """A regular file strictly under one of `roots`, after resolving every symlink."""
    try:
        return paths.resolve_allowed_path(raw, roots)
    except paths.PathNotAllowed as exc:
        raise RequestError(400, str(exc), param=param) from None
