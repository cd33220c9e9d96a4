"""What any submit may ask besides its work: an idempotency key, a lane, a deadline, a
webhook (`SubmitTerms`), read and checked before any audio is fetched."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi import Request

from common.schemas import BATCH, LANES
from common.settings import Settings
from gateway.errors import RequestError
from gateway.policy.admission import deadline_of
from gateway.policy.webhooks import callback_url
from gateway.submit.inputs import Params

MAX_IDEMPOTENCY_KEY = 255


def idempotency_key(request: Request, params: Params) -> str:
    """The caller's `Idempotency-Key` header (or `idempotency_key` param); "" when absent."""
    key = request.headers.get("idempotency-key") or params.get("idempotency_key") or ""
    if len(key) > MAX_IDEMPOTENCY_KEY or not key.isprintable():
        raise RequestError(400, f"the idempotency key must be at most {MAX_IDEMPOTENCY_KEY} "
                                "printable characters", param="idempotency_key")
    return key


def priority(params: Params, default: str) -> str:
    """The `priority` param (interactive | batch), `default` when absent."""
    value = (params.get("priority") or default).strip().lower()
    if value not in LANES:
        raise RequestError(400, "priority must be 'interactive' or 'batch'", param="priority")
    return value


def default_lane(settings: Settings, owner: str, route_default: str) -> str:
    """The lane of a submit that names no `priority`: its key's default, else the route's."""
    key = settings.api_key(owner)
    return key.priority if key is not None and key.priority else route_default


@dataclass(frozen=True, slots=True)
class SubmitTerms:
    """What any submit may ask besides its work: an idempotency key, a lane, a deadline, a
    webhook."""

    idempotency_key: str = ""
    lane: str = BATCH
    deadline: float | None = None  # epoch seconds
    deadline_param: str = "deadline"  # the parameter that set it (its refusal names it)
    callback_url: str = ""  # checked against SPEECH_CALLBACK_URL_HOSTS
    #: a live session's turn: bounded by the session's own limits (sessions per key, audio
    #: speed, pending turns), not by the key's submits a minute
    live: bool = False

    @classmethod
    def of(cls, request: Request, params: Params, default_lane: str,
           settings: Settings) -> SubmitTerms:
        key = idempotency_key(request, params)
        # a repeat of a submit whose deadline has passed since gets its task, not a 400: with
        # a key, a past deadline is refused after the key is looked up (submit/enqueue.py)
        return cls(key, priority(params, default_lane),
                   deadline_of(params.get("deadline"), params.get("max_wait_seconds"),
                               past_ok=bool(key)),
                   "deadline" if params.get("deadline") else "max_wait_seconds",
                   callback_url(params.get("callback_url"), settings))


#: a submit that asks for nothing besides its work
NO_TERMS = SubmitTerms()
