"""Quotas per API key (issue 18): what a submit costs its key, and the 429 past a quota.

A task costs the unit its backend's kind is metered in (common/backends.py `usage_unit`):
audio-seconds, the probed duration of its input, or characters of its text. The check and
the charge are one step inside the submit (common/store/usage.py); this module says what to
charge and how a refusal reads.
"""

from __future__ import annotations

from typing import Any

from common.catalog import kind_of
from common.settings import Settings
from common.store import Charge, QuotaExceeded
from gateway.errors import RequestError
from gateway.policy.admission import retry_after

UNIT_NAMES = {"audio_seconds": "audio-seconds", "characters": "characters"}


def charge_of(settings: Settings, owner: str, backend: str, options: dict[str, Any],
              audio_seconds: float) -> Charge:
    """What a task for `backend` with these options costs `owner`, under its key's quotas."""
    kind = kind_of(backend)
    unit = kind.usage_unit if kind is not None else "audio_seconds"
    amount = float(len(options.get("text") or "")) if unit == "characters" else audio_seconds
    key = settings.api_key(owner)
    return Charge(owner, backend, unit, amount, key.quotas if key is not None else None)


def quota_exceeded(refused: QuotaExceeded, now: float) -> RequestError:
    """The 429 of a submit past a quota: which quota, what is used, when it resets
    (`Retry-After` and `resets_at`)."""
    charge, period = refused.charge, refused.period
    unit = UNIT_NAMES.get(charge.unit, charge.unit)
    scope = f" on {refused.backend}" if refused.backend else ""
    resets_at = period.resets_at
    message = (f"quota exceeded: {refused.limit:g} {unit} per {period.name}{scope}; "
               f"{refused.used:.1f} used, this task needs {charge.amount:.1f}; the quota "
               f"resets at {resets_at}")
    if charge.amount > refused.limit:
        message += " (this task alone is larger than the whole quota)"
    quota = f"{charge.unit}_per_{period.name}" + (f":{refused.backend}" if refused.backend else "")
    return RequestError(429, message, code="quota_exceeded",
                        headers=retry_after(period.end.timestamp() - now),
                        extra={"resets_at": resets_at, "quota": quota})
