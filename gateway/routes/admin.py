"""Operator calls: `DELETE /v1/breakers/{backend}/{model}` closes one model's breaker."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from common.catalog import guarded
from common.store import BreakerPolicy
from gateway.auth import Owner
from gateway.dependencies import SettingsDep, StoreDep
from gateway.errors import RequestError, openai_errors
from gateway.protocol import BreakerReset
from gateway.submit.enqueue import guard_store

router = APIRouter(tags=["Operations"])


@router.delete("/v1/breakers/{backend}/{model}",
               responses={200: {"model": BreakerReset}, **openai_errors(401, 403, 404, 503)})
async def reset_breaker(backend: str, model: str, owner: Owner, settings: SettingsDep,
                        store: StoreDep) -> JSONResponse:
    """Close the breaker now (the files were fixed): the next task loads the model (or, for
    `diarizer`, the backend's diarizer). With keys on, an `admin` key's call only: a
    breaker reset in a loop keeps every worker of the backend loading a broken model."""
    key = settings.api_key(owner)
    if settings.api_keys and (key is None or not key.admin):
        raise RequestError(403, "resetting a breaker takes an operator's key (\"admin\": true "
                                "in its SPEECH_API_KEYS entry)", code="admin_key_required")
    sources = guarded(settings, backend)
    if model not in sources:
        raise RequestError(404, f"no model {model!r} is configured for backend {backend!r}",
                           param="model", code="model_not_found")
    before = await guard_store(store.breakers.read(backend, {model: sources[model]},
                                              BreakerPolicy.of(settings)))
    await guard_store(store.breakers.clear(backend, model))
    return JSONResponse({"backend": backend, "model": model, "state": "closed",
                         "previous": before[model].public()})
