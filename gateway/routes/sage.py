"""Sage llmage endpoints: submit, then poll (gateway/serving/sage.py). Every status reply is
HTTP 200 JSON with `status`."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from gateway.auth import Owner
from gateway.dependencies import SettingsDep, StoreDep
from gateway.errors import sage_errors
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
                 store: StoreDep) -> Response:
    """A task's state (`task_id` or `taskid`), and its result once SUCCEEDED."""
    return await sage.status(request, owner, settings, store)


@router.get("/api/{backend}-status", responses=STATUS_REPLY)
@router.post("/api/{backend}-status", responses=STATUS_REPLY)
async def status_of(request: Request, backend: str, owner: Owner, settings: SettingsDep,
                    store: StoreDep) -> Response:
    del backend  # ids are unique across backends
    return await sage.status(request, owner, settings, store)
