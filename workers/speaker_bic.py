"""A speaker cue beside the d-vector and the pitch: the timbre of the frames, by delta-BIC.

Two groups of windows are one voice when one full-covariance Gaussian over their cepstra
(MFCC 1-19 of each 10 ms frame) explains them about as well as two Gaussians, one per group,
given the Bayesian information criterion's price for the second one's parameters (Chen &
Gopalakrishnan, "Speaker, environment and channel change detection and clustering via the
Bayesian information criterion", 1998). Resemblyzer's encoder scores some pairs of espeak-ng
voice variants 0.92-0.96 alike at the same pitch; their spectral envelopes (formants, the
variant's timbre) still differ, and a Gaussian over thousands of frames sees it.

The statistic is the likelihood gain over the penalty (the BIC's lambda at which the two
groups would just be merged), so it does not grow with the groups' sizes as the gain does.
It still grows for one voice, slowly: one Gaussian is not quite the voice's distribution (what
is said differs between the halves), so the gain grows with the frames while the penalty grows
with their logarithm, and over a quarter of an hour one voice's halves pass any threshold that
keeps two voices apart in a minute's conversation. So each group is compared on at most
MOST_FRAMES of its frames, spread evenly over it: a recording of any length is judged as the
minute-long conversations the threshold was measured on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

HOP = 160  # the mel frames' step (workers/diarize.py): frame j is centred on sample j * HOP
#: the audio's mel spectrogram is taken in pieces of this many samples (a multiple of HOP), so
#: an hour's FFT frames never sit in memory at once
CHUNK = 60 * 16000
#: cepstra 1..CEPSTRA-1 describe the voice; c0 (the loudness) only picks the frames
CEPSTRA = 20
#: the quietest share of a group's frames (pauses between words inside a window) is left out
QUIET_PERCENTILE = 30
#: a group of fewer frames than this is too small to fit a Gaussian of 19 dimensions
MIN_FRAMES = 60
#: two groups are two voices when the delta-BIC's likelihood gain exceeds this many times its
#: penalty. Measured over seeds 25, 7, 99 of harness/diarization_set.py: the two halves of one
#: voice's windows (the split check's own split) score 0.41-3.5 (median 0.96, 99th percentile
#: 2.1), two different voices 1.2-14 (5th percentile 1.7 among pairs the encoder scores above
#: 0.86). Counts right on those seeds: 2.0 and 2.2 alike (60/72), 1.5 51, 1.7 57, 2.5 59, 3.0 58.
SPLIT_LAMBDA = 2.2
#: … each group on at most this many frames (15 s of its loud frames). Without it the check
#: split one voice of a long recording: over 8-17 minute conversations of the set's voices
#: (`diarization_set.lengthened`) one voice's halves scored a ratio of 1.2-8 (5th-95th pct),
#: 31 speakers were found in a two-voice one, and no 10-minute monologue was one speaker (0/6).
#: Counts right at 1500 frames: minute-long conversations unchanged (247/312), long ones
#: 4/8 -> 8/8 and 0/8 -> 7/8 (two seeds), 10-minute monologues 0/6 -> 6/6, 2.5-minute ones
#: 6/8 -> 8/8; 1000 and 2000 within one conversation of it either way.
MOST_FRAMES = 1500

#: two found speakers are surely one voice when their ratio is below this (and the other cues
#: do not part them: workers/speaker_clusters.merge_alike). One voice's halves score a median
#: of 0.96-0.99 at these sizes; pairs of speakers the clustering found, over 13 seeded sets of
#: harness/diarization_set.py (312 conversations): one voice cut in two 0.78-4.6 (half of
#: them below 1.2), two voices 1.5-13 (1st percentile 1.5). 1.1-1.3 count alike.
ONE_VOICE_RATIO = 1.2

Distinct = Callable[[np.ndarray, np.ndarray], bool]
#: `bic_ratio` of two groups of windows (None: a group too small to tell)
Ratio = Callable[[np.ndarray, np.ndarray], float | None]


def cepstra(audio: np.ndarray, mel: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
    """(frames, CEPSTRA): MFCC 0..19 of `audio` (16 kHz) every HOP samples (c0 is the
    loudness); `mel` gives a clip's (frames, channels) power mel spectrogram, centred frames."""
    from scipy.fft import dct

    pieces = []
    for start in range(0, max(len(audio), 1), CHUNK):
        power = mel(audio[start:start + CHUNK])
        power = power if start + CHUNK >= len(audio) else power[:CHUNK // HOP]
        # each piece's cepstra alone (the DCT is per frame): only CEPSTRA of the channels
        # are kept, and no whole recording's log-mel is ever held (4 h: 1.6 GB, for 0.2)
        logmel = np.log(power.astype(np.float64) + 1e-10)
        pieces.append(dct(logmel, norm="ortho", axis=1)[:, :CEPSTRA].copy())
    return np.concatenate(pieces)


def _frames(windows: Sequence[tuple[int, int]], members: np.ndarray, loudness: np.ndarray,
            ) -> np.ndarray:
    """The frames of windows `members` (each once), less the group's quietest."""
    chosen = np.zeros(len(loudness), dtype=bool)
    for index in members:
        start, end = windows[index]
        chosen[start // HOP:end // HOP] = True
    found = np.flatnonzero(chosen)
    if not len(found):
        return found
    return found[loudness[found] > np.percentile(loudness[found], QUIET_PERCENTILE)]


def _log_det(frames: np.ndarray) -> float:
    covariance = np.cov(frames, rowvar=False) + 1e-6 * np.eye(frames.shape[1])
    return float(np.linalg.slogdet(covariance)[1])


def bic_ratio(features: np.ndarray, first: np.ndarray, second: np.ndarray) -> float:
    """Delta-BIC's likelihood gain of two Gaussians over one, over its penalty (lambda 1)."""
    both = np.vstack([features[first], features[second]])
    gain = 0.5 * (len(both) * _log_det(both) - len(first) * _log_det(features[first])
                  - len(second) * _log_det(features[second]))
    dims = features.shape[1]
    return gain / (0.5 * (dims + dims * (dims + 1) / 2) * np.log(len(both)))


def _at_most(frames: np.ndarray, count: int) -> np.ndarray:
    """`count` of `frames`, evenly spread (all of them if fewer)."""
    if len(frames) <= count:
        return frames
    return frames[np.linspace(0, len(frames) - 1, count).astype(int)]


def voice_ratio(features: np.ndarray, windows: Sequence[tuple[int, int]]) -> Ratio:
    """`bic_ratio` of two groups of `windows` (indices into it) over `features` (`cepstra`
    of the whole recording), each group on at most MOST_FRAMES of its frames."""
    loudness, voice = features[:, 0], features[:, 1:]

    def ratio(first: np.ndarray, second: np.ndarray) -> float | None:
        one, other = _frames(windows, first, loudness), _frames(windows, second, loudness)
        shared = np.intersect1d(one, other)  # overlapping windows at a change of speaker
        one, other = np.setdiff1d(one, shared), np.setdiff1d(other, shared)
        if min(len(one), len(other)) < MIN_FRAMES:
            return None
        return bic_ratio(voice, _at_most(one, MOST_FRAMES), _at_most(other, MOST_FRAMES))

    return ratio


def distinct_voices(ratio: Ratio) -> Distinct:
    """A check of two groups of windows: two voices when their `ratio` (`voice_ratio`) is
    above SPLIT_LAMBDA."""

    def distinct(first: np.ndarray, second: np.ndarray) -> bool:
        found = ratio(first, second)
        return found is not None and found > SPLIT_LAMBDA

    return distinct
