"""What XTTS can speak: its pieces (sentences) and the numbers in them, one rule shared by the
engine (which speaks the pieces) and the gateway (which refuses at submit a text the engine
would fail on half-way, after the first sentences were streamed and charged).

XTTS spells numbers out before tokenizing (coqui-tts `expand_numbers_multilingual`, through
num2words): past num2words' largest number for the language (10^20 in Turkish, 10^27 in
Spanish) it raises OverflowError (in Hindi, NotImplementedError for any number), and a
spelled-out number takes up to ~15 characters per digit,
so a sentence with many digits passes the GPT's 400 text tokens and fails an assertion.
"""

from __future__ import annotations

import re
import textwrap

_CJK_STOPS = "\u3002\uff01\uff1f\uff1b"  # ideographic full stop, fullwidth ! ? ;
_SENTENCE_END = re.compile(rf"(?<=[.!?;\u2026])\s+|(?<=[{_CJK_STOPS}])")
#: digits joined by separators: XTTS drops "," (en, ru) or "." (others) inside a number first,
#: so "1,000,000" is one seven-digit number to it
_NUMBER = re.compile(r"[0-9](?:[0-9,.]*[0-9])?")  # XTTS spells out ASCII digits only
#: XTTS's per-language sentence limits (coqui-tts VoiceBpeTokenizer.char_limits)
CHAR_LIMITS = {"en": 250, "de": 253, "fr": 273, "es": 239, "it": 213, "pt": 203, "pl": 224,
               "zh": 82, "ar": 166, "cs": 186, "ru": 182, "nl": 251, "tr": 226, "ja": 71,
               "hu": 224, "ko": 95, "hi": 150}
#: the longest number (in digits) spoken in every language num2words knows
MAX_NUMBER_DIGITS = 15
#: characters one spelled-out digit takes at most (num2words 0.5.14: 15.2 in Polish)
CHARS_PER_DIGIT = 16
#: languages whose numbers num2words cannot spell at all (NotImplementedError in XTTS)
NO_NUMBERS = frozenset({"hi"})
#: a piece's length once its numbers are spelled out, kept under XTTS's 400 text tokens (its
#: BPE averages well over 2.5 characters a token on spelled-out numbers)
MAX_EXPANDED_CHARACTERS = 1000


def char_limit(language: str) -> int:
    return CHAR_LIMITS.get(language.split("-")[0], 250)


def split_sentences(text: str, limit: int) -> list[str]:
    """The text's sentences, one piece each (what a streamed task sends as it is spoken); a
    sentence longer than `limit` characters (XTTS's GPT reads at most ~400 tokens) is cut at
    word boundaries. A pure function of the text: a resumed task skips the pieces it has."""
    return [piece for sentence in _SENTENCE_END.split(" ".join(text.split()))
            for piece in textwrap.wrap(sentence, limit, break_on_hyphens=False)]


def unspeakable(text: str, language: str) -> str | None:
    """Why XTTS cannot speak `text` in `language` (None: it can)."""
    for piece in split_sentences(text, char_limit(language)):
        numbers = [sum(ch in "0123456789" for ch in found) for found in _NUMBER.findall(piece)]
        if numbers and language.split("-")[0] in NO_NUMBERS:
            return (f"XTTS cannot spell out numbers in {language!r}: write them in words")
        if numbers and max(numbers) > MAX_NUMBER_DIGITS:
            return (f"the text holds a {max(numbers)}-digit number; XTTS speaks numbers of at "
                    f"most {MAX_NUMBER_DIGITS} digits (write it in words or split it)")
        digits = sum(numbers)
        if len(piece) - digits + digits * CHARS_PER_DIGIT > MAX_EXPANDED_CHARACTERS:
            return (f"a sentence holds {digits} digits, too many to spell out in one XTTS "
                    f"sentence (at most {MAX_EXPANDED_CHARACTERS} characters once spelled "
                    f"out): split it into shorter sentences")
    return None
