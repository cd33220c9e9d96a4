"""Values as Redis hands them back, as we store free text, and Redis's clock in Lua."""

from __future__ import annotations

import json
import math
from typing import Any


def text(value: bytes | str) -> str:
    """A reply value as str (clients without decode_responses give bytes)."""
    return value.decode() if isinstance(value, bytes) else value


def one_line(message: str) -> str:
    """An error message as stored: one line, at most 1000 characters."""
    return " ".join(message.split())[:1000]


def strict_json(value: Any) -> str:
    """`value` as JSON that every parser reads: a non-finite float (an engine's -inf
    log-probability, a NaN score) becomes null. json.dumps writes NaN and Infinity, which
    JSON lacks: a client's parser would refuse the whole reply, and Starlette's JSONResponse
    raise on it."""
    try:
        return json.dumps(value, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(value), allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


# Redis's clock, read once per script: every host's expiries (heartbeats, live sets,
# breakers, device reservations) agree on it, whatever the hosts' own clocks say.
_LUA_TIME = "local t = redis.call('TIME')\n"
#: Lua: `now`, Redis's clock in milliseconds (an integer)
LUA_NOW_MS = _LUA_TIME + "local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"
#: Lua: `now`, Redis's clock in seconds (with microseconds)
LUA_NOW_S = _LUA_TIME + "local now = tonumber(t[1]) + tonumber(t[2]) / 1000000\n"
