"""pyannote.audio speaker diarization from a local pipeline directory, for GPU hosts
(`SPEECH_DIARIZATION_MODEL=pyannote:DIR`).

DIR is a pipeline checkpoint in pyannote's own layout (pyannote/speaker-diarization-community-1:
`config.yaml` naming `$model/segmentation`, `$model/embedding`, `$model/plda`), loaded with
`Pipeline.from_pretrained(DIR)`: no hub, no token. pyannote.audio 4 needs torchaudio and
torchcodec built for its torch, which the core environment's torch 2.13 (CPU) has neither of:
it runs in `.venvs/pyannote` (deploy/envs/pyannote.txt), with the ASR worker it serves.

Like the bundled diarizer this only loads, runs and unloads; the worker's model slot decides
when (workers/models.py), and counts what it holds in the memory cap and the device budget.
"""

from __future__ import annotations

import gc
import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

PREFIX = "pyannote:"
SAMPLE_RATE = 16000


@dataclass(slots=True)
class PyannoteHandle:
    pipeline: Any  # pyannote.audio.Pipeline
    device: str


def directory(source: str) -> Path | None:
    """The pipeline directory a `pyannote:DIR` source names (None: another kind of source)."""
    return Path(source[len(PREFIX):]).expanduser() if source.startswith(PREFIX) else None


def problem(source: str) -> str | None:
    """Why `source` cannot be loaded here (None: it can), found before anything is allocated."""
    path = directory(source)
    if path is None:
        return f"{source!r} is not a pyannote source ({PREFIX}DIR)"
    if not (path / "config.yaml").is_file():
        return f"{path} holds no pyannote pipeline (config.yaml)"
    if importlib.util.find_spec("pyannote.audio") is None:
        return (f"pyannote.audio is not installed in this worker's environment "
                f"({sys.prefix}): run the worker from .venvs/pyannote (deploy/envs/pyannote.txt)")
    return None


def load(source: str, device: str) -> PyannoteHandle:
    # pyannote.audio 4 sends usage metrics to its vendor unless told not to: never from here
    os.environ.setdefault("PYANNOTE_METRICS_ENABLED", "false")
    import torch
    from pyannote.audio import Pipeline

    path = directory(source)
    assert path is not None
    pipeline = Pipeline.from_pretrained(path)
    if pipeline is None:
        raise RuntimeError(f"pyannote found no pipeline in {path}")
    pipeline.to(torch.device("cuda" if device == "cuda" else "cpu"))
    return PyannoteHandle(pipeline, device)


def unload(handle: PyannoteHandle) -> None:
    handle.pipeline = None
    gc.collect()
    torch = sys.modules.get("torch")
    if handle.device == "cuda" and torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def diarize(handle: PyannoteHandle, audio: np.ndarray, bounds: tuple[int, int]
            ) -> tuple[list[tuple[float, float, str]], dict[str, np.ndarray]]:
    """(start, end, label) turns without overlaps (pyannote's exclusive diarization, the one
    made for transcripts) and each label's speaker embedding."""
    import torch

    fewest, most = bounds
    counts = ({"num_speakers": fewest} if fewest == most
              else {"min_speakers": fewest, "max_speakers": most})
    waveform = torch.from_numpy(np.ascontiguousarray(audio, dtype=np.float32))[None]
    with torch.inference_mode():
        output = handle.pipeline({"waveform": waveform, "sample_rate": SAMPLE_RATE}, **counts)
    turns = [(float(segment.start), float(segment.end), str(speaker))
             for segment, _, speaker in output.exclusive_speaker_diarization.itertracks(
                 yield_label=True)]
    labels = output.speaker_diarization.labels()
    vectors = output.speaker_embeddings
    embeddings = ({str(label): np.asarray(vectors[i]) for i, label in enumerate(labels)}
                  if vectors is not None else {})
    return sorted(turns), embeddings


def embed(handle: PyannoteHandle, clip: np.ndarray) -> np.ndarray:
    """A known speaker's reference clip in the pipeline's own embedding space."""
    import torch

    waveform = torch.from_numpy(np.ascontiguousarray(clip, dtype=np.float32))[None, None]
    with torch.inference_mode():
        vector = handle.pipeline._embedding(waveform.to(handle.pipeline.device))
    return np.asarray(vector[0])
