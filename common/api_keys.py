"""API keys as `SPEECH_API_KEYS` configures them: each key's digest, name, lane, caps,
webhook secrets and quotas (common/settings.py holds the list)."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator

from common.schemas import Lane
from common.webhook_keys import check_webhook_secrets

#: what usage is metered in (a backend's kind says which: common/backends.py) and the periods
#: a quota may cover (UTC days and months)
USAGE_UNITS = ("audio_seconds", "characters")
QUOTA_PERIODS = ("day", "month")
MAX_QUOTA = 1e12  # any quota, in any unit (~30,000 years of audio)
_DIGEST = re.compile(r"[0-9a-f]{64}")
_KEY_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


class Quotas(BaseModel):
    """The most usage per UTC day and month, in the units users pay for; None: no limit."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # finite and at most MAX_QUOTA: the submit script compares them as Lua numbers, which
    # read "inf" as nothing, and a huge int is no float at all (no limit: leave it out)
    audio_seconds_per_day: float | None = Field(default=None, ge=0, le=MAX_QUOTA,
                                                allow_inf_nan=False)
    audio_seconds_per_month: float | None = Field(default=None, ge=0, le=MAX_QUOTA,
                                                  allow_inf_nan=False)
    characters_per_day: int | None = Field(default=None, ge=0, le=MAX_QUOTA)
    characters_per_month: int | None = Field(default=None, ge=0, le=MAX_QUOTA)

    def limit(self, unit: str, period: str) -> float | None:
        value = getattr(self, f"{unit}_per_{period}")
        return None if value is None else float(value)


class KeyQuotas(Quotas):
    """A key's quotas over all backends, and per backend (both apply)."""

    backends: dict[str, Quotas] = Field(default_factory=dict)


class ApiKey(BaseModel):
    """One `SPEECH_API_KEYS` entry: a plain "sha256:<hex>" string, or this object."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: the key's SHA-256 digest, "sha256:<64 hex>" (`python -m gateway.auth KEY` prints it)
    key: str
    #: its label on /metrics and /v1/usage (default: its owner id, 16 hex of the digest)
    name: str = ""
    #: the lane of its submits that name no `priority`; "interactive" also allows that lane
    priority: Lane | None = None
    #: whether its work may take the interactive lane (else all of it is queued as batch,
    #: also live turns and an explicit `priority=interactive`)
    interactive: bool = False
    #: whether it may make operator calls (`DELETE /v1/breakers/…`): a tenant's key may not
    #: close a breaker that protects every other tenant's workers from a broken model
    admin: bool = False
    #: its most tasks queued or running at once (None: `max_in_flight_per_key`; 0: no limit)
    max_in_flight: int | None = Field(default=None, ge=0)
    #: its most entries waiting in one lane of a backend, the rest in its own line (None:
    #: `queued_per_key`; 0: no limit; docs/fairness.md)
    max_queued: int | None = Field(default=None, ge=0)
    #: key id -> "whsec_<base64>": its tasks' webhooks are signed with these instead of
    #: `webhook_secrets` (a tenant verifies only its own)
    webhook_secrets: dict[str, str] = Field(default_factory=dict)
    quotas: KeyQuotas = Field(default_factory=KeyQuotas)

    @property
    def may_use_interactive(self) -> bool:
        return self.interactive or self.priority == "interactive"

    @field_validator("key")
    @classmethod
    def _check_key(cls, key: str) -> str:
        hex_digest = key.strip().removeprefix("sha256:").lower()
        if not _DIGEST.fullmatch(hex_digest):
            raise ValueError("an API key entry must be a SHA-256 digest, 'sha256:' and 64 hex "
                             "characters (python -m gateway.auth KEY prints it)")
        return "sha256:" + hex_digest

    @field_validator("webhook_secrets")
    @classmethod
    def _check_secrets(cls, secrets: dict[str, str]) -> dict[str, str]:
        return check_webhook_secrets(secrets)

    @field_validator("name")
    @classmethod
    def _check_name(cls, name: str) -> str:
        if name and not _KEY_NAME.fullmatch(name):
            raise ValueError(f"key name {name!r}: 1 to 64 letters, digits, '_', '.' or '-'")
        return name

    @property
    def digest(self) -> str:
        return self.key.removeprefix("sha256:")

    @property
    def owner(self) -> str:
        """The owner id its tasks and usage are recorded under."""
        return self.digest[:16]

    @property
    def label(self) -> str:
        return self.name or self.owner
