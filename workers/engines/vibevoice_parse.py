"""VibeVoice-ASR answers -> segments (pure Python: unit-tested without torch).

The model answers a JSON array, `[{"Start":0.0,"End":7.56,"Speaker":0,"Content":"..."}, ...]`,
after a role word ("assistant") that decoding leaves in. Generation cut off by the token
limit leaves a truncated tail: the complete objects before it are kept.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from common.schemas import Segment


class ParseError(ValueError):
    """The answer holds no JSON array of segments."""


_ARRAY_START = re.compile(r"\[\s*[{\]]")
_SEPARATORS = " \t\r\n,"
# Non-speech tags the model writes as or before a segment's content: "[Music]", "[Silence]" ...
_TAG = re.compile(r"^\s*\[[A-Za-z][\w \-]*\]\s*")
_KEYS = {
    "start": ("start", "start time", "start_time", "begin"),
    "end": ("end", "end time", "end_time"),
    "speaker": ("speaker", "speaker id", "speaker_id"),
    "text": ("content", "text", "transcription"),
}


def _items(text: str) -> list[Any]:
    match = _ARRAY_START.search(text)
    if match is None:
        raise ParseError(f"no JSON array of segments in the answer: {text[:80]!r}")
    decoder = json.JSONDecoder()
    try:
        items, _ = decoder.raw_decode(text, match.start())
        return list(items)
    except json.JSONDecodeError:
        pass
    # Truncated: keep every complete element before the cut.
    items = []
    pos = _skip_separators(text, match.start() + 1)
    while pos < len(text) and text[pos] != "]":
        try:
            item, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            break
        items.append(item)
        pos = _skip_separators(text, pos)
    return items


def _skip_separators(text: str, pos: int) -> int:
    while pos < len(text) and text[pos] in _SEPARATORS:
        pos += 1
    return pos


def _field(item: dict[str, Any], name: str) -> Any:
    lowered = {str(key).strip().lower(): value for key, value in item.items()}
    return next((lowered[key] for key in _KEYS[name] if key in lowered), None)


def _seconds(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        return None
    return seconds if math.isfinite(seconds) else None


def _speaker(value: Any) -> str | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return str(value).strip()


def clean_content(content: Any) -> str:
    """The spoken text, without leading non-speech tags ("[Music] la la" -> "la la")."""
    text = "" if content is None else str(content).strip()
    while (match := _TAG.match(text)) is not None:
        text = text[match.end():]
    return text.strip()


def parse_segments(raw: str, duration: float) -> list[Segment]:
    """Segments (ids from 0, times clamped to [0, duration]) from the decoded answer.

    An empty answer gives no segments; segments that hold only a non-speech tag are dropped.
    Raises ParseError when the answer is not a JSON array of segment objects.
    """
    text = raw.strip()
    if text.lower().startswith("assistant"):
        text = text[len("assistant"):].strip()
    if not clean_content(text):  # nothing, or only a tag such as "[Silence]"
        return []
    items = _items(text)
    objects = [item for item in items if isinstance(item, dict)]
    if items and all(_field(item, "text") is None for item in objects):
        raise ParseError(f"the answer's array holds no segment objects: {text[:80]!r}")
    segments: list[Segment] = []
    previous_end = 0.0
    for item in objects:
        content = clean_content(_field(item, "text"))
        start = _seconds(_field(item, "start"))
        end = _seconds(_field(item, "end"))
        start = min(max(previous_end if start is None else start, 0.0), duration)
        end = min(max(start if end is None else end, start), duration)
        previous_end = end
        if not content:
            continue
        segments.append(Segment(
            id=len(segments), start=round(start, 3), end=round(end, 3), text=content,
            speaker=_speaker(_field(item, "speaker")),
        ))
    return segments
