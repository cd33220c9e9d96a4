"""A submit's parameters from the query and the body (gateway/submit/inputs.read_params): the
body's value replaces the query's, for a list as for a single value, whatever the body's
encoding (form, multipart or JSON)."""

from __future__ import annotations

import asyncio
import json
from urllib.parse import urlencode

from starlette.requests import Request

from gateway.submit.inputs import Params, read_params

QUERY = urlencode([("known_speaker_names[]", "a"), ("known_speaker_names[]", "b"),
                   ("language", "fr")])
BOUNDARY = "sgboundary"


def params_of(query: str, body: bytes, content_type: str) -> Params:
    async def run() -> Params:
        delivered = False

        async def receive() -> dict:
            nonlocal delivered
            if delivered:
                return {"type": "http.disconnect"}
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}

        scope = {"type": "http", "method": "POST", "path": "/api/submit",
                 "query_string": query.encode(), "headers": [
                     (b"content-type", content_type.encode()),
                     (b"content-length", str(len(body)).encode())]}
        return await read_params(Request(scope, receive))

    return asyncio.run(run())


def multipart(fields: list[tuple[str, str]]) -> bytes:
    parts = [f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n{value}\r\n'
             for name, value in fields]
    return ("".join(parts) + f"--{BOUNDARY}--\r\n").encode()


def test_the_body_replaces_the_querys_list_and_value_in_every_encoding() -> None:
    fields = [("known_speaker_names[]", "c"), ("language", "en")]
    bodies = {
        "application/x-www-form-urlencoded": urlencode(fields).encode(),
        f"multipart/form-data; boundary={BOUNDARY}": multipart(fields),
        "application/json": json.dumps({"known_speaker_names[]": ["c"],
                                        "language": "en"}).encode(),
    }
    for content_type, body in bodies.items():
        params = params_of(QUERY, body, content_type)
        assert params.lists["known_speaker_names[]"] == ["c"], content_type
        assert params.get("language") == "en" and not params.problems, content_type
    alone = params_of(QUERY, b"", "application/x-www-form-urlencoded")
    assert alone.lists["known_speaker_names[]"] == ["a", "b"] and alone.get("language") == "fr"
