"""The try-it page: `GET /` and its static files (`/static/NAME`), straight from the package.

No build step and nothing from another host: the page reads backends, models, voices and
limits from `/api/config`, so it needs no change when the configuration does. The files hold
no data and are public; every API call the page makes carries the key the user typed.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import Response
from starlette.exceptions import HTTPException
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).resolve().parent.parent / "static"
# Unversioned file names: the browser may keep a copy but must revalidate it (ETag, 304),
# so a deploy shows at once.
CACHE_CONTROL = "no-cache"
#: the page runs only its own files: no inline script, nothing from another host, no frame
#: around it (clickjacking a page that holds a key); audio it plays or offers is a blob: URL,
#: and its live mode opens a WebSocket to the same host
CONTENT_SECURITY_POLICY = ("default-src 'self'; script-src 'self'; style-src 'self'; "
                           "img-src 'self' data:; media-src 'self' blob:; "
                           "connect-src 'self' ws: wss:; object-src 'none'; base-uri 'none'; "
                           "form-action 'self'; frame-ancestors 'none'")
_files = StaticFiles(directory=STATIC_DIR)

router = APIRouter()


@router.get("/", include_in_schema=False)
async def index(request: Request) -> Response:
    return await _serve("index.html", request)


@router.get("/static/{name}", include_in_schema=False)
async def static(name: str, request: Request) -> Response:
    return await _serve(name, request)


async def _serve(name: str, request: Request) -> Response:
    # StaticFiles refuses paths outside its directory and answers If-None-Match with a 304
    try:
        response = await _files.get_response(name, request.scope)
    except HTTPException as exc:
        raise HTTPException(exc.status_code, f"no such file: /static/{name}") from None
    response.headers["cache-control"] = CACHE_CONTROL
    response.headers["x-content-type-options"] = "nosniff"
    response.headers["content-security-policy"] = CONTENT_SECURITY_POLICY
    response.headers["x-frame-options"] = "DENY"
    response.headers["referrer-policy"] = "no-referrer"
    return response
