"""Word error rate, as the consent check (and the tests) score a transcript against a text."""

from __future__ import annotations

import re

#: typographic apostrophes (U+2019 and its kin), as ASR output may write them, read as "'"
_APOSTROPHES = str.maketrans({"\u2019": "'", "\u2018": "'", "\u02bc": "'"})


def normalise(text: str) -> list[str]:
    """Lower-case words, punctuation dropped (letters of every script kept)."""
    return re.sub(r"[^\w' ]+", " ", text.lower().translate(_APOSTROPHES)).split()


def wer(reference: str, hypothesis: str) -> float:
    """Word edits (substitutions, insertions, deletions) over the reference's word count."""
    ref, hyp = normalise(reference), normalise(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, ref_word in enumerate(ref, start=1):
        previous, row[0] = row[0], i
        for j, hyp_word in enumerate(hyp, start=1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1,
                                           previous + (ref_word != hyp_word))
    return row[-1] / max(1, len(ref))


#: words that turn a consent phrase into a refusal ("I do not consent …"), per base language;
#: word error alone lets them through (a negation is one or two inserted words)
NEGATIONS: dict[str, frozenset[str]] = {
    "en": frozenset({"not", "no", "never", "nor", "neither", "cannot", "refuse", "don't",
                     "dont", "won't", "wont", "can't", "cant", "doesn't", "didn't"}),
    "de": frozenset({"nicht", "kein", "keine", "keinen", "keinem", "keiner", "nie",
                     "niemals", "weder", "nein", "verweigere", "ablehne"}),
    "fr": frozenset({"ne", "pas", "jamais", "non", "aucun", "aucune", "ni", "refuse"}),
    "es": frozenset({"no", "nunca", "jamás", "jamas", "ni", "tampoco", "niego", "rechazo"}),
}


def negation(phrase: str, transcript: str, language: str) -> str | None:
    """A negating word the transcript holds and the phrase does not (for the base language
    of `language`; None for a language with no list, or none found)."""
    base = language.strip().lower().replace("_", "-").split("-", 1)[0]
    words = NEGATIONS.get(base)
    if words is None:
        return None
    allowed = set(normalise(phrase))

    def negating(word: str) -> bool:
        return (word in words or (base == "en" and word.endswith("n't"))
                or (base == "fr" and word.startswith("n'")))

    return next((word for word in normalise(transcript)
                 if negating(word) and word not in allowed), None)
