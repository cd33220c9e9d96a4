"""Operator calls: `DELETE /v1/breakers/{backend}/{model}` closes one model's breaker."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from common.store import BreakerPolicy
from gateway.app_errors import openai_error
from gateway.auth import caller
from gateway.inputs import RequestError
from gateway.state import settings_of, store_of
from gateway.submission import guard_store

router = APIRouter()


@router.delete("/v1/breakers/{backend}/{model}")
async def reset_breaker(request: Request, backend: str, model: str) -> JSONResponse:
    """Close the breaker now (the files were fixed): the next task loads the model."""
    settings, store = settings_of(request), store_of(request)
    try:
        caller(request)
        sources = settings.backend_models(backend)
        if model not in sources:
            raise RequestError(404, f"no model {model!r} is configured for backend {backend!r}",
                               param="model", code="model_not_found")
        before = await guard_store(store.breakers(backend, {model: sources[model]},
                                                  BreakerPolicy.of(settings)))
        await guard_store(store.clear_breaker(backend, model))
    except RequestError as exc:
        return openai_error(exc)
    return JSONResponse({"backend": backend, "model": model, "state": "closed",
                         "previous": before[model].public()})
