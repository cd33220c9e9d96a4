"""Speaker windows to speakers: spectral clustering with an eigen-gap count (Google's
`spectralcluster`, after Wang et al., "Speaker Diarization with LSTM", ICASSP 2018).

Resemblyzer's embeddings of one recording share a large common component (the channel, the
synthesiser, the language), so every pair of windows scores 0.7-0.95 cosine alike and a fixed
distance threshold cannot tell two close voices from one voice's spread. What separates
speakers is the direction each window takes away from the recording's own mean: the affinity is
the cosine of the *centred* embeddings, clipped at 0 (windows of different speakers are about
orthogonal there, windows of one speaker point the same way), weighed down where two windows are
spoken at different pitches (workers/speaker_features.py: the encoder scores some different
voices as alike as one voice's windows, and many of those differ in pitch). The count is the
eigen-gap of that affinity's graph-cut Laplacian; whether there is more than one speaker at all
is decided first: windows whose raw affinities spread widely are several voices (the library's
`AffinityStd` check); where they spread little, the recording is one voice unless its best
two-way split gives halves the split check calls two voices.

Pitches come as a column of NaN where unknown (a window barely voiced, or a caller without
them): those pairs are weighed by the embeddings alone.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from workers.speaker_bic import ONE_VOICE_RATIO, Distinct, Ratio

#: several speakers when the raw affinities ((cos + 1) / 2) of all window pairs spread more
#: than this (standard deviation); below it, one voice unless its halves are two (`cluster`).
#: Measured on harness/diarization_set.py's generator: monologues of one espeak voice spread
#: 0.004-0.037 (96 of them), jfk.flac 0.028; conversations of 2-5 voices 0.021-0.11 (5th
#: percentile 0.031, median 0.06). The ranges overlap, so the spread alone cannot decide: a
#: fixed threshold of 0.035 split 13 of the 96 monologues and merged 4 of 312 conversations.
MAYBE_ONE_SPEAKER_SPREAD = 0.045
#: … and with too few windows to split in two halves, the spread alone decides at this
SINGLE_SPEAKER_SPREAD = 0.035

#: a found speaker whose best two-way split gives halves with mean embeddings (raw, not
#: centred) less alike than this is two speakers. Measured over three seeded sets of
#: harness/diarization_set.py (72 conversations): two halves of one speaker's windows score
#: 0.875-0.998 (5th percentile 0.957), two different speakers 0.48-0.96 (median 0.71). The
#: eigen-gap merges close voices (its errors are under-counts); this undoes the clearest
#: of them: 64 % -> 72 % of counts right on each of the three sets alike.
SPLIT_BELOW = 0.82
#: … and each half holds at least this many windows (a half of one or two is an outlier)
SPLIT_MIN_WINDOWS = 3
#: two windows' affinity is scaled by exp(-d^2 / 2 PITCH_SPREAD^2), d the difference of their
#: median log-F0. One voice's windows differ by ~0.03-0.07 (a median per window varies ~0.04);
#: PITCH_SPREAD and the two below were compared offline on seeds 25, 7, 99 (0.10-0.20 alike
#: within 2 points) and checked on held-out seeds (bench/README.md, issue 25).
PITCH_SPREAD = 0.15
#: halves whose median log-F0 differ by more than this are two speakers when their mean
#: embeddings are also less alike than PITCH_SPLIT_ALIKE. Halves of one voice differ by
#: 0.002-0.07 (95th percentile 0.07, 99th 0.11), different voices 0.02-1.3 (median 0.31).
PITCH_SPLIT = 0.12
#: … the embeddings' share of that decision: halves of one voice score 0.85-0.95
PITCH_SPLIT_ALIKE = 0.93
#: a found speaker of at most this many windows stays only if the split check's cues call it
#: another voice than the speaker nearest to it: the eigen-gap now and then cuts a few windows
#: off one voice, which no split check undoes. Counts right over ten seeded sets of
#: harness/diarization_set.py (240 conversations): 182 without, 186 at 3, 189 at 4-6, 187 at
#: any size (the eigen-gap's large clusters of close voices are mostly right).
MERGE_MOST_WINDOWS = 4

#: every pair of windows is this alike at least: a window unlike all others (a cough, a door)
#: would otherwise be a component of the graph on its own, and when the eigen-gap asks for
#: fewer speakers than the graph has components, the eigenvectors can be all zero on it (the
#: library's row normalisation then divides by zero and its k-means refuses the NaN)
AFFINITY_FLOOR = 1e-6

#: the spectral clustering's eigen-decomposition grows with the cube of its points (the
#: library's np.linalg.eig: 2000 windows, half an hour of speech, took 26 s and 450 MB; an
#: hour, minutes and GBs). Past this many windows they are first put into this many tight
#: groups (complete-linkage agglomerative clustering of the centred embeddings, as the
#: library's own `max_spectral_size` does on raw ones), and the groups are clustered.
MAX_SPECTRAL_POINTS = 400
#: the grouping's complete linkage holds every pair's distance (N²/2 float64: 4 h of speech,
#: 19 000 windows, 1.5 GB): past this many windows the groups are made from this many,
#: evenly spread in time, and every window joins the group whose centre it is nearest
MAX_GROUPED_WINDOWS = 3000
#: the one-voice check's spread is taken over at most this many windows, evenly spread in
#: time: its affinity matrix grows with their square (an hour's 4500 windows, 160 MB)
MAX_SPREAD_WINDOWS = 800


def _normed(vectors: np.ndarray) -> np.ndarray:
    return vectors / np.maximum(np.linalg.norm(vectors, axis=-1, keepdims=True), 1e-9)


def centred_affinity(embeddings: np.ndarray) -> np.ndarray:
    """Cosine of the embeddings less their mean, clipped at 0."""
    centred = _normed(embeddings - embeddings.mean(axis=0))
    return np.maximum(centred @ centred.T, 0.0)


def pitched_affinity(stacked: np.ndarray) -> np.ndarray:
    """`centred_affinity` of the embeddings (all columns but the last), times the pitch
    kernel of the last column (log-F0, NaN where unknown)."""
    pitch = stacked[:, -1]
    apart = np.nan_to_num(np.abs(pitch[:, None] - pitch[None, :]), nan=0.0)
    return centred_affinity(stacked[:, :-1]) * np.exp(-0.5 * (apart / PITCH_SPREAD) ** 2)


def _graph_affinity(stacked: np.ndarray) -> np.ndarray:
    """What the spectral clustering cuts: `pitched_affinity`, at least AFFINITY_FLOOR."""
    return np.maximum(pitched_affinity(stacked), AFFINITY_FLOOR)


def _stacked(embeddings: np.ndarray, pitch: np.ndarray | None) -> np.ndarray:
    column = np.full(len(embeddings), np.nan) if pitch is None else pitch
    return np.concatenate([embeddings, column[:, None]], axis=1)


def _clusterer(fewest: int, most: int) -> Any:
    from spectralcluster import (
        EigenGapType,
        LaplacianType,
        RefinementOptions,
        SpectralClusterer,
    )

    return SpectralClusterer(
        min_clusters=fewest, max_clusters=most,
        refinement_options=RefinementOptions(refinement_sequence=[]),
        laplacian_type=LaplacianType.GraphCut, affinity_function=_graph_affinity,
        eigengap_type=EigenGapType.NormalizedDiff, row_wise_renorm=True, custom_dist="cosine")


def alike_throughout(embeddings: np.ndarray, spread: float) -> bool:
    """The raw affinities of all window pairs spread less than `spread` (the library's
    `AffinityStd` check)."""
    from spectralcluster import fallback_clusterer, utils

    options = fallback_clusterer.FallbackOptions(
        single_cluster_condition=fallback_clusterer.SingleClusterCondition.AffinityStd,
        single_cluster_affinity_threshold=spread,
        single_cluster_affinity_diagonal_offset=1)
    sample = embeddings[::-(-len(embeddings) // MAX_SPREAD_WINDOWS)]
    return bool(fallback_clusterer.check_single_cluster(
        options, sample, utils.compute_affinity_matrix(sample)))


def _spectral(stacked: np.ndarray, fewest: int, most: int) -> np.ndarray:
    """A cluster per row of `stacked` (embeddings and a pitch column): `_clusterer`'s, on at
    most MAX_SPECTRAL_POINTS points."""
    if len(stacked) <= MAX_SPECTRAL_POINTS:
        return _clusterer(fewest, most).predict(stacked)
    from sklearn.cluster import AgglomerativeClustering

    embeddings, pitch = stacked[:, :-1], stacked[:, -1]
    centred = embeddings - embeddings.mean(axis=0)
    sample = np.arange(0, len(stacked), -(-len(stacked) // MAX_GROUPED_WINDOWS))
    groups = AgglomerativeClustering(
        n_clusters=MAX_SPECTRAL_POINTS, metric="cosine", linkage="complete",
    ).fit_predict(centred[sample])
    if len(sample) < len(stacked):  # the others join the nearest group's centre
        centres = _normed(np.stack([centred[sample][groups == g].mean(axis=0)
                                    for g in range(MAX_SPECTRAL_POINTS)]))
        groups = np.argmax(_normed(centred) @ centres.T, axis=1)
    kept, groups = np.unique(groups, return_inverse=True)  # (a centre no window chose)
    points = np.stack([
        np.append(_normed(embeddings[groups == g].mean(axis=0)), _median(pitch[groups == g]))
        for g in range(len(kept))])
    return np.asarray(_clusterer(fewest, min(most, len(kept) - 1)).predict(points))[groups]


def _median(values: np.ndarray) -> float:
    known = values[~np.isnan(values)]
    return float(np.median(known)) if len(known) else float("nan")


def cluster(embeddings: np.ndarray, bounds: tuple[int, int],
            pitch: np.ndarray | None = None, distinct: Distinct | None = None) -> np.ndarray:
    """A speaker number (0, 1, …) per embedding (unit vectors, one per window; `pitch` each
    window's log-F0; `distinct` the timbre check, as in `split_mixed`): between `bounds`
    speakers, as many as the eigen-gap says."""
    fewest, most = bounds
    if fewest == most and 1 < len(embeddings) <= most:  # told: a speaker for each window
        return np.arange(len(embeddings))
    most = min(most, len(embeddings) - 1)  # k clusters need k + 1 eigenvalues to compare
    fewest = min(fewest, most)
    one = np.zeros(len(embeddings), dtype=int)
    if most <= 1:
        return one
    stacked = _stacked(embeddings, pitch)
    if fewest <= 1:
        if len(embeddings) < 2 * SPLIT_MIN_WINDOWS:
            if alike_throughout(embeddings, SINGLE_SPEAKER_SPREAD):
                return one
        elif alike_throughout(embeddings, MAYBE_ONE_SPEAKER_SPREAD):
            halves = _halves(embeddings, stacked, np.arange(len(embeddings)), distinct)
            if halves is not None:  # the halves are where the split check goes on
                one[halves[1]] = 1
            return one
    labels = _spectral(stacked, max(fewest, 2), most)
    return np.unique(labels, return_inverse=True)[1]


def _halves(embeddings: np.ndarray, stacked: np.ndarray, members: np.ndarray,
            distinct: Distinct | None) -> tuple[np.ndarray, np.ndarray] | None:
    """`members`' best two-way split (spectral, k = 2) when its halves are two voices
    (`_unlike`, or `distinct`), each of at least SPLIT_MIN_WINDOWS windows; else None."""
    try:
        halves = _spectral(stacked[members], 2, 2)
    except ValueError:  # too alike to split at all (a degenerate affinity)
        return None
    first, second = members[halves == 0], members[halves == 1]
    if min(len(first), len(second)) < SPLIT_MIN_WINDOWS:
        return None
    if _unlike(embeddings, stacked[:, -1], first, second) or (
            distinct is not None and distinct(first, second)):
        return first, second
    return None


def _unlike(embeddings: np.ndarray, pitch: np.ndarray, first: np.ndarray,
            second: np.ndarray) -> bool:
    """Two groups of windows are two speakers: unlike embeddings, or fairly unlike ones spoken
    at clearly different pitches."""
    alike = float(_normed(embeddings[first].mean(axis=0))
                  @ _normed(embeddings[second].mean(axis=0)))
    if alike < SPLIT_BELOW:
        return True
    one, other = pitch[first], pitch[second]
    one, other = one[~np.isnan(one)], other[~np.isnan(other)]
    if alike >= PITCH_SPLIT_ALIKE or len(one) < 2 or len(other) < 2:
        return False
    return bool(abs(np.median(one) - np.median(other)) > PITCH_SPLIT)


def split_mixed(embeddings: np.ndarray, labels: np.ndarray, most: int,
                pitch: np.ndarray | None = None, distinct: Distinct | None = None) -> np.ndarray:
    """Split each found speaker whose two halves are unlike (`_unlike`, or `distinct` of the
    halves' window indices: workers/speaker_bic.py's timbre check), and the halves again,
    while there are fewer than `most`; speakers renumbered 0, 1, … A recording found to be
    one voice (`cluster` already tried its halves) stays one."""
    stacked = _stacked(embeddings, pitch)
    labels = labels.copy()
    if labels.max() < 1:
        return labels
    pending = list(range(labels.max() + 1))  # speakers not yet tried
    while pending and labels.max() + 1 < most:
        speaker = pending.pop(0)
        members = np.flatnonzero(labels == speaker)
        if len(members) < 2 * SPLIT_MIN_WINDOWS:
            continue
        if (halves := _halves(embeddings, stacked, members, distinct)) is not None:
            labels[halves[1]] = labels.max() + 1
            pending += [speaker, int(labels.max())]
    return np.unique(labels, return_inverse=True)[1]


def merge_small(embeddings: np.ndarray, labels: np.ndarray, fewest: int,
                pitch: np.ndarray | None = None, distinct: Distinct | None = None) -> np.ndarray:
    """Found speakers of at most MERGE_MOST_WINDOWS windows, smallest first, join the speaker
    whose centroid is nearest unless the two are unlike (`_unlike`, or `distinct`: as in
    `split_mixed`), while more than `fewest` remain; speakers renumbered 0, 1, …"""
    tone = _stacked(embeddings, pitch)[:, -1]
    labels = labels.copy()
    merged = True
    while merged and len(np.unique(labels)) > max(fewest, 1):
        merged = False
        speakers, sizes = np.unique(labels, return_counts=True)
        centroids = _normed(np.stack([embeddings[labels == s].mean(axis=0) for s in speakers]))
        alike = centroids @ centroids.T
        np.fill_diagonal(alike, -np.inf)
        for index in np.argsort(sizes, kind="stable"):
            if sizes[index] > MERGE_MOST_WINDOWS:
                break
            target = speakers[np.argmax(alike[index])]
            small = np.flatnonzero(labels == speakers[index])
            near = np.flatnonzero(labels == target)
            if not (_unlike(embeddings, tone, small, near)
                    or (distinct is not None and distinct(small, near))):
                labels[small] = target
                merged = True
                break
    return np.unique(labels, return_inverse=True)[1]


def merge_alike(embeddings: np.ndarray, labels: np.ndarray, fewest: int,
                pitch: np.ndarray | None, ratio: Ratio) -> np.ndarray:
    """Two found speakers of any size are one when no cue parts them (`_unlike`) and their
    timbre positively says one voice (`ratio` below ONE_VOICE_RATIO): the eigen-gap now and
    then cuts one voice into two large groups, which `merge_small` leaves alone. The pair of
    the lowest ratio first, while more than `fewest` remain; speakers renumbered 0, 1, …"""
    tone = _stacked(embeddings, pitch)[:, -1]
    labels = labels.copy()
    while len(speakers := np.unique(labels)) > max(fewest, 1):
        best: tuple[float, int, int] | None = None
        for index, one in enumerate(speakers):
            for other in speakers[index + 1:]:
                first, second = np.flatnonzero(labels == one), np.flatnonzero(labels == other)
                if _unlike(embeddings, tone, first, second):
                    continue
                found = ratio(first, second)
                if found is not None and found < ONE_VOICE_RATIO and (
                        best is None or found < best[0]):
                    best = (found, int(one), int(other))
        if best is None:
            break
        labels[labels == best[2]] = best[1]
    return np.unique(labels, return_inverse=True)[1]


def nearest(embeddings: np.ndarray, found: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Each of `embeddings` to the nearest centroid of `found` (clustered as `labels`)."""
    centroids = _normed(np.stack([found[labels == c].mean(axis=0)
                                  for c in range(int(labels.max()) + 1)]))
    return np.argmax(embeddings @ centroids.T, axis=1)
