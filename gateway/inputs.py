"""Request parameters and audio inputs: query string, form or JSON; uploads and allowed paths."""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import Request
from starlette.datastructures import UploadFile

from gateway.limits import BodyTooLarge

MAX_FORM_FIELDS = 64
MAX_FORM_FILES = 4


class RequestError(Exception):
    """A request we refuse: rendered as Sage JSON or OpenAI error JSON by the route."""

    def __init__(self, status_code: int, message: str, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code


@dataclass(slots=True)
class Params:
    values: dict[str, str]
    files: dict[str, UploadFile]
    lists: dict[str, list[str]]

    def get(self, *names: str) -> str | None:
        for name in names:
            value = self.values.get(name)
            if value is not None and value != "":
                return value
        return None

    def flag(self, name: str) -> bool:
        value = (self.get(name) or "").strip().lower()
        if value in ("", "0", "false", "no", "off"):
            return False
        if value in ("1", "true", "yes", "on"):
            return True
        raise RequestError(400, f"{name} must be true or false, not {value!r}", param=name)


async def read_params(request: Request) -> Params:
    """Merge the query string with a form or JSON body (the body wins)."""
    values: dict[str, str] = {}
    lists: dict[str, list[str]] = {}
    files: dict[str, UploadFile] = {}
    for key, value in request.query_params.multi_items():
        values[key] = value
        lists.setdefault(key, []).append(value)
    if request.method != "POST":
        return Params(values, files, lists)
    content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type in ("multipart/form-data", "application/x-www-form-urlencoded"):
        try:
            form = await request.form(max_files=MAX_FORM_FILES, max_fields=MAX_FORM_FIELDS)
        except BodyTooLarge:
            raise
        except Exception as exc:  # starlette raises HTTPException/MultiPartException variants
            raise RequestError(400, f"malformed form body: {getattr(exc, 'detail', exc)}") from None
        for key, value in form.multi_items():
            if isinstance(value, UploadFile):
                files[key] = value
            else:
                values[key] = value
                lists.setdefault(key, []).append(value)
    elif content_type == "application/json":
        try:
            body: Any = json.loads(await request.body() or b"{}")
        except ValueError:
            raise RequestError(400, "the JSON body is not valid JSON") from None
        if not isinstance(body, dict):
            raise RequestError(400, "the JSON body must be an object")
        for key, value in body.items():
            if isinstance(value, list):
                lists[key] = [_scalar(v) for v in value]
            elif value is not None:
                values[key] = _scalar(value)
    return Params(values, files, lists)


def _scalar(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else json.dumps(value)


async def read_upload(upload: UploadFile, max_bytes: int) -> bytes:
    data = await upload.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise RequestError(413, f"the uploaded file is larger than {max_bytes} bytes",
                           param="file")
    if not data:
        raise RequestError(400, "the uploaded file is empty", param="file")
    return data


def resolve_allowed_path(raw: str, roots: list[Path], param: str = "audio_path") -> Path:
    """A regular file strictly under one of `roots`, after resolving every symlink."""
    if not roots:
        raise RequestError(400, "server-side paths are disabled (no allowed roots configured)",
                           param=param)
    if "\x00" in raw:
        raise RequestError(400, "the path contains a NUL byte", param=param)
    candidate = Path(raw)
    if ".." in candidate.parts:
        raise RequestError(400, "the path may not contain '..'", param=param)
    real_roots = [Path(os.path.realpath(root)) for root in roots]
    options = [candidate] if candidate.is_absolute() else [root / candidate for root in real_roots]
    for option in options:
        real = Path(os.path.realpath(option))
        if not any(real == root or root in real.parents for root in real_roots):
            continue
        try:
            mode = real.stat().st_mode
        except OSError:
            continue
        if not stat.S_ISREG(mode):
            raise RequestError(400, "the path is not a regular file", param=param)
        return real
    if any(Path(os.path.realpath(option)).exists() for option in options):
        raise RequestError(400, "the path is outside the allowed roots", param=param)
    raise RequestError(400, "no such file under the allowed roots", param=param)
