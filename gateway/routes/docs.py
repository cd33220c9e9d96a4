"""The API description (`/openapi.json`, `/docs`, `/redoc`) as ordinary routes, so the access
rule of the protected routers covers them like every other route."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse

from gateway.protocol import REQUEST_MODELS

router = APIRouter(include_in_schema=False)
OPENAPI_URL = "/openapi.json"
REF = "#/components/schemas/{model}"


def openapi_schema(app: FastAPI) -> dict[str, Any]:
    """FastAPI's schema, plus the request models the submit routes declare but parse
    themselves (gateway/protocol.py), less FastAPI's 422: a validation error is a 400 here."""
    if app.openapi_schema:
        return app.openapi_schema
    schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for name, model in REQUEST_MODELS.items():
        found = model.model_json_schema(by_alias=True, ref_template=REF)
        components.update(found.pop("$defs", {}))
        components[name] = found
    for operations in schema["paths"].values():
        for operation in operations.values():
            operation.get("responses", {}).pop("422", None)
    for unused in ("HTTPValidationError", "ValidationError"):
        components.pop(unused, None)
    app.openapi_schema = schema
    return schema


@router.get(OPENAPI_URL)
async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


@router.get("/docs")
async def swagger(request: Request) -> HTMLResponse:
    return get_swagger_ui_html(openapi_url=OPENAPI_URL, title=f"{request.app.title} - docs")


@router.get("/redoc")
async def redoc(request: Request) -> HTMLResponse:
    return get_redoc_html(openapi_url=OPENAPI_URL, title=f"{request.app.title} - ReDoc")
