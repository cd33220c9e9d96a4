"""A speaker cue beside the d-vector: the pitch a window is spoken at.

Resemblyzer's encoder scores some pairs of different voices 0.9-0.96 cosine alike, as alike
as two halves of one voice's windows; many such pairs still speak at different pitches (a
voice's median log-F0 over a window varies ~0.03-0.05 from window to window, different voices
0.3 apart at the median). workers/speaker_clusters.py weighs it in. The estimator is YIN's
(de Cheveigné & Kawahara, JASA 2002) in numpy: librosa's pyin would JIT-compile with numba in
the worker (see workers/diarize.py's mel features).
"""

from __future__ import annotations

import numpy as np

SAMPLE_RATE = 16000
FRAME, HOP = 640, 160  # 40 ms frames (two periods of 50 Hz), 10 ms steps
LOWEST_HZ, HIGHEST_HZ = 60.0, 400.0
#: a frame is voiced when its cumulative mean normalised difference dips below this (YIN's
#: aperiodicity) and its energy is at least QUIET of the window's loudest frame
VOICED_DIP, QUIET = 0.3, 1e-3
#: YIN's absolute threshold: the first dip below it is the period (not a later octave)
FIRST_DIP = 0.15
#: fewer voiced frames than this (50 ms) give no pitch
MIN_VOICED_FRAMES = 5


def _differences(frames: np.ndarray, longest: int) -> np.ndarray:
    """YIN's cumulative mean normalised difference per frame, lags 0..longest."""
    half = frames.shape[1] // 2
    size = 1 << int(np.ceil(np.log2(2 * frames.shape[1])))
    whole, head = np.fft.rfft(frames, size), np.fft.rfft(frames[:, :half], size)
    products = np.fft.irfft(whole * np.conj(head), size)[:, :longest + 1]
    energy = np.cumsum(np.pad(frames ** 2, ((0, 0), (1, 0))), axis=1)
    lags = np.arange(longest + 1)
    diff = (energy[:, half] - energy[:, 0])[:, None] + energy[:, lags + half] \
        - energy[:, lags] - 2 * products
    mean = np.cumsum(diff[:, 1:], axis=1) / np.arange(1, longest + 1)
    normalised = np.ones_like(diff)
    normalised[:, 1:] = diff[:, 1:] / np.maximum(mean, 1e-12)
    return normalised


def log_pitch(clip: np.ndarray) -> float:
    """The median log-F0 (ln Hz) of `clip`'s voiced frames (16 kHz); NaN if barely voiced."""
    if len(clip) < FRAME + HOP:
        return float("nan")
    frames = np.lib.stride_tricks.sliding_window_view(clip.astype(np.float64), FRAME)[::HOP]
    frames = frames - frames.mean(axis=1, keepdims=True)
    shortest, longest = int(SAMPLE_RATE / HIGHEST_HZ), int(SAMPLE_RATE / LOWEST_HZ)
    dips = _differences(frames, longest)[:, shortest:]
    rows = np.arange(len(dips))
    below = dips < FIRST_DIP
    lag = np.where(below.any(axis=1), np.argmax(below, axis=1), np.argmin(dips, axis=1))
    while True:  # from the first dip down to its own minimum
        step = np.minimum(lag + 1, dips.shape[1] - 1)
        lower = dips[rows, step] < dips[rows, lag]
        if not lower.any():
            break
        lag = np.where(lower, step, lag)
    loudness = (frames ** 2).mean(axis=1)
    voiced = (dips[rows, lag] < VOICED_DIP) & (loudness > QUIET * loudness.max())
    if voiced.sum() < MIN_VOICED_FRAMES:
        return float("nan")
    return float(np.median(np.log(SAMPLE_RATE / (lag[voiced] + shortest))))
