"""The API description (`/openapi.json`, `/docs`, `/redoc`) as ordinary routes, so the app's
access rule (gateway/auth.py) covers them like every other route."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

router = APIRouter(include_in_schema=False)
OPENAPI_URL = "/openapi.json"


@router.get(OPENAPI_URL)
async def openapi(request: Request) -> JSONResponse:
    return JSONResponse(request.app.openapi())


@router.get("/docs")
async def swagger(request: Request) -> HTMLResponse:
    return get_swagger_ui_html(openapi_url=OPENAPI_URL, title=f"{request.app.title} - docs")


@router.get("/redoc")
async def redoc(request: Request) -> HTMLResponse:
    return get_redoc_html(openapi_url=OPENAPI_URL, title=f"{request.app.title} - ReDoc")
