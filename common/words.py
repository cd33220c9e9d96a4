"""Word error rate, as the consent check (and the tests) score a transcript against a text."""

from __future__ import annotations

import re


def normalise(text: str) -> list[str]:
    """Lower-case words, punctuation dropped (letters of every script kept)."""
    return re.sub(r"[^\w' ]+", " ", text.lower()).split()


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
