"""Values as Redis hands them back, and as we store free text."""

from __future__ import annotations


def text(value: bytes | str) -> str:
    """A reply value as str (clients without decode_responses give bytes)."""
    return value.decode() if isinstance(value, bytes) else value


def one_line(message: str) -> str:
    """An error message as stored: one line, at most 1000 characters."""
    return " ".join(message.split())[:1000]
