"""`/openapi.json` (what `/docs` shows) documents every `/v1/` route: its request (a body for
a POST, its path parameters otherwise) and its error responses with the error model. The
routes are read from the app itself, so a new one cannot be left undocumented."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from harness import procs
from harness.http_client import http
from tests.test_auth_routes import WEBSOCKET, app_routes

ERROR_FIELDS = {"message", "type", "param", "code"}
#: POST routes whose whole request is their path (an action on a resource)
BODYLESS_POSTS = {"/v1/tasks/{task_id}/redeliver"}


@pytest.fixture(scope="module")
def schema(redis_server: procs.RedisServer, workdir: Path) -> Iterator[dict[str, Any]]:
    """The schema a real gateway serves."""
    gateway = procs.gateway(redis_server.url, workdir).start()
    try:
        reply = http.get(f"{gateway.url}/openapi.json", timeout=30)
        assert reply.status_code == 200, reply.text
        yield reply.json()
    finally:
        gateway.stop()


def resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = schema["components"]["schemas"][node["$ref"].rsplit("/", 1)[1]]
    return node


def body_fields(schema: dict[str, Any], operation: dict[str, Any], media_type: str) -> set[str]:
    content = operation["requestBody"]["content"]
    assert list(content) == [media_type], content
    return set(resolve(schema, content[media_type]["schema"])["properties"])


def test_every_v1_route_documents_its_request_and_its_errors(schema: dict[str, Any]) -> None:
    routes = [(path, method) for path, method in app_routes()
              if path.startswith("/v1/") and method != WEBSOCKET]  # OpenAPI has no WebSockets
    assert len(routes) >= 8, routes
    for route_path, method in routes:
        path = re.sub(r"\{(\w+):\w+\}", r"{\1}", route_path)  # as OpenAPI writes `{id:path}`
        operation = schema["paths"][path][method.lower()]
        where = (method, path)
        if method == "POST" and path not in BODYLESS_POSTS:
            assert operation["requestBody"]["required"] is True, where
            content = operation["requestBody"]["content"]
            (media_type,) = content
            assert resolve(schema, content[media_type]["schema"])["properties"], where
        documented = {p["name"] for p in operation.get("parameters", []) if p["in"] == "path"}
        assert documented == set(re.findall(r"\{(\w+)\}", path)), where
        responses = operation["responses"]
        assert "422" not in responses, where  # a validation error is a 400 here
        errors = {status: r for status, r in responses.items() if status[0] in "45"}
        assert {"401"} <= set(errors), where
        for status, response in errors.items():
            model = resolve(schema, response["content"]["application/json"]["schema"])
            detail = resolve(schema, model["properties"]["error"])
            assert set(detail["properties"]) == ERROR_FIELDS, (where, status)
            assert response["description"], (where, status)


def test_the_audio_routes_document_their_fields_and_every_refusal(
        schema: dict[str, Any]) -> None:
    transcriptions = schema["paths"]["/v1/audio/transcriptions"]["post"]
    assert body_fields(schema, transcriptions, "multipart/form-data") >= {
        "file", "model", "language", "prompt", "response_format", "temperature",
        "timestamp_granularities[]", "stream"}
    translations = schema["paths"]["/v1/audio/translations"]["post"]
    assert "file" in body_fields(schema, translations, "multipart/form-data")
    speech = schema["paths"]["/v1/audio/speech"]["post"]
    assert body_fields(schema, speech, "application/json") >= {
        "model", "input", "voice", "response_format", "speed"}
    for operation in (transcriptions, translations, speech):
        assert {"400", "401", "404", "413", "503", "504"} <= set(operation["responses"])
        timeout = resolve(schema, operation["responses"]["504"]["content"]["application/json"]
                          ["schema"])
        assert "task_id" in timeout["properties"]
    upload = resolve(schema, transcriptions["requestBody"]["content"]["multipart/form-data"]
                     ["schema"])["properties"]["file"]
    assert upload["type"] == "string" and upload["format"] == "binary"
    formats = resolve(schema, speech["requestBody"]["content"]["application/json"]["schema"])
    assert "opus" in formats["properties"]["response_format"]["enum"]
    assert schema["paths"]["/v1/models"]["get"]["responses"]["200"]["content"][
        "application/json"]["schema"]["$ref"].endswith("/ModelList")
    one = schema["paths"]["/v1/models/{model}"]["get"]["responses"]
    assert one["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ModelCard")
    assert "404" in one
