"""A multipart/form-data body parsed into memory: its fields and its uploads as bytes.

Starlette's parser writes each upload chunk by chunk into a SpooledTemporaryFile (a BytesIO
until it spools to disk, then a thread-pool hop per chunk), and the route then reads it back
whole, since the upload goes to Redis as one value anyway. Here a part's chunks are kept
as they arrive and joined once at its end: the gateway's CPU for an 11 s FLAC upload
(1.1 MB) 1.35 -> 0.75 ms. Past GATHER_BYTES they are gathered into one growing bytearray
instead, so a large upload does not leave a heap of freed chunks behind (after a 90 MiB
upload the gateway's RSS had grown 159 MiB with every chunk kept, 40 MiB gathered, 90 MiB
with Starlette's spool). The body is bounded before it gets here (SPEECH_MAX_UPLOAD_MIB,
common/body_limit.py). The parsing itself is python-multipart's, as in Starlette.
"""

from __future__ import annotations

import codecs
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header

#: a part's chunks past this many bytes go into one bytearray (see above)
GATHER_BYTES = 4 * 1024 * 1024


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
    #: the chunks gathered so far, once they passed GATHER_BYTES
    gathered: bytearray | None = None
    size: int = 0

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.gathered is not None:
            self.gathered += chunk
        elif self.size > GATHER_BYTES:
            self.chunks.append(chunk)
            self.gathered, self.chunks = bytearray().join(self.chunks), []
        else:
            self.chunks.append(chunk)

    def whole(self) -> bytes:
        return b"".join(self.chunks) if self.gathered is None else bytes(self.gathered)


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
        if self.part.filename is None and self.part.size + end - start > self.max_field_bytes:
            raise FormError(f"the field {self.part.name!r} is longer than "
                            f"{self.max_field_bytes} bytes")
        self.part.add(data[start:end])

    def on_part_end(self) -> None:
        part, self.part = self.part, _Part()  # its chunks go as soon as they are joined
        data = part.whole()
        if part.filename is None:
            self.items.append((part.name, self.decode(data)))
        else:
            self.items.append((part.name, Upload(part.filename, part.content_type, data)))

    def decode(self, raw: bytes) -> str:
        try:
            return raw.decode(self.charset)
        except UnicodeError:  # idna and the like raise more than UnicodeDecodeError
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
        codec = codecs.lookup(charset)
        if not getattr(codec, "_is_text_encoding", True):  # rot13, hex, zlib …: not text
            raise LookupError(charset)
        charset = codec.name
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
