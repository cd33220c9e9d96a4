"""Values as Redis hands them back, as we store free text, and Redis's clock in Lua."""

from __future__ import annotations


def text(value: bytes | str) -> str:
    """A reply value as str (clients without decode_responses give bytes)."""
    return value.decode() if isinstance(value, bytes) else value


def one_line(message: str) -> str:
    """An error message as stored: one line, at most 1000 characters."""
    return " ".join(message.split())[:1000]


#: Lua: `now`, Redis's clock in ms: every host's expiries (heartbeats, live sets) agree on it
LUA_NOW_MS = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
"""
