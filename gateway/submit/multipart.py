"""A multipart/form-data body parsed into memory: its fields and its uploads as bytes.

Starlette's parser writes each upload chunk by chunk into a SpooledTemporaryFile (a BytesIO
grown 64 KiB at a time, through a thread-pool hop per chunk once it spools to disk), and the
route then reads it back whole, since the upload goes to Redis as one value anyway. Here the
chunks are kept as they arrive and joined once: for an 11 s FLAC upload (1.1 MB) that was
1.2 ms of the gateway's CPU on the submit path. The body is bounded before it gets here
(SPEECH_MAX_UPLOAD_MIB, common/body_limit.py), so memory is what the upload needs anyway.
The parsing itself is python-multipart's, as in Starlette.
"""

from __future__ import annotations

import codecs
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header


class FormError(ValueError):
    """The body is not a usable multipart form; the message says why."""


@dataclass(slots=True)
class Upload:
    """One uploaded file."""

    filename: str
    content_type: str
    data: bytes


@dataclass(slots=True)
class _Part:
    name: str = ""
    filename: str | None = None
    content_type: str = ""
    chunks: list[bytes] = field(default_factory=list)
    size: int = 0


class _Collector:
    """python-multipart's callbacks, collecting each part in memory."""

    def __init__(self, charset: str, max_files: int, max_fields: int,
                 max_field_bytes: int) -> None:
        self.charset = charset
        self.max_files, self.max_fields = max_files, max_fields
        self.max_field_bytes = max_field_bytes
        self.items: list[tuple[str, str | Upload]] = []
        self.files = self.fields = 0
        self.part = _Part()
        self.headers: list[tuple[bytes, bytes]] = []
        self.header_name = self.header_value = b""

    def callbacks(self) -> dict[str, object]:
        return {"on_part_begin": self.on_part_begin, "on_part_data": self.on_part_data,
                "on_part_end": self.on_part_end, "on_header_field": self.on_header_field,
                "on_header_value": self.on_header_value, "on_header_end": self.on_header_end,
                "on_headers_finished": self.on_headers_finished}

    def on_part_begin(self) -> None:
        self.part = _Part()
        self.headers = []

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.header_value += data[start:end]

    def on_header_end(self) -> None:
        self.headers.append((self.header_name.lower(), self.header_value))
        self.header_name = self.header_value = b""

    def on_headers_finished(self) -> None:
        headers = dict(self.headers)
        _, options = parse_options_header(headers.get(b"content-disposition", b""))
        if b"name" not in options:
            raise FormError('a part\'s Content-Disposition must give its "name"')
        self.part.name = self.decode(options[b"name"])
        if b"filename" in options:
            self.files += 1
            if self.files > self.max_files:
                raise FormError(f"too many files: at most {self.max_files}")
            self.part.filename = self.decode(options[b"filename"])
            self.part.content_type = headers.get(b"content-type", b"").decode("latin-1")
        else:
            self.fields += 1
            if self.fields > self.max_fields:
                raise FormError(f"too many fields: at most {self.max_fields}")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        self.part.size += end - start
        if self.part.filename is None and self.part.size > self.max_field_bytes:
            raise FormError(f"the field {self.part.name!r} is longer than "
                            f"{self.max_field_bytes} bytes")
        self.part.chunks.append(data[start:end])

    def on_part_end(self) -> None:
        data = b"".join(self.part.chunks)
        if self.part.filename is None:
            self.items.append((self.part.name, self.decode(data)))
        else:
            self.items.append((self.part.name, Upload(self.part.filename,
                                                      self.part.content_type, data)))

    def decode(self, raw: bytes) -> str:
        try:
            return raw.decode(self.charset)
        except UnicodeDecodeError:
            return raw.decode("latin-1")


async def parse_form(content_type: str, stream: AsyncIterator[bytes], *, max_files: int,
                     max_fields: int, max_field_bytes: int) -> list[tuple[str, str | Upload]]:
    """The fields (str) and uploads (Upload) of a multipart/form-data body, in order; FormError
    when it is malformed or over a limit. Errors of `stream` (a body refused) propagate."""
    _, options = parse_options_header(content_type)
    boundary = options.get(b"boundary")
    if not boundary:
        raise FormError("the multipart Content-Type gives no boundary")
    charset = options.get(b"charset", b"utf-8").decode("latin-1")
    try:
        charset = codecs.lookup(charset).name
    except LookupError:
        charset = "latin-1"
    collector = _Collector(charset, max_files, max_fields, max_field_bytes)
    try:
        parser = MultipartParser(boundary, collector.callbacks())  # type: ignore[arg-type]
        async for chunk in stream:
            parser.write(chunk)
        parser.finalize()
    except FormParserError as exc:
        raise FormError(f"invalid multipart data ({exc})") from None
    return collector.items
