"""Rendering a refused request in each client's dialect."""

from __future__ import annotations

from fastapi.responses import JSONResponse

from gateway.inputs import RequestError


def sage_error(exc: RequestError) -> JSONResponse:
    return JSONResponse({"status": "FAILED", "error": exc.message}, status_code=exc.status_code,
                        headers=exc.headers)


def openai_error(exc: RequestError) -> JSONResponse:
    kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
    if exc.status_code == 401:
        kind = "authentication_error"
    body = {"error": {"message": exc.message, "type": kind, "param": exc.param,
                      "code": exc.code}}
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)
