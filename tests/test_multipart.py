"""gateway/submit/multipart.py: bodies as httpx (a client the gateway serves) encodes them, fed
in chunks that split boundaries and headers anywhere."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import httpx
import pytest

from gateway.submit.multipart import GATHER_BYTES, FormError, Upload, parse_form

LIMITS = {"max_files": 3, "max_fields": 4, "max_field_bytes": 100}


def _encoded(data: dict[str, str], files: list[tuple[str, tuple[str, bytes, str]]]
             ) -> tuple[str, bytes]:
    request = httpx.Request("POST", "http://gateway/", data=data, files=files)
    return request.headers["content-type"], request.read()


def _parse(content_type: str, body: bytes, chunk: int = 65536,
           **limits: int) -> list[tuple[str, str | Upload]]:
    async def stream() -> AsyncIterator[bytes]:
        for start in range(0, len(body), chunk):
            yield body[start:start + chunk]
    return asyncio.run(parse_form(content_type, stream(), **{**LIMITS, **limits}))


@pytest.mark.parametrize(("chunk", "size"), [(1, 77_000), (7, 77_000), (4096, 77_000),
                                           (1 << 20, 77_000), (65536, GATHER_BYTES + 300_000)])
def test_fields_and_uploads_come_back_whole_and_in_order(chunk: int, size: int) -> None:
    """Also an upload past GATHER_BYTES, whose chunks are gathered as they come."""
    audio = (bytes(range(256)) * (size // 256) + b"\r\n--not-the-boundary\r\n")
    content_type, body = _encoded(
        {"model": "whisper-1", "prompt": "Zoë's café"},
        [("file", ("jfk ñ.flac", audio, "audio/flac")),
         ("known_speaker_references[]", ("a.wav", b"RIFFa", "audio/wav")),
         ("known_speaker_references[]", ("b.wav", b"RIFFb", "audio/wav"))])
    items = _parse(content_type, body, chunk)
    assert [name for name, _ in items] == ["model", "prompt", "file",
                                           "known_speaker_references[]",
                                           "known_speaker_references[]"]
    assert items[0][1] == "whisper-1" and items[1][1] == "Zoë's café"
    upload = items[2][1]
    assert isinstance(upload, Upload)
    assert (upload.filename, upload.content_type, upload.data) == ("jfk ñ.flac", "audio/flac",
                                                                   audio)
    assert [item[1].data for item in items[3:]] == [b"RIFFa", b"RIFFb"]  # type: ignore[union-attr]


def test_limits_and_malformed_bodies_say_what_is_wrong() -> None:
    one_file = [("file", ("a.wav", b"x", "audio/wav"))]
    content_type, body = _encoded({}, one_file * 4)
    with pytest.raises(FormError, match="too many files: at most 3"):
        _parse(content_type, body)
    content_type, body = _encoded({f"f{i}": "v" for i in range(5)}, one_file)
    with pytest.raises(FormError, match="too many fields: at most 4"):
        _parse(content_type, body)
    content_type, body = _encoded({"prompt": "x" * 101}, one_file)
    with pytest.raises(FormError, match="'prompt' is longer than 100 bytes"):
        _parse(content_type, body)
    # a file is not held to the field limit (the body's own limit bounds it)
    content_type, body = _encoded({}, [("file", ("a.wav", b"x" * 1000, "audio/wav"))])
    assert len(_parse(content_type, body)[0][1].data) == 1000  # type: ignore[union-attr]
    with pytest.raises(FormError, match="no boundary"):
        _parse("multipart/form-data", body)
    with pytest.raises(FormError, match="invalid multipart data"):
        _parse("multipart/form-data; boundary=x", b"--x\r\n\x00\xff" * 100)
    endless = b"--x\r\nContent-Disposition: form-data; name=" + b"n" * 100_000
    with pytest.raises(FormError, match="header size"):  # python-multipart bounds it
        _parse("multipart/form-data; boundary=x", endless, chunk=4096)
    nameless = b'--x\r\nContent-Disposition: form-data\r\n\r\nv\r\n--x--\r\n'
    with pytest.raises(FormError, match='"name"'):
        _parse("multipart/form-data; boundary=x", nameless)


def test_a_body_cut_short_keeps_no_part_it_did_not_finish() -> None:
    content_type, body = _encoded({"model": "whisper-1"},
                                  [("file", ("a.wav", b"y" * 5000, "audio/wav"))])
    items = _parse(content_type, body[:len(body) // 2])
    assert items == [("model", "whisper-1")]


@pytest.mark.parametrize("charset", ["rot13", "hex", "zlib", "base64", "idna", "no-such"])
def test_a_charset_that_is_no_text_encoding_reads_as_latin1(charset: str) -> None:
    content_type, body = _encoded({"prompt": "caf\u00e9 ..x"},
                                  [("file", ("a.wav", b"RIFF", "audio/wav"))])
    items = _parse(f"{content_type}; charset={charset}", body)
    assert items[0] == ("prompt", "caf\u00e9 ..x".encode().decode("latin-1"))
