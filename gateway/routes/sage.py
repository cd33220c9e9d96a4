"""Sage llmage endpoints: submit, then poll (gateway/serving/sage.py). Every status reply is
HTTP 200 JSON with `status`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import State
from starlette.types import Receive, Scope, Send

from gateway.auth import Owner, caller
from gateway.dependencies import PollsDep, SettingsDep, StoreDep
from gateway.errors import RequestError, is_status_path, sage_body, sage_errors, unexpected
from gateway.serving import sage

router = APIRouter(tags=["Sage"])
SUBMIT_REPLY = {200: {"description": "The queued task; with `refusal=task` in the URL (as "
                                     "Sage's map sends it) also a refusal, as a task FAILED "
                                     "from the start: `taskid`, `status: FAILED`, `error`, "
                                     "`code`, `http_status`; its status poll reads the same"},
                **sage_errors(400, 401, 404, 409, 413, 429, 503)}
STATUS_REPLY = {200: {"description": "Always HTTP 200 with a `status` (FAILED for a refused "
                                     "poll: a bad key, body or value)"}}


@router.get("/api/submit", responses=SUBMIT_REPLY)
@router.post("/api/submit", responses=SUBMIT_REPLY)
async def submit(request: Request, owner: Owner, settings: SettingsDep,
                 store: StoreDep) -> Response:
    """Queue a task for the `backend` parameter: query, form or JSON parameters."""
    return await sage.submit(request, owner, settings, store, None)


@router.get("/api/{backend}-submit", responses=SUBMIT_REPLY)
@router.post("/api/{backend}-submit", responses=SUBMIT_REPLY)
async def submit_to(request: Request, backend: str, owner: Owner, settings: SettingsDep,
                    store: StoreDep) -> Response:
    return await sage.submit(request, owner, settings, store, backend)


@router.get("/api/status", responses=STATUS_REPLY)
@router.post("/api/status", responses=STATUS_REPLY)
async def status(request: Request, owner: Owner, settings: SettingsDep,
                 polls: PollsDep) -> Response:
    """A task's state (`task_id` or `taskid`), and its result once SUCCEEDED."""
    return await sage.status(request, owner, settings, polls)


@router.get("/api/{backend}-status", responses=STATUS_REPLY)
@router.post("/api/{backend}-status", responses=STATUS_REPLY)
async def status_of(request: Request, backend: str, owner: Owner, settings: SettingsDep,
                    polls: PollsDep) -> Response:
    del backend  # ids are unique across backends
    return await sage.status(request, owner, settings, polls)


#: the GET status routes' paths (`/api/status`, `/api/{backend}-status`)
def is_status_poll(scope: Scope) -> bool:
    """A GET of a status route without a body: what `answer_status` answers (one with a body,
    its params maybe in it, goes the routes' way, through the body limits)."""
    return (scope["type"] == "http" and scope["method"] == "GET"
            and is_status_path(scope["path"])
            and not any(name in _BODY_HEADERS and value not in (b"0", b"")
                        for name, value in scope["headers"]))


_BODY_HEADERS = frozenset({b"content-length", b"transfer-encoding"})


async def answer_status(state: State, scope: Scope, receive: Receive, send: Send) -> None:
    """The GET status poll, Sage's most frequent request, answered before FastAPI's
    middleware, router and dependency machinery (gateway.app.Gateway; they cost a poll more
    than its Redis call): the same serving function, the same key check (`auth.caller`) and
    the same HTTP 200 refusals as the routes above, which still serve POST and document
    both. It takes no GET with a body (`is_status_poll`), so no body limit is skipped."""
    request = Request(scope, receive)
    response: Response
    try:
        owner = caller(request, state.settings)
        response = await sage.status(request, owner, state.settings, state.polls)
    except RequestError as exc:
        response = JSONResponse(sage_body(exc))  # HTTP 200: see errors.SAGE_STATUS_ROUTES
    except Exception as exc:  # what the app's handler would answer (logged; HTTP 200 FAILED)
        response = await unexpected(request, exc)
    await response(scope, receive, send)
