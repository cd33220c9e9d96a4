"""`GET /v1/usage`: the caller's own usage in the current UTC day and month, per unit, in
total and per backend, with its key's quotas (gateway/policy/quotas.py charges it)."""

from __future__ import annotations

from common.api_keys import USAGE_UNITS, KeyQuotas
from common.settings import Settings
from common.store import TaskStore
from gateway.protocol import UnitUsage, UsageAmount, UsagePeriod, UsageReport
from gateway.submit.enqueue import guard_store


async def usage_report(settings: Settings, store: TaskStore, owner: str) -> UsageReport:
    key = settings.api_key(owner)
    quotas = key.quotas if key is not None else None
    periods: dict[str, UsagePeriod] = {}
    for seen in await guard_store(store.usage.periods(owner)):
        name = seen.period.name
        units = {unit: _unit(unit, name, seen.used, quotas) for unit in USAGE_UNITS}
        periods[name] = UsagePeriod(period=seen.period.label, resets_at=seen.period.resets_at,
                                    **units)
    return UsageReport(key=key.label if key is not None else None, **periods)


def _unit(unit: str, period: str, used: dict[str, float], quotas: KeyQuotas | None) -> UnitUsage:
    backends = {field.partition(":")[2] for field in used if field.startswith(f"{unit}:")}
    if quotas is not None:
        backends |= {name for name, limits in quotas.backends.items()
                     if limits.limit(unit, period) is not None}
    per_backend = {}
    for backend in sorted(backends):
        limits = quotas.backends.get(backend) if quotas is not None else None
        per_backend[backend] = _amount(used.get(f"{unit}:{backend}", 0.0),
                                       limits.limit(unit, period) if limits else None)
    total = _amount(used.get(unit, 0.0), quotas.limit(unit, period) if quotas else None)
    return UnitUsage(**total.model_dump(), backends=per_backend)


def _amount(used: float, limit: float | None) -> UsageAmount:
    used = round(used, 3)
    return UsageAmount(used=used, limit=limit,
                       remaining=None if limit is None else round(max(0.0, limit - used), 3))
