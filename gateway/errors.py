"""One error path: every refusal is a `RequestError`, raised wherever it is found, and the
app's one exception handler renders it in the caller's dialect.

- OpenAI / REST (`/v1/*`): `{"error": {"message", "type", "param", "code"}}` with the
  refusal's HTTP status, built only by `openai_body`.
- Sage (`/api/*` and every other path): `{"status": "FAILED", "error": message}` with the
  refusal's HTTP status, built only by `sage_body` — except a Sage *status* poll, which is
  always HTTP 200 (see `SAGE_STATUS_ROUTES`), and a Sage *submit*, which is HTTP 200 with a
  task that is FAILED from the start (see `SAGE_SUBMIT_ROUTES`).

FastAPI's own validation errors are 400s, its HTTP errors (404 unknown path, 405) and any
unexpected exception (500) take the same path.
"""

from __future__ import annotations

import logging
import re
import secrets
from enum import StrEnum
from typing import Any, Literal
from urllib.parse import parse_qs

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException
from starlette.types import Scope

from common.store import StoreError
from common.store.connection import error_code, store_refused
from common.store.refusals import Refusals

log = logging.getLogger("gateway")

#: Sage polls a status until it reads SUCCEEDED, FAILED or UNKNOWN and takes any other HTTP
#: status for a transport error to retry: a refused poll (bad key, body or value) is
#: therefore HTTP 200 with `"status": "FAILED"`, so Sage stops.
SAGE_STATUS_ROUTES = frozenset({"/api/status", "/api/{backend}-status"})
#: their paths, for what is answered before routing (gateway/process/limits.py's refusals)
_STATUS_PATH = re.compile(r"/api/(?:[^/]+-)?status")


def is_status_path(path: str) -> bool:
    """A Sage status route's path (SAGE_STATUS_ROUTES), routed or not."""
    return _STATUS_PATH.fullmatch(path) is not None
#: Sage's client raises on any non-2xx submit and never reads its body, so its user would see
#: only "ERROR:400". A Sage submit that asks for it (REFUSAL_PARAM=task in its URL, as
#: deploy/sage/llm_api_map.csv does) is therefore answered HTTP 200 when refused, with a task
#: FAILED from the start: its `taskid` is a refusal id (REFUSAL_ID), which the status routes
#: answer FAILED with the same reason. Nothing is enqueued and no task is written; the reason
#: is kept for the retention under the id's random part (common/store/refusals.py, best
#: effort: while Redis is down the poll says what the id itself holds, the HTTP status and
#: code). `http_status` and `code` say what the call would have answered otherwise. Without
#: the parameter, and on the REST and OpenAI routes, a refusal keeps its 4xx/5xx.
SAGE_SUBMIT_ROUTES = frozenset({"/api/submit", "/api/{backend}-submit"})
REFUSAL_PARAM = "refusal"
#: no task id has a "." (they are URL-safe base64), so a refusal id is never a task's
REFUSED_PREFIX = "refused."
#: a refusal id: REFUSED_PREFIX, the HTTP status the refusal would have had, its code and a
#: random token (at most 61 characters: SPEC's ids are at most 64)
REFUSAL_ID = re.compile(r"refused\.([45]\d\d)\.([a-z_]{1,32})\.([A-Za-z0-9_-]{16})")
_CODE = re.compile(r"[a-z_]{1,32}")
#: `Retry-After` of a 503 while the task store is unreachable: a Sentinel failover takes a
#: few seconds, and a client that comes back sooner only gets another 503
STORE_RETRY_AFTER_SECONDS = 1
#: what a status poll says while the task store is unreachable (HTTP 200, PENDING)
STORE_NOTE = "the task store is briefly unavailable; keep polling"


class ErrorType(StrEnum):
    """OpenAI's error `type`s that this API uses."""

    INVALID_REQUEST = "invalid_request_error"
    AUTHENTICATION = "authentication_error"
    SERVER = "server_error"
    TIMEOUT = "timeout"


class RequestError(Exception):
    """A request we refuse, rendered by the app's handler in the caller's dialect.

    `code` is a stable machine-readable reason (`model_not_found`, `overloaded`, or a task's
    `common.schemas.ErrorCode` value); `extra` adds top-level fields to the body in either
    dialect (the 504's `task_id`, a quota refusal's `resets_at`): plain values only."""

    def __init__(self, status_code: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None, *,
                 type: ErrorType | None = None, extra: dict[str, Any] | None = None) -> None:
        # a message may quote what the client sent: keep it encodable whatever that was
        message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.headers = headers
        self.extra = extra or {}
        if type is None:
            type = (ErrorType.AUTHENTICATION if status_code == 401 else
                    ErrorType.INVALID_REQUEST if status_code < 500 else ErrorType.SERVER)
        self.type = type


# --- the bodies, each built in one place -----------------------------------------------------

class ErrorDetail(BaseModel):
    message: str = Field(description="What was wrong, for a person")
    type: ErrorType
    param: str | None = Field(None, description="The request parameter at fault, if any")
    code: str | None = Field(None, description="A stable reason: model_not_found, "
                                               "overloaded, task_timeout, invalid_audio …")


class ErrorResponse(BaseModel):
    """Every error of the `/v1/` routes (OpenAI's shape)."""

    error: ErrorDetail


class TimeoutErrorResponse(ErrorResponse):
    """The 504 of a call whose task is still running: poll `GET /v1/tasks/{task_id}`."""

    task_id: str


class SageError(BaseModel):
    """Every error of the Sage routes (`/api/*`)."""

    status: Literal["FAILED"] = "FAILED"
    error: str


def openai_error(exc: RequestError) -> dict[str, Any]:
    """The OpenAI error object (also what an SSE `error` event carries)."""
    return ErrorDetail(message=exc.message, type=exc.type, param=exc.param,
                       code=exc.code).model_dump(mode="json")


def openai_body(exc: RequestError) -> dict[str, Any]:
    return {"error": openai_error(exc), **exc.extra}


def sage_body(exc: RequestError) -> dict[str, Any]:
    return {**SageError(error=exc.message).model_dump(), **exc.extra}


def store_unavailable(exc: Exception, headers: dict[str, str] | None = None) -> RequestError:
    """The refusal of a call that needed the task store: a 503 with `Retry-After` while the
    store is unreachable (Redis down, failing over, or no replica confirming the write); a
    500 `store_error` when it answered with an error no retry cures (an ACL's NOPERM, a key of
    another application's type, a command this Redis lacks): the operator's to fix, so no
    client is told to come back in a second, forever."""
    if store_refused(exc):
        log.error("the task store refused a command: %s: %s", type(exc).__name__, exc)
        return RequestError(500, f"the task store refused the command ({error_code(exc)})"
                                 "; the gateway's log has the details", code="store_error")
    return RequestError(503, f"the task store is unavailable ({type(exc).__name__})",
                        code="store_unavailable",
                        headers={"Retry-After": str(STORE_RETRY_AFTER_SECONDS), **(headers or {})})


def sage_store_reply(task_id: str, exc: Exception) -> dict[str, Any]:
    """A Sage status poll's reply when the store failed it: PENDING with a note while the
    store is out of reach (Sage fails a task for good on anything else), FAILED
    `store_error` when it refuses for good (polling on would never end)."""
    if store_refused(exc):
        refused = store_unavailable(exc)
        return {"task_id": task_id, "taskid": task_id, "status": "FAILED",
                "error": refused.message, "code": refused.code}
    return {"task_id": task_id, "taskid": task_id, "status": "PENDING", "detail": STORE_NOTE}


# --- the handler ------------------------------------------------------------------------------

def install(app: FastAPI) -> None:
    app.add_exception_handler(RequestError, refused)  # type: ignore[arg-type]
    app.add_exception_handler(StoreError, store_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, invalid)  # type: ignore[arg-type]
    app.add_exception_handler(HTTPException, http_error)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, unexpected)


async def refused(request: Request, exc: RequestError) -> JSONResponse:
    """The one handler of a refusal, raised by a route, a dependency or the input readers."""
    route = getattr(request.scope.get("route"), "path", None)
    if route in SAGE_STATUS_ROUTES:
        return JSONResponse(sage_body(exc))  # HTTP 200 for Sage: see SAGE_STATUS_ROUTES
    if route in SAGE_SUBMIT_ROUTES and _wants_task(request.scope):
        # HTTP 200 for Sage: see SAGE_SUBMIT_ROUTES
        from gateway.auth import owner_or_none  # (gateway.auth raises this module's errors)

        settings = getattr(request.app.state, "settings", None)
        owner = None if settings is None else owner_or_none(request, settings)
        return JSONResponse(await sage_refused(exc, refusals_of(request.app), owner))
    return reply(request, exc)


def refusals_of(app: Any) -> Refusals | None:
    """Where the app keeps refusals' reasons (None before its lifespan has started)."""
    return getattr(getattr(app, "state", None), "refusals", None)


async def sage_refused(exc: RequestError, refusals: Refusals | None,
                       owner: str | None) -> dict[str, Any]:
    """A refused Sage submit as a task FAILED from the start (SAGE_SUBMIT_ROUTES): a new
    refusal id, its reason kept in `refusals` (a bounded number per `owner`) unless the
    caller is not known (`owner` None, or a 401): a client without a key writes nothing to
    Redis (a scanner's loop would fill it), and its id's poll answers from the status and
    code the id carries."""
    code = exc.code if _CODE.fullmatch(exc.code or "") else "refused"
    status = exc.status_code if 400 <= exc.status_code <= 599 else 400
    token = secrets.token_urlsafe(12)
    task_id = f"{REFUSED_PREFIX}{status}.{code}.{token}"
    if refusals is not None and owner is not None and status != 401:
        await refusals.remember(token, exc.message, owner)
    retry = (exc.headers or {}).get("retry-after")
    return {"task_id": task_id, "taskid": task_id, **sage_body(exc), "code": exc.code,
            "http_status": exc.status_code, **({"retry_after": retry} if retry else {})}


async def refusal_of(task_id: str, refusals: Refusals | None) -> dict[str, Any] | None:
    """The status reply of a refusal id (`sage_refused`); None for any other id."""
    found = REFUSAL_ID.fullmatch(task_id)
    if found is None:
        return None
    status, code, token = found.groups()
    error = await refusals.recall(token) if refusals is not None else None
    if error is None:  # not kept (no key, refused before routing), expired, Redis down
        error = f"the submit was refused ({code}, HTTP {status}); its reason is not kept"
    return {"task_id": task_id, "taskid": task_id, "status": "FAILED", "error": error,
            "code": code, "http_status": int(status)}


def _wants_task(scope: Scope) -> bool:
    """A Sage submit's URL asks for refusals as FAILED tasks (SAGE_SUBMIT_ROUTES)."""
    path = scope["path"]
    name = path.removeprefix("/api/")
    if name == path or "/" in name or not (name == "submit" or name.endswith("-submit")):
        return False
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"))
    return query.get(REFUSAL_PARAM) == ["task"]
async def store_error(request: Request, exc: StoreError) -> JSONResponse:
    """A store call no route guarded: the same refusal as a guarded one (store_unavailable),
    not an internal error; on a Sage status poll HTTP 200, PENDING with a note while the store
    is unreachable (Sage fails a task for good on anything else), FAILED when it refuses."""
    if getattr(request.scope.get("route"), "path", None) in SAGE_STATUS_ROUTES:
        task_id = request.query_params.get("task_id") or request.query_params.get("taskid", "")
        return JSONResponse(sage_store_reply(task_id, exc))
    return await refused(request, store_unavailable(exc))


async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
    return await refused(request, RequestError(400, "invalid request: " + "; ".join(
        f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())))


async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Routing's own refusals (an unknown path, a wrong method) and the static files'."""
    return reply(request, RequestError(exc.status_code, str(exc.detail)))


async def unexpected(request: Request, exc: Exception) -> JSONResponse:
    log.exception("unhandled error on %s", request.url.path)
    error = RequestError(500, f"internal error ({type(exc).__name__})")
    if is_status_path(request.url.path):  # still HTTP 200: see SAGE_STATUS_ROUTES
        return JSONResponse(sage_body(error))
    return reply(request, error)


def reply(request: Request, exc: RequestError) -> JSONResponse:
    body = openai_body(exc) if is_openai(request.url.path) else sage_body(exc)
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def is_openai(path: str) -> bool:
    return path.startswith("/v1/")


async def refusal_reply(scope: Scope, status_code: int, message: str,
                        code: str) -> tuple[int, dict[str, Any]]:
    """A request body the size and time limits refused (common/body_limit.py answers it
    outside the app, before routing): (HTTP status, body) in the caller's dialect."""
    exc = RequestError(status_code, message, param="file", code=code)
    if is_openai(scope["path"]):
        return status_code, openai_body(exc)
    if is_status_path(scope["path"]):  # still HTTP 200: see SAGE_STATUS_ROUTES
        return 200, sage_body(exc)
    if _wants_task(scope):  # before routing, so before the key's check: nothing kept
        return 200, await sage_refused(exc, refusals_of(scope.get("app")), None)
    return status_code, sage_body(exc)


# --- what routes declare, so /docs shows it ------------------------------------------------------

_WHY = {
    400: "A parameter, the body or the audio is invalid (`param` names the parameter)",
    401: "Missing or invalid API key",
    403: "The key may not make this call (an operator's call needs an `admin` key)",
    404: "Unknown model, backend or task",
    409: "Conflicting state: an expired idempotency key, a cancelled or running task",
    413: "The upload, or the audio's duration, is over the limit",
    426: "A WebSocket endpoint: connect with `Upgrade: websocket`",
    429: "Admission refused it: the backend's queue is full (`queue_full`), the deadline "
         "cannot be met (`deadline_unreachable`) or the key's quota is spent "
         "(`quota_exceeded`, with `resets_at`); `Retry-After` says when to try again",
    500: "The task failed in its engine, or the gateway failed",
    503: "The task store or the model is unavailable, or too many calls are waiting "
         "(`Retry-After`)",
    504: "The task did not finish within the request timeout; it goes on (`x-task-id`)",
}


def openai_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` of a `/v1/` route: each status it may answer, with the error model."""
    return {status: {"model": TimeoutErrorResponse if status == 504 else ErrorResponse,
                     "description": _WHY[status]} for status in statuses}


def sage_errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """`responses=` of a Sage route."""
    return {status: {"model": SageError, "description": _WHY[status]} for status in statuses}
