"""Qwen3-ASR language names and output clean-up (pure Python: unit-tested without torch).

The model answers `language <Name><asr_text><transcription>`; with a forced language the
prompt already ends with that prefix and the answer is the transcription alone.
"""

from __future__ import annotations

import re

from common.languages import LANGUAGE_NAMES as NAMES

# ISO code -> the name the model was trained with in its "language <Name>" prefix: the
# language's English name (common/languages.py), capitalised.
LANGUAGE_NAMES: dict[str, str] = {code: NAMES[code].title() for code in (
    "ar", "yue", "zh", "cs", "da", "nl", "en", "fil", "fi", "fr", "de", "el", "hi", "hu", "id",
    "it", "ja", "ko", "mk", "ms", "fa", "pl", "pt", "ro", "ru", "es", "sv", "th", "tr", "vi",
)}  # fmt: skip
_CODES_BY_NAME = {name.lower(): code for code, name in LANGUAGE_NAMES.items()}
_ALIASES = {"tl": "fil", "cmn": "zh", "zh-cn": "zh", "zh-tw": "zh", "pt-br": "pt"}

ASR_TEXT = "<asr_text>"
# A unit of 1-20 characters repeated 20 times or more in a row: a decoding loop, not speech.
_REPEATS = re.compile(r"(.{1,20}?)\1{19,}", re.DOTALL)
_LANGUAGE_PREFIX = re.compile(r"^language\b\s*", re.IGNORECASE)


def model_language(language: str | None) -> str | None:
    """The model's name for an ISO code or a language name; None means auto-detect."""
    if language is None or not language.strip() or language.strip().lower() == "auto":
        return None
    key = language.strip().lower()
    code = _ALIASES.get(key, key)
    if code in LANGUAGE_NAMES:
        return LANGUAGE_NAMES[code]
    if key in _CODES_BY_NAME:
        return LANGUAGE_NAMES[_CODES_BY_NAME[key]]
    supported = ", ".join(sorted(LANGUAGE_NAMES))
    raise ValueError(f"language {language!r} is not supported by qwen3 (supported: {supported})")


def language_code(name: str | None) -> str | None:
    """ISO code for a name the model printed ("English" -> "en"); unknown names lower-cased."""
    if not name or name.strip().lower() == "none":
        return None
    return _CODES_BY_NAME.get(name.strip().lower(), name.strip().lower())


def collapse_repeats(text: str) -> str:
    """Collapse runaway repetitions (a character or short pattern looping) to one occurrence."""
    return _REPEATS.sub(r"\1", text)


def parse_output(raw: str, forced_language: str | None) -> tuple[str | None, str]:
    """(language code, transcription) from the decoded answer (special tokens skipped)."""
    text = raw.strip()
    if forced_language is not None:
        # The prefix was in the prompt; a model that repeats it anyway still gets it removed.
        if ASR_TEXT in text:
            text = text.split(ASR_TEXT, 1)[1]
        return language_code(forced_language), collapse_repeats(text).strip()
    if ASR_TEXT not in text:
        return None, collapse_repeats(text).strip()
    prefix, text = text.split(ASR_TEXT, 1)
    first_line = next((line.strip() for line in prefix.splitlines() if line.strip()), "")
    name = _LANGUAGE_PREFIX.sub("", first_line)
    return language_code(name), collapse_repeats(text).strip()
