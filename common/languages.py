"""Language tables of the backends (the rows in common/backends.py name them).

Kept apart from the engines so the gateway can refuse a language before queueing without
importing an engine; standard library only, like the table.
"""

from __future__ import annotations

#: languages XTTS v2 speaks, as its config names them
XTTS_LANGUAGES: tuple[str, ...] = (
    "en", "es", "fr", "de", "it", "pt", "pl", "tr", "ru", "nl", "cs", "ar", "zh-cn", "hu",
    "ko", "ja", "hi",
)  # fmt: skip
#: Whisper's language codes (faster_whisper.tokenizer._LANGUAGE_CODES)
WHISPER_LANGUAGES: tuple[str, ...] = (
    "af", "am", "ar", "as", "az", "ba", "be", "bg", "bn", "bo", "br", "bs", "ca", "cs", "cy",
    "da", "de", "el", "en", "es", "et", "eu", "fa", "fi", "fo", "fr", "gl", "gu", "ha", "haw",
    "he", "hi", "hr", "ht", "hu", "hy", "id", "is", "it", "ja", "jw", "ka", "kk", "km", "kn",
    "ko", "la", "lb", "ln", "lo", "lt", "lv", "mg", "mi", "mk", "ml", "mn", "mr", "ms", "mt",
    "my", "ne", "nl", "nn", "no", "oc", "pa", "pl", "ps", "pt", "ro", "ru", "sa", "sd", "si",
    "sk", "sl", "sn", "so", "sq", "sr", "su", "sv", "sw", "ta", "te", "tg", "th", "tk", "tl",
    "tr", "tt", "uk", "ur", "uz", "vi", "yi", "yo", "zh", "yue",
)  # fmt: skip
#: Qwen3-ASR's languages (workers/engines/qwen3_text.py LANGUAGE_NAMES, and its aliases)
QWEN3_LANGUAGES: tuple[str, ...] = (
    "ar", "yue", "zh", "cs", "da", "nl", "en", "fil", "fi", "fr", "de", "el", "hi", "hu", "id",
    "it", "ja", "ko", "mk", "ms", "fa", "pl", "pt", "ro", "ru", "es", "sv", "th", "tr", "vi",
    "tl", "cmn", "zh-cn", "zh-tw", "pt-br",
)  # fmt: skip
