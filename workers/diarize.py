"""Who spoke: speaker diarization for every ASR engine, run by the worker after transcription.

`bundled` (the only source today): silero-vad (its package ships the model) finds the speech
regions, Resemblyzer's GE2E encoder (its package ships the weights) embeds windows of them,
and spectral clustering (workers/speaker_clusters.py, Google's `spectralcluster`) groups the
windows into speakers: as many as asked, or as many as the eigen-gap finds. Everything runs on
CPU.

This module only knows how: load, run, unload. When it loads, when it is unloaded, what a
failed load means and whether memory allows it are the worker's rules (workers/models.py
holds the diarizer beside the model, so it is loaded on the first task that asks, counted in
the memory cap, unloaded with the model, and its load failures are the model's).

`pyannote:DIR` (workers/pyannote_diarizer.py): a pyannote.audio pipeline from a local
checkpoint directory, for GPU hosts, under the same rules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import partial
from typing import Any

import numpy as np

from common.schemas import (
    AUTOMATIC_LABEL,
    MAX_SPEAKERS,
    DiarizationOptions,
    Segment,
    Transcription,
)
from workers import pyannote_diarizer, speaker_bic, speaker_clusters, speaker_features

BUNDLED = "bundled"
SAMPLE_RATE = 16000
#: a speech region longer than this is cut into overlapping windows (a change of speaker
#: without a pause falls between two of them)
WINDOW_SECONDS, HOP_SECONDS = 1.5, 0.75
MAX_WHOLE_REGION_SECONDS = 3.0
#: windows shorter than this embed poorly: they are assigned to the nearest speaker found
#: from the longer ones, never allowed to found a speaker of their own
MIN_RELIABLE_SECONDS = 1.0
#: an estimated speaker needs this many windows: a lone window that matches nobody (a cough,
#: applause, a shout) joins the nearest speaker instead
MIN_CLUSTER_WINDOWS = 2
#: turns of one speaker closer than this are one turn
MERGE_GAP_SECONDS = 0.5


def label(index: int) -> str:
    return f"SPEAKER_{index:02d}"


@dataclass(frozen=True, slots=True)
class Turn:
    start: float
    end: float
    speaker: str


@dataclass(slots=True)
class Diarization:
    """Speaker turns in time order; speakers by first appearance (a label, or a known name)."""

    turns: list[Turn]
    speakers: list[str] = field(default_factory=list)


@dataclass(slots=True)
class DiarizerHandle:
    vad: Any  # silero-vad's model
    encoder: Any  # resemblyzer.VoiceEncoder
    mel_basis: Any = None  # (MEL_CHANNELS, N_FFT // 2 + 1)


class DiarizerUnusable(Exception):
    """The configured diarizer source cannot be used (found before anything is allocated)."""


class Diarizer:
    def __init__(self, source: str = BUNDLED, name_threshold: float = 0.75) -> None:
        self.source = source
        self.name_threshold = name_threshold

    @property
    def is_pyannote(self) -> bool:
        return pyannote_diarizer.directory(self.source) is not None

    def check_source(self) -> None:
        if self.source == BUNDLED:
            return
        if not self.is_pyannote:
            raise DiarizerUnusable(
                f"diarization model {self.source!r} is not supported: {BUNDLED!r} (silero-vad + "
                f"Resemblyzer) or {pyannote_diarizer.PREFIX}DIR (a pyannote.audio pipeline)")
        if (problem := pyannote_diarizer.problem(self.source)) is not None:
            raise DiarizerUnusable(f"diarization model {self.source!r}: {problem}")

    def load(self, device: str = "cpu") -> DiarizerHandle | pyannote_diarizer.PyannoteHandle:
        self.check_source()
        if self.is_pyannote:
            return pyannote_diarizer.load(self.source, device)
        from resemblyzer import VoiceEncoder
        from silero_vad import load_silero_vad

        vad = load_silero_vad()
        encoder = VoiceEncoder(device="cpu", verbose=False)
        encoder.eval()
        return DiarizerHandle(vad, encoder, mel_filters())

    def unload(self, handle: DiarizerHandle | pyannote_diarizer.PyannoteHandle) -> None:
        if isinstance(handle, pyannote_diarizer.PyannoteHandle):
            pyannote_diarizer.unload(handle)
            return
        handle.vad = handle.encoder = handle.mel_basis = None

    # --- one task ---------------------------------------------------------------------------

    def diarize(self, handle: DiarizerHandle | pyannote_diarizer.PyannoteHandle,
                audio: np.ndarray, options: DiarizationOptions,
                references: dict[str, np.ndarray] | None = None) -> Diarization:
        """Turns of `audio` (mono float32 at 16 kHz); `references` maps a known speaker's name
        to its clip (16 kHz)."""
        if isinstance(handle, pyannote_diarizer.PyannoteHandle):
            found, centroids = pyannote_diarizer.diarize(handle, audio, options.bounds())
            voices = {name: pyannote_diarizer.embed(handle, clip)
                      for name, clip in (references or {}).items()}
            return _labelled([(start, end, speaker) for start, end, speaker in found],
                             self._names(centroids, voices), 1.0)
        import torch

        with torch.inference_mode():
            regions = _speech_regions(handle, audio)
            windows = [w for start, end in regions for w in _windows(start, end)]
            if not windows:
                return Diarization([])
            embeddings = np.stack([_embed(handle, audio[start:end]) for start, end in windows])
            pitch = np.array([speaker_features.log_pitch(audio[s:e]) for s, e in windows])
            fewest, most = options.bounds()
            timbre = None if most <= 1 else speaker_bic.cepstra(
                audio, partial(mel_spectrogram, basis=handle.mel_basis))
            clusters = _cluster(embeddings, windows, (fewest, most), pitch, timbre)
            names: dict[Any, str] = {}
            if references:
                centroids = {int(c): _normed(embeddings[clusters == c].mean(axis=0))
                             for c in set(clusters)}
                names = self._names(centroids, {name: _embed(handle, clip)
                                                for name, clip in references.items()})
        return _labelled(_turns(windows, clusters), names, SAMPLE_RATE)

    def reference(self, handle: DiarizerHandle | pyannote_diarizer.PyannoteHandle, name: str,
                  clip: np.ndarray) -> np.ndarray:
        """A known speaker's clip (16 kHz) as it is compared: its speech only, where the
        bundled VAD finds it (pauses and noise around the voice would pull its embedding
        toward nobody's). ValueError (the task's 400) for a clip that holds no voice: silent,
        or noise, music, a tone, which would otherwise be paired with whichever speaker came
        closest; found before the engine runs, as a bad reference found after the transcript
        was streamed would fail a task whose output was delivered."""
        if not len(clip) or float(np.max(np.abs(clip))) < SILENT_REFERENCE_PEAK:
            raise ValueError(f"the reference clip of known speaker {name!r} is silent")
        if isinstance(handle, pyannote_diarizer.PyannoteHandle):
            return clip  # the pipeline's embedding model takes the clip as it is
        import torch

        with torch.inference_mode():
            speech = [clip[start:end] for start, end in _speech_regions(handle, clip)]
        voiced = sum(len(part) for part in speech) / SAMPLE_RATE
        if voiced < MIN_REFERENCE_SPEECH_SECONDS:
            raise ValueError(f"the reference clip of known speaker {name!r} holds "
                             f"{voiced:.1f} s of speech; give one with at least "
                             f"{MIN_REFERENCE_SPEECH_SECONDS:g} s of that speaker talking")
        return np.concatenate(speech)

    def _names(self, centroids: dict[Any, np.ndarray],
               voices: dict[str, np.ndarray]) -> dict[Any, str]:
        """cluster -> a known speaker's name: the pairing of names and clusters most alike in
        all (one name per cluster; two close voices still go to their own clusters), each pair
        kept from `name_threshold` up."""
        from scipy.optimize import linear_sum_assignment

        if not centroids or not voices:
            return {}
        voices = {name: v for name, v in voices.items() if np.all(np.isfinite(v))}
        if not voices:
            return {}
        clusters, names = list(centroids), list(voices)
        scores = np.array([[float(np.dot(_normed(centroids[c]), _normed(voices[n])))
                            for n in names] for c in clusters])
        rows, cols = linear_sum_assignment(-scores)
        return {clusters[r]: names[c] for r, c in zip(rows, cols, strict=True)
                if scores[r, c] >= self.name_threshold}


#: a known speaker's reference clip whose loudest sample is below this (of full scale) holds
#: no voice to compare (digital silence makes the encoder's volume normalisation NaN)
SILENT_REFERENCE_PEAK = 1e-3
#: the speech the VAD must find in a known speaker's reference clip (a clip is 2-10 s long):
#: less embeds too little of the voice to tell it from a close one
MIN_REFERENCE_SPEECH_SECONDS = 1.0


def _speech_regions(handle: DiarizerHandle, audio: np.ndarray) -> list[tuple[int, int]]:
    """Where silero-vad hears speech in `audio` (16 kHz), in samples (under inference_mode)."""
    import torch
    from silero_vad import get_speech_timestamps

    return [(r["start"], r["end"]) for r in get_speech_timestamps(
        torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32)), handle.vad,
        sampling_rate=SAMPLE_RATE)]


def _labelled(turns: list[tuple[Any, Any, Any]], names: dict[Any, str],
              per_second: float) -> Diarization:
    """Turns in `per_second` units with any cluster keys: SPEAKER_nn by first appearance, or
    the known name."""
    order: dict[Any, str] = {}
    for _, _, cluster in turns:
        order.setdefault(cluster, label(len(order)))
    final = [Turn(round(start / per_second, 3), round(end / per_second, 3),
                  names.get(cluster, order[cluster])) for start, end, cluster in turns]
    return Diarization(final, list(dict.fromkeys(turn.speaker for turn in final)))


def _windows(start: int, end: int) -> list[tuple[int, int]]:
    """A region as one window, or as overlapping windows covering it."""
    if end - start <= MAX_WHOLE_REGION_SECONDS * SAMPLE_RATE:
        return [(start, end)]
    size, hop = int(WINDOW_SECONDS * SAMPLE_RATE), int(HOP_SECONDS * SAMPLE_RATE)
    starts = list(range(start, end - size, hop))
    if not starts or starts[-1] + size < end:
        starts.append(end - size)
    return [(s, s + size) for s in starts]


# Resemblyzer's input features, computed here as librosa computes them for it
# (resemblyzer.audio.wav_to_mel_spectrogram): librosa's own functions JIT-compile with numba,
# which costs the process ~250 MB for good the first time, unload or not.
N_FFT, HOP, MEL_CHANNELS = 400, 160, 40  # 25 ms windows, 10 ms steps at 16 kHz


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale (librosa's default): linear below 1 kHz, logarithmic above."""
    mel = hz / (200.0 / 3)
    log = hz >= 1000.0
    return np.where(log, 15.0 + np.log(np.maximum(hz, 1e-9) / 1000.0) / (np.log(6.4) / 27),
                    mel)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    hz = mel * (200.0 / 3)
    return np.where(mel >= 15.0, 1000.0 * np.exp((np.log(6.4) / 27) * (mel - 15.0)), hz)


def mel_filters(sample_rate: int = SAMPLE_RATE, n_fft: int = N_FFT,
                channels: int = MEL_CHANNELS) -> np.ndarray:
    """librosa.filters.mel(sr, n_fft, n_mels): triangular, Slaney-normalised."""
    fft_hz = np.fft.rfftfreq(n_fft, 1.0 / sample_rate)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(np.array(0.0)),
                                   _hz_to_mel(np.array(sample_rate / 2.0)), channels + 2))
    widths = np.diff(edges)
    ramps = np.subtract.outer(edges, fft_hz)
    lower = -ramps[:-2] / widths[:-1, None]
    upper = ramps[2:] / widths[1:, None]
    weights = np.maximum(0.0, np.minimum(lower, upper))
    return weights * (2.0 / (edges[2:] - edges[:-2]))[:, None]


def mel_spectrogram(wav: np.ndarray, basis: np.ndarray) -> np.ndarray:
    """(frames, MEL_CHANNELS) power mel spectrogram: librosa.feature.melspectrogram with a
    periodic Hann window, centred frames, zero padding."""
    padded = np.pad(wav.astype(np.float64), N_FFT // 2)
    count = 1 + (len(padded) - N_FFT) // HOP
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP][:count]
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)
    power = np.abs(np.fft.rfft(frames * window, axis=1)) ** 2
    return (power @ basis.T).astype(np.float32)


def _embed(handle: DiarizerHandle, clip: np.ndarray) -> np.ndarray:
    """resemblyzer's VoiceEncoder.embed_utterance, on features computed without librosa."""
    import torch
    from resemblyzer.audio import normalize_volume

    wav = normalize_volume(clip.astype(np.float32), -30, increase_only=True)
    wav_slices, mel_slices = handle.encoder.compute_partial_slices(len(wav), 1.3, 0.75)
    if wav_slices[-1].stop >= len(wav):
        wav = np.pad(wav, (0, wav_slices[-1].stop - len(wav)))
    mel = mel_spectrogram(wav, handle.mel_basis)
    with torch.no_grad():
        partials = handle.encoder(torch.from_numpy(np.array([mel[s] for s in mel_slices])))
    return _normed(partials.numpy().mean(axis=0))


def _normed(vector: np.ndarray) -> np.ndarray:
    return vector / max(float(np.linalg.norm(vector)), 1e-9)


def _cluster(embeddings: np.ndarray, windows: list[tuple[int, int]], bounds: tuple[int, int],
             pitch: np.ndarray | None = None, timbre: np.ndarray | None = None) -> np.ndarray:
    """A cluster number per window (`pitch`: each one's log-F0; `timbre`: the recording's
    speaker_bic.cepstra): found on the reliable (long) windows (workers/speaker_clusters.py),
    every window then going to the nearest centroid. A told count takes the estimate's
    speakers when it finds as many: its split checks mend what one k-way cut of the affinity
    gets wrong more often than they spoil it (bench/README.md, issue 25)."""
    lengths = np.array([end - start for start, end in windows])
    reliable = lengths >= MIN_RELIABLE_SECONDS * SAMPLE_RATE
    # too few long windows to hold the fewest speakers asked for (a quick exchange: one
    # voice's long turns, the other's short replies): every window counts
    if reliable.sum() < max(2, bounds[0] + 1):
        reliable = np.ones(len(windows), dtype=bool)
    base = embeddings[reliable]
    tone = None if pitch is None else pitch[reliable]
    kept = [w for w, keep in zip(windows, reliable, strict=True) if keep]
    if bounds[0] == bounds[1] > 1 and timbre is not None:
        estimated = _speakers(base, kept, (1, MAX_SPEAKERS), tone, timbre)
        found = (estimated if estimated.max() + 1 == bounds[0]
                 else _speakers(base, kept, bounds, tone, timbre))
    else:
        found = _speakers(base, kept, bounds, tone, timbre)
    return speaker_clusters.nearest(embeddings, base, found)


def _speakers(embeddings: np.ndarray, windows: list[tuple[int, int]], bounds: tuple[int, int],
              pitch: np.ndarray | None, timbre: np.ndarray | None) -> np.ndarray:
    """A speaker number per window: the eigen-gap's count within `bounds`, and for an
    estimated count the split checks after it (docs/backends.md, steps 3-7)."""
    ratio = None if timbre is None else speaker_bic.voice_ratio(timbre, windows)
    distinct = None if ratio is None else speaker_bic.distinct_voices(ratio)
    found = speaker_clusters.cluster(embeddings, bounds, pitch, distinct)
    if bounds[0] < bounds[1]:  # an estimated count: a speaker is more than one stray window
        found = _absorb_small(embeddings, found, bounds[0])
        found = speaker_clusters.split_mixed(embeddings, found, bounds[1], pitch, distinct)
        found = speaker_clusters.merge_small(embeddings, found, bounds[0], pitch, distinct)
        if ratio is not None:
            found = speaker_clusters.merge_alike(embeddings, found, bounds[0], pitch, ratio)
    return found


def _absorb_small(embeddings: np.ndarray, found: np.ndarray, fewest: int) -> np.ndarray:
    """Clusters of fewer than MIN_CLUSTER_WINDOWS windows join the nearest larger one (while
    more than `fewest` remain); clusters renumbered 0, 1, …"""
    sizes = np.bincount(found)
    large = [c for c in range(len(sizes)) if sizes[c] >= MIN_CLUSTER_WINDOWS]
    if not large or len(large) == len(sizes) or len(large) < fewest:
        return found
    centroids = np.stack([_normed(embeddings[found == c].mean(axis=0)) for c in large])
    nearest = np.array(large)[np.argmax(embeddings @ centroids.T, axis=1)]
    kept = np.where(np.isin(found, large), found, nearest)
    return np.unique(kept, return_inverse=True)[1]


def _turns(windows: list[tuple[int, int]], clusters: np.ndarray) -> list[tuple[int, int, int]]:
    """(start, end, cluster) turns: overlapping windows meet half-way through their overlap;
    neighbouring turns of one cluster merge across short pauses."""
    pieces: list[tuple[int, int, int]] = []
    for index, (start, end) in enumerate(windows):
        if index > 0 and windows[index - 1][1] > start:  # overlaps the previous window
            start = (start + windows[index - 1][1]) // 2
        if index + 1 < len(windows) and windows[index + 1][0] < end:
            end = (end + windows[index + 1][0]) // 2
        pieces.append((start, end, int(clusters[index])))
    merged: list[tuple[int, int, int]] = []
    for start, end, cluster in pieces:
        if (merged and merged[-1][2] == cluster
                and start - merged[-1][1] <= MERGE_GAP_SECONDS * SAMPLE_RATE):
            merged[-1] = (merged[-1][0], end, cluster)
        else:
            merged.append((start, end, cluster))
    return merged


# --- attaching speakers to a transcript ---------------------------------------------------------

def speaker_at(turns: list[Turn], start: float, end: float) -> str | None:
    """The speaker of the turns overlapping [start, end] most; the nearest turn's if none."""
    if not turns:
        return None
    overlap: dict[str, float] = {}
    for turn in turns:
        shared = min(end, turn.end) - max(start, turn.start)
        if shared > 0:
            overlap[turn.speaker] = overlap.get(turn.speaker, 0.0) + shared
    if overlap:
        return max(overlap, key=lambda speaker: overlap[speaker])
    middle = (start + end) / 2
    return min(turns, key=lambda t: max(t.start - middle, middle - t.end, 0.0)).speaker


def attach(transcription: Transcription, diarization: Diarization) -> Transcription:
    """Every segment and word gets its speaker; a segment whose words change speaker is split
    at the word boundary (segment ids renumbered). The labels are then SPEAKER_00, … in order
    of first appearance on the segments (a turn that no segment took, a noise the VAD kept, or
    a speaker under a long segment's other one, comes after them); known names stay. Fills
    `speakers`, in that order."""
    segments: list[Segment] = []
    for segment in transcription.segments:
        for piece in _split(segment, diarization.turns):
            piece.id = len(segments)
            segments.append(piece)
    appearing = [segment.speaker for segment in segments if segment.speaker is not None]
    automatic = [speaker for speaker in dict.fromkeys(
        appearing + [turn.speaker for turn in diarization.turns])
        if AUTOMATIC_LABEL.fullmatch(speaker)]
    renamed = {old: label(index) for index, old in enumerate(automatic)}
    for segment in segments:
        if segment.speaker is not None:
            segment.speaker = renamed.get(segment.speaker, segment.speaker)
        for word in segment.words or []:
            if word.speaker is not None:
                word.speaker = renamed.get(word.speaker, word.speaker)
    turns = [replace(turn, speaker=renamed.get(turn.speaker, turn.speaker))
             for turn in diarization.turns]
    transcription.segments = segments
    transcription.speakers = summary(segments, turns)
    return transcription


def _split(segment: Segment, turns: list[Turn]) -> list[Segment]:
    if not segment.words:
        segment.speaker = speaker_at(turns, segment.start, segment.end)
        return [segment]
    for word in segment.words:
        word.speaker = speaker_at(turns, word.start, word.end)
    runs: list[list[Any]] = []
    for word in segment.words:
        if runs and runs[-1][0].speaker == word.speaker:
            runs[-1].append(word)
        else:
            runs.append([word])
    if len(runs) == 1:
        segment.speaker = runs[0][0].speaker
        return [segment]
    # words that spell the text joined as they are carry their own spacing (Whisper's: a
    # leading space, or none in Chinese or Japanese); Parakeet's carry none, and get one
    glued = "".join(word.word for word in segment.words).strip() == segment.text.strip()
    pieces = []
    for index, words in enumerate(runs):
        spaced = glued or all(word.word[:1].isspace() for word in words[1:])
        text = ("" if spaced else " ").join(word.word for word in words)
        if index == 0 and not text.startswith(" ") and segment.text.startswith(" "):
            text = " " + text
        pieces.append(replace(segment, start=words[0].start if index else segment.start,
                              end=words[-1].end if index + 1 < len(runs) else segment.end,
                              text=text, speaker=words[0].speaker, words=list(words),
                              tokens=list(segment.tokens) if index == 0 else []))
    return pieces


def summary(segments: list[Segment], turns: list[Turn]) -> dict[str, dict[str, float | int]]:
    """label -> {"seconds": its speaking time, "segments": its segment count}, in order of
    first appearance on the segments, then in the turns."""
    speakers: dict[str, dict[str, float | int]] = {
        speaker: {"seconds": 0.0, "segments": 0}
        for speaker in dict.fromkeys(segment.speaker for segment in segments
                                     if segment.speaker is not None)}
    for turn in turns:
        entry = speakers.setdefault(turn.speaker, {"seconds": 0.0, "segments": 0})
        entry["seconds"] = round(float(entry["seconds"]) + turn.end - turn.start, 3)
    timed = not turns
    for segment in segments:
        if segment.speaker is None:
            continue
        entry = speakers.setdefault(segment.speaker, {"seconds": 0.0, "segments": 0})
        entry["segments"] = int(entry["segments"]) + 1
        if timed:  # an engine's own speakers (vibevoice): the time is its segments'
            entry["seconds"] = round(float(entry["seconds"]) + segment.end - segment.start, 3)
    return speakers


def own_speakers(transcription: Transcription) -> Transcription:
    """An engine that names its own speakers (vibevoice: "0", "1" …): the same label form
    (SPEAKER_00, …, by first appearance) and the same `speakers` summary."""
    order: dict[str, str] = {}
    for segment in transcription.segments:
        if segment.speaker is None:
            continue
        if segment.speaker not in order:  # every id, even one that looks like a label
            order[segment.speaker] = label(len(order))
        segment.speaker = order[segment.speaker]
        for word in segment.words or []:
            word.speaker = segment.speaker
    transcription.speakers = summary(transcription.segments, [])
    return transcription


def to_16k(audio: np.ndarray, sample_rate: int) -> np.ndarray:
    """The engine's decoded audio at the diarizer's rate (no second decode)."""
    if sample_rate == SAMPLE_RATE:
        return audio
    from scipy.signal import resample_poly

    divisor = math.gcd(SAMPLE_RATE, sample_rate)
    return resample_poly(audio, SAMPLE_RATE // divisor, sample_rate // divisor).astype(np.float32)


# --- scoring ---------------------------------------------------------------------------------

def der(reference: list[Turn], hypothesis: list[Turn], collar: float = 0.25,
        step: float = 0.01) -> float:
    """Diarization error rate: (missed + false alarm + confusion) / reference speech, in
    `step` frames, the hypothesis' speakers mapped one-to-one onto the reference's to
    minimise the error; `collar` seconds either side of each reference boundary are not
    scored (the usual 0.25 s)."""
    from scipy.optimize import linear_sum_assignment

    end = max([t.end for t in reference + hypothesis], default=0.0)
    frames = math.ceil(end / step) + 1
    times = (np.arange(frames) + 0.5) * step
    scored = np.ones(frames, dtype=bool)
    for turn in reference:
        for edge in (turn.start, turn.end):
            scored &= np.abs(times - edge) > collar
    ref_names = sorted({t.speaker for t in reference})
    hyp_names = sorted({t.speaker for t in hypothesis})

    def activity(turns: list[Turn], names: list[str]) -> np.ndarray:
        active = np.zeros((len(names), frames), dtype=bool)
        for turn in turns:
            active[names.index(turn.speaker), (times >= turn.start) & (times < turn.end)] = True
        return active[:, scored]

    ref, hyp = activity(reference, ref_names), activity(hypothesis, hyp_names)
    n_ref, n_hyp = ref.sum(axis=0), hyp.sum(axis=0)
    total = float(n_ref.sum())
    if total == 0:
        return 0.0 if n_hyp.sum() == 0 else 1.0
    # frames where a mapped pair agrees: maximise them
    agree = (ref[:, None, :] & hyp[None, :, :]).sum(axis=2).astype(float)
    rows, cols = linear_sum_assignment(-agree) if agree.size else ([], [])
    correct = float(agree[rows, cols].sum()) if agree.size else 0.0
    errors = float(np.maximum(n_ref, n_hyp).sum()) - correct
    return errors / total
