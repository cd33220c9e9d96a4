"""`GET /v1/usage`: the caller's own usage and quotas (issue 18)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from gateway.auth import Owner
from gateway.dependencies import SettingsDep, StoreDep
from gateway.errors import openai_errors
from gateway.protocol import UsageReport
from gateway.serving.usage import usage_report

router = APIRouter(tags=["Usage"])


@router.get("/v1/usage", responses={200: {"model": UsageReport}, **openai_errors(401, 503)})
async def usage(owner: Owner, settings: SettingsDep, store: StoreDep) -> JSONResponse:
    """Your key's usage this UTC day and month (audio-seconds, characters; in total and per
    backend), its quotas, what remains and when each resets. With API keys off: the usage of
    every caller, with no quotas."""
    report = await usage_report(settings, store, owner)
    return JSONResponse(report.model_dump(mode="json"))
