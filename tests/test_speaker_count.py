"""The speaker count's cues (issue 25): the pitch (estimator, affinity, split check) and the timbre.

Fast and synthetic: the count on the bench's own conversations is bench/diarization.py's.
"""

from __future__ import annotations

import numpy as np
import pytest

from workers import speaker_bic, speaker_clusters, speaker_features

RATE = speaker_features.SAMPLE_RATE


def voice(hz: float, seconds: float = 1.5) -> np.ndarray:
    """A buzz at `hz` with falling harmonics, as a voiced vowel has."""
    t = np.arange(int(seconds * RATE)) / RATE
    return sum(np.sin(2 * np.pi * hz * n * t) / n for n in range(1, 8)).astype(np.float32) * 0.1


@pytest.mark.parametrize("hz", [85.0, 120.0, 210.0, 300.0])
def test_pitch_of_a_voiced_clip(hz: float) -> None:
    assert speaker_features.log_pitch(voice(hz)) == pytest.approx(np.log(hz), abs=0.02)


def test_no_pitch_without_voice() -> None:
    noise = np.random.default_rng(0).normal(0, 0.1, RATE).astype(np.float32)
    assert np.isnan(speaker_features.log_pitch(noise))
    assert np.isnan(speaker_features.log_pitch(np.zeros(RATE, dtype=np.float32)))
    assert np.isnan(speaker_features.log_pitch(np.zeros(100, dtype=np.float32)))


def two_close_voices(alike: float = 0.9, each: int = 10) -> np.ndarray:
    """Windows of two voices whose mean embeddings score ~`alike` (above SPLIT_BELOW)."""
    rng = np.random.default_rng(1)
    base = rng.normal(size=32)
    other = rng.normal(size=32)
    other -= other @ base / (base @ base) * base
    first = base / np.linalg.norm(base)
    second = alike * first + np.sqrt(1 - alike ** 2) * other / np.linalg.norm(other)
    windows = [centre + rng.normal(scale=0.02, size=32) for centre in (first, second)
               for _ in range(each)]
    return np.stack([w / np.linalg.norm(w) for w in windows])


def test_unknown_pitch_leaves_the_affinity_alone() -> None:
    embeddings = two_close_voices()
    stacked = np.concatenate([embeddings, np.full((len(embeddings), 1), np.nan)], axis=1)
    assert np.allclose(speaker_clusters.pitched_affinity(stacked),
                       speaker_clusters.centred_affinity(embeddings))


def test_different_pitches_lower_the_affinity() -> None:
    embeddings = two_close_voices()
    pitch = np.log(np.r_[np.full(10, 100.0), np.full(10, 140.0)])
    stacked = np.concatenate([embeddings, pitch[:, None]], axis=1)
    plain = speaker_clusters.centred_affinity(embeddings)
    weighed = speaker_clusters.pitched_affinity(stacked)
    assert np.allclose(weighed[:10, :10], plain[:10, :10])
    assert (weighed[:10, 10:] < plain[:10, 10:] + 1e-12).all()


def test_a_window_unlike_all_others_does_not_break_the_clustering() -> None:
    """One window (a cough, a door) alike with no other: the spectral library used to divide
    by zero on it when told two speakers, and the task failed."""
    rng = np.random.default_rng(1)
    voice_a, voice_b, odd = np.abs(rng.normal(size=(3, 256)))  # d-vectors are positive
    windows = np.vstack([voice_a + 0.3 * np.abs(rng.normal(size=(10, 256))),
                         voice_b + 0.3 * np.abs(rng.normal(size=(10, 256))), odd])
    windows /= np.linalg.norm(windows, axis=1, keepdims=True)
    for bounds in ((2, 2), (1, 2), (1, 8)):
        found = speaker_clusters.cluster(windows, bounds)
        assert len(set(found[:10])) == 1 and len(set(found[10:20])) == 1, bounds
        assert found[0] != found[10], bounds


def three_voices() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """240 windows of three voices at three pitches: (voices, truth, windows, pitch)."""
    rng = np.random.default_rng(7)
    voices = np.abs(rng.normal(size=(3, 64)))
    truth = rng.integers(0, 3, 240)
    windows = voices[truth] + 0.5 * np.abs(rng.normal(size=(240, 64)))
    windows /= np.linalg.norm(windows, axis=1, keepdims=True)
    return voices, truth, windows, np.log(100.0 + 30 * truth) + rng.normal(0, 0.03, 240)


def test_many_windows_are_clustered_in_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_SPECTRAL_POINTS windows (an hour is thousands), the spectral clustering runs
    on tight groups of them: the same speakers come out."""
    _, truth, windows, pitch = three_voices()
    monkeypatch.setattr(speaker_clusters, "MAX_SPECTRAL_POINTS", 40)
    found = speaker_clusters.cluster(windows, (1, 8), pitch)
    assert found.max() == 2
    assert all(len(set(found[truth == voice])) == 1 for voice in range(3))


def test_hours_of_windows_are_grouped_from_a_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past MAX_GROUPED_WINDOWS the tight groups are made from windows spread evenly in time
    and every other window joins the nearest group's centre: the same speakers come out,
    and the grouping holds no distance for every pair (8000 windows, two hours of speech:
    256 MB of them; four hours, 1.5 GB)."""
    import tracemalloc

    voices, truth, windows, pitch = three_voices()
    with monkeypatch.context() as small:
        small.setattr(speaker_clusters, "MAX_SPECTRAL_POINTS", 40)
        small.setattr(speaker_clusters, "MAX_GROUPED_WINDOWS", 100)
        found = speaker_clusters.cluster(windows, (1, 8), pitch)
    assert found.max() == 2
    assert all(len(set(found[truth == voice])) == 1 for voice in range(3))

    rng = np.random.default_rng(8)
    many = np.abs(rng.normal(size=(8000, 64))) + voices[rng.integers(0, 3, 8000)]
    many /= np.linalg.norm(many, axis=1, keepdims=True)
    tracemalloc.start()
    try:
        labels = speaker_clusters._spectral(np.c_[many, np.full(8000, np.nan)], 2, 8)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(labels) == 8000 and peak < 160 * 2**20, peak / 2**20  # (was 344 MB)


def with_a_third(embeddings: np.ndarray, pitch: np.ndarray) -> tuple[np.ndarray, ...]:
    """The two close voices found as one speaker, beside a clearly different third one (a
    recording found to be one voice is never split)."""
    rng = np.random.default_rng(3)
    centre = rng.normal(size=embeddings.shape[1])
    third = centre + rng.normal(scale=0.1 * np.linalg.norm(centre) / 5, size=(6, len(centre)))
    third /= np.linalg.norm(third, axis=1, keepdims=True)
    labels = np.r_[np.zeros(len(embeddings), dtype=int), np.ones(6, dtype=int)]
    return np.vstack([embeddings, third]), labels, np.r_[pitch, np.full(6, np.log(180.0))]


def test_close_voices_at_different_pitches_are_split() -> None:
    apart = np.log(np.r_[np.full(10, 100.0), np.full(10, 130.0)])
    embeddings, merged, pitch = with_a_third(two_close_voices(), apart)
    labels = speaker_clusters.split_mixed(embeddings, merged, 5, pitch)
    assert labels.max() == 2
    assert len(set(labels[:10])) == len(set(labels[10:20])) == 1
    assert len({labels[0], labels[10], labels[20]}) == 3


def test_close_voices_at_one_pitch_stay_merged() -> None:
    same = np.log(np.full(20, 110.0)) + np.random.default_rng(2).normal(0, 0.03, 20)
    embeddings, merged, pitch = with_a_third(two_close_voices(), same)
    assert speaker_clusters.split_mixed(embeddings, merged, 5, pitch).max() == 1
    assert speaker_clusters.split_mixed(embeddings, merged, 5).max() == 1


def vowel(hz: float, rolloff: float, seconds: float, seed: int) -> np.ndarray:
    """A wavering buzz at `hz` whose harmonics fall off as n^-rolloff (the voice's timbre),
    with a little breath noise."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * RATE)) / RATE
    wobble = hz * (1 + 0.03 * np.sin(2 * np.pi * rng.uniform(2, 5) * t))
    phase = 2 * np.pi * np.cumsum(wobble) / RATE
    loud = 0.6 + 0.4 * np.sin(2 * np.pi * rng.uniform(1, 3) * t) ** 2
    buzz = sum(np.sin(n * phase) / n ** rolloff for n in range(1, 30))
    return (0.05 * loud * buzz + rng.normal(0, 0.002, len(t))).astype(np.float32)


def clips_ratio(clips: list[np.ndarray]) -> speaker_bic.Ratio:
    """The timbre's ratio over `clips` (of one length) played one after another, each clip a
    window."""
    from functools import partial

    from workers import diarize

    size = len(clips[0])
    windows = [(i * size, (i + 1) * size) for i in range(len(clips))]
    mel = partial(diarize.mel_spectrogram, basis=diarize.mel_filters())
    return speaker_bic.voice_ratio(speaker_bic.cepstra(np.concatenate(clips), mel), windows)


def timbre_check(rolloffs: tuple[float, float]) -> tuple[speaker_bic.Distinct, np.ndarray,
                                                         np.ndarray]:
    """Eight 1.5 s windows of one voice, then eight of another at the same pitch."""
    clips = [vowel(120.0, rolloff, 1.5, seed) for rolloff in rolloffs for seed in range(8)]
    return speaker_bic.distinct_voices(clips_ratio(clips)), np.arange(8), np.arange(8, 16)


def test_timbre_tells_two_voices_at_one_pitch() -> None:
    check, first, second = timbre_check((1.0, 2.0))
    assert check(first, second)
    assert not check(first[::2], first[1::2])
    assert not check(second[:4], second[4:])


def test_timbre_needs_enough_frames() -> None:
    check, first, second = timbre_check((1.0, 2.0))
    assert not check(first[:1], second[:0])


def test_cepstra_in_pieces_line_up(monkeypatch: pytest.MonkeyPatch) -> None:
    from functools import partial

    from workers import diarize

    audio = vowel(150.0, 1.5, 3.2, 0)
    mel = partial(diarize.mel_spectrogram, basis=diarize.mel_filters())
    whole = speaker_bic.cepstra(audio, mel)
    monkeypatch.setattr(speaker_bic, "CHUNK", RATE)
    pieces = speaker_bic.cepstra(audio, mel)
    assert pieces.shape == whole.shape
    inside = np.ones(len(whole), dtype=bool)
    for edge in range(100, len(whole), 100):  # frames whose FFT reaches across a piece's end
        inside[edge - 2:edge + 2] = False
    assert np.allclose(pieces[inside], whole[inside])


def test_one_voice_found_twice_is_merged_a_close_voice_of_another_timbre_is_not() -> None:
    """The eigen-gap now and then cuts one voice into two large groups (merge_small leaves
    those alone): they become one speaker when no cue parts them and the timbre says one
    voice; a third group of another timbre, as alike to the encoder, stays apart."""
    ratio = clips_ratio([vowel(120.0, rolloff, 1.5, seed) for rolloff, seeds
                         in ((1.0, range(16)), (2.0, range(16, 24))) for seed in seeds])
    embeddings = two_close_voices(alike=0.95, each=16)[:24]
    pitch = np.log(np.full(24, 120.0))
    found = np.repeat([0, 1, 2], 8)  # the first voice as two speakers
    merged = speaker_clusters.merge_alike(embeddings, found, 1, pitch, ratio)
    assert merged.max() == 1 and len(set(merged[:16])) == 1 and merged[16] != merged[0]
    assert (merged[16:] == merged[16]).all()
    kept = speaker_clusters.merge_alike(embeddings, found, 3, pitch, ratio)  # told at least 3
    assert (kept == found).all()


def test_a_told_count_holds_when_few_windows_are_long() -> None:
    """A quick exchange: one voice's two long turns, the other's dozen short replies. The
    clustering ran on the long windows alone (two of them: one speaker at most), so
    `num_speakers=2` came out as one speaker; now every window counts, and with no more
    windows than speakers told, each is its own."""
    from workers import diarize

    rng = np.random.default_rng(7)
    voice_a, voice_b = np.abs(rng.normal(size=(2, 256)))
    embeddings = np.vstack([voice_a + 0.2 * np.abs(rng.normal(size=(2, 256))),
                            voice_b + 0.2 * np.abs(rng.normal(size=(12, 256)))])
    embeddings /= np.linalg.norm(embeddings, axis=1, keepdims=True)
    rate = diarize.SAMPLE_RATE
    windows = [(i * 2 * rate, i * 2 * rate + int(1.5 * rate)) for i in range(2)] + [
        (10 * rate + i * rate, 10 * rate + i * rate + int(0.6 * rate)) for i in range(12)]
    found = diarize._cluster(embeddings, windows, (2, 2))
    assert len(set(found[:2])) == 1 and len(set(found[2:])) == 1, found
    assert found[0] != found[2], found
    assert list(speaker_clusters.cluster(embeddings[:3], (3, 3))) == [0, 1, 2]
