"""Values as Redis hands them back, as we store free text, and Redis's clock in Lua."""

from __future__ import annotations


def text(value: bytes | str) -> str:
    """A reply value as str (clients without decode_responses give bytes)."""
    return value.decode() if isinstance(value, bytes) else value


def one_line(message: str) -> str:
    """An error message as stored: one line, at most 1000 characters."""
    return " ".join(message.split())[:1000]


# Redis's clock, read once per script: every host's expiries (heartbeats, live sets,
# breakers, device reservations) agree on it, whatever the hosts' own clocks say.
_LUA_TIME = "local t = redis.call('TIME')\n"
#: Lua: `now`, Redis's clock in milliseconds (an integer)
LUA_NOW_MS = _LUA_TIME + "local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)\n"
#: Lua: `now`, Redis's clock in seconds (with microseconds)
LUA_NOW_S = _LUA_TIME + "local now = tonumber(t[1]) + tonumber(t[2]) / 1000000\n"
