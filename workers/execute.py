"""One engine call for one task: decode the input, run the engine, shape the result, and
say in one TaskError why a call failed.

What a call takes and gives follows the backend's kind (common/backends.py): ASR decodes one
clip and streams segments, TTS decodes an optional voice clip and hands each spoken piece to
its `SpeechProgress` as it is done (then returns the whole WAV), analysis decodes the clips
the row declares and returns the engine's JSON."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from common import clips
from common.audio import AudioError, AudioTooLong, decode_audio, pcm16, wav_from_pcm
from common.backends import BACKENDS
from common.paths import AllowedFile
from common.schemas import (
    MAX_REFERENCE_SECONDS,
    DiarizationOptions,
    ErrorCode,
    Segment,
    SpeechChunk,
    SynthesisOptions,
    TranscriptionOptions,
)
from workers import diarize, memory
from workers.engines.base import AnalysisEngine, Engine, SpeechEngine, TranscriptionEngine

#: an engine call's input: bytes (an upload), a path the worker trusts, or a file a request
#: named, checked against the allowed roots as it is opened
Source = bytes | Path | AllowedFile
#: told an ASR or analysis task's decoded length (seconds) before its engine runs; raises (a
#: TaskError) to refuse the task: a container can understate its length to the submit's probe,
#: and what the submit did not charge, or reserve device memory for, is settled here
OnDecoded = Callable[[float], None]
MEMORY_LIMIT_ERROR = "GPU memory limit reached for this file"
#: the start of a speech task's reference clip that is decoded: XTTS conditions on its first
#: `max_ref_len` seconds (30 in its released config); the rest of a long clip (allowed up to
#: SPEECH_MAX_AUDIO_SECONDS, 4 h) was decoded, into memory, for nothing, on a task charged
#: by its text
REFERENCE_SECONDS = 60.0


class TaskError(Exception):
    """The task cannot succeed (bad audio, engine error, out of memory); no retry."""

    def __init__(self, message: str, code: ErrorCode = ErrorCode.ENGINE_ERROR) -> None:
        super().__init__(message)
        self.code = code


def stream_delta(text: str, texts_before: int, separator: str) -> str:
    """A segment's text as a stream's delta, so that the deltas add up to the transcript the
    engine joins with `separator` (its `segment_separator`): the first without its leading
    space, later ones with the separator where the text does not begin with a space."""
    if not texts_before:
        return text.lstrip()
    return text if not text or text[:1].isspace() else separator + text


def task_error(exc: Exception) -> TaskError:
    """A fresh, traceback-free TaskError saying why an engine call failed."""
    if isinstance(exc, TaskError):
        return TaskError(str(exc), exc.code)
    if isinstance(exc, AudioTooLong):
        return TaskError(str(exc), ErrorCode.AUDIO_TOO_LONG)
    if isinstance(exc, AudioError):
        return TaskError(str(exc), ErrorCode.INVALID_AUDIO)
    if memory.is_out_of_memory(exc):
        return TaskError(MEMORY_LIMIT_ERROR, ErrorCode.OUT_OF_MEMORY)
    if isinstance(exc, ValueError):
        return TaskError(str(exc), ErrorCode.INVALID_REQUEST)
    return TaskError(f"{type(exc).__name__}: {exc}")


@dataclass(slots=True)
class SpeechProgress:
    """A TTS task's pieces so far: those a previous attempt stored (this one resumes after
    them: sampling is not deterministic, and a client may already have heard them), and
    `store`, called on the engine thread with each new piece, which returns once the piece
    is durable (or raises, to stop a stale attempt)."""

    done: list[SpeechChunk]
    store: Callable[[SpeechChunk], None]


@dataclass(slots=True)
class Outcome:
    result: dict[str, Any]
    output: bytes | None = None  # synthesized audio (WAV), stored as the task's output blob


def run_engine(
    engine: Engine,
    handle: Any,
    *,
    backend: str,
    model: str,
    params: dict[str, Any],
    source: Source | None,
    on_segment: Callable[[Segment], None],
    max_audio_seconds: float | None = None,
    allowed_roots: tuple[Path, ...] = (),
    diarizer: tuple[diarize.Diarizer, Any] | None = None,
    speech: SpeechProgress | None = None,
    on_decoded: OnDecoded | None = None,
    max_speech_seconds: float | None = None,
) -> Outcome:
    """`max_audio_seconds` bounds the decoded input (AudioTooLong past it), `max_speech_seconds`
    a TTS task's output (`audio_too_long` when a piece would pass it); `allowed_roots`
    are what the paths in a task's options are checked against as they are opened;
    `diarizer` (and its handle) runs after an ASR engine when the task asks for speakers;
    `speech` takes a TTS task's pieces as they are spoken (none: only the whole WAV).
    What the engine does is the backend's kind in the table."""
    kind = BACKENDS[backend].kind
    if kind == "tts":
        return _synthesize(cast(SpeechEngine, engine), handle, backend, model, params, source,
                           max_audio_seconds, speech, max_speech_seconds)
    if kind == "analysis":
        return _analyze(cast(AnalysisEngine, engine), handle, backend, model, params, source,
                        max_audio_seconds, allowed_roots, on_decoded)
    transcriber = cast(TranscriptionEngine, engine)
    options = TranscriptionOptions.from_params(params)
    speakers = DiarizationOptions.from_params(params)
    row = BACKENDS[backend]
    sources = _asr_sources(source, params, allowed_roots)
    if "file" not in sources:
        raise ValueError("no input audio")
    with_words = options.word_timestamps
    if speakers is not None and row.word_timestamps and not row.speakers:
        options.word_timestamps = True  # a segment that changes speaker splits between words
    audio = _decode(sources["file"], transcriber.sample_rate, max_audio_seconds)
    if on_decoded is not None:
        on_decoded(len(audio) / transcriber.sample_rate)
    references: dict[str, np.ndarray] = {}
    if speakers is not None and not row.speakers:
        if diarizer is None:
            raise ValueError(f"{backend} has no diarizer loaded")
        # every clip is decoded and checked before the engine runs: a bad reference found
        # after the transcript was streamed would fail a task whose output was delivered
        references = {name: diarizer[0].reference(
                          diarizer[1], name,
                          _decode(sources[clip], diarize.SAMPLE_RATE, MAX_REFERENCE_SECONDS))
                      for name, clip in zip(speakers.names, speakers.references, strict=True)}
    transcription = transcriber.transcribe(handle, audio, options, on_segment)
    if speakers is not None and row.speakers:  # its own speakers, in the diarizer's labels
        diarize.own_speakers(transcription)
    elif speakers is not None and diarizer is not None:
        try:
            found = diarizer[0].diarize(diarizer[1],
                                        diarize.to_16k(audio, transcriber.sample_rate),
                                        speakers, references)
        except (TaskError, MemoryError):
            raise
        except Exception as exc:  # its input was checked before: this is the diarizer's own
            if memory.is_out_of_memory(exc):  # (a client's error would be a ValueError's 400)
                raise
            raise TaskError(f"the diarizer failed: {type(exc).__name__}: {exc}",
                            ErrorCode.ENGINE_ERROR) from None
        diarize.attach(transcription, found)
    del audio
    return Outcome(transcription.to_result(backend, model, with_words))


def asr_audio(source: Source | None, params: dict[str, Any], sample_rate: int,
              max_audio_seconds: float | None, allowed_roots: tuple[Path, ...],
              on_decoded: OnDecoded | None = None) -> np.ndarray:
    """An ASR task's main clip, decoded (and told) as `run_engine` decodes it."""
    sources = _asr_sources(source, params, allowed_roots)
    if "file" not in sources:
        raise ValueError("no input audio")
    audio = _decode(sources["file"], sample_rate, max_audio_seconds)
    if on_decoded is not None:
        on_decoded(len(audio) / sample_rate)
    return audio


def _asr_sources(source: Source | None, params: dict[str, Any],
                 allowed_roots: tuple[Path, ...]) -> dict[str, Source]:
    """The main clip `file` and, for known speakers, their clips: uploads packed in the input
    blob (`clips_packed`), paths in `clip_paths`."""
    sources: dict[str, Source] = {}
    if isinstance(source, bytes) and params.get("clips_packed"):
        sources.update(clips.unpack(source))
    elif source is not None:
        sources["file"] = source
    for name, path in (params.get("clip_paths") or {}).items():
        sources[name] = AllowedFile(str(path), allowed_roots)
    if missing := [name for name in (params.get("diarization") or {}).get("references", [])
                   if name not in sources]:
        raise AudioError(f"the task's {', '.join(missing)} audio is missing or has expired")
    return sources


def _decode(source: Source, sample_rate: int, max_seconds: float | None,
            first_seconds: float | None = None) -> np.ndarray:
    if isinstance(source, AllowedFile):
        with source.open() as handle:
            return decode_audio(handle, sample_rate, max_seconds, first_seconds)
    return decode_audio(source, sample_rate, max_seconds, first_seconds)


def _synthesize(engine: SpeechEngine, handle: Any, backend: str, model: str,
                params: dict[str, Any], reference_source: Source | None,
                max_audio_seconds: float | None, speech: SpeechProgress | None,
                max_speech_seconds: float | None) -> Outcome:
    """The WAV is exactly the pieces' samples joined: what a streaming client got is what
    `output_url` serves. A piece that would take it past `max_speech_seconds` is not stored:
    the task fails there (what was spoken before stays charged)."""
    options = SynthesisOptions(**{k: v for k, v in params.items()
                                  if k in SynthesisOptions.__dataclass_fields__})
    reference = (_decode(reference_source, engine.sample_rate, max_audio_seconds,
                         REFERENCE_SECONDS) if reference_source is not None else None)
    done = speech.done if speech is not None else []
    pieces = [chunk.pcm for chunk in done]
    rate = done[0].sample_rate if done else 0
    seconds_spoken = sum(len(pcm) for pcm in pieces) / 2 / rate if rate else 0.0
    spoken = engine.speak(handle, options, reference, start=len(done))
    for index, piece in enumerate(spoken, start=len(done)):
        if rate and piece.sample_rate != rate:
            raise TaskError(f"the engine spoke at {piece.sample_rate} Hz after {rate} Hz")
        rate = piece.sample_rate
        seconds_spoken += len(piece.audio) / rate
        if max_speech_seconds is not None and seconds_spoken > max_speech_seconds:
            raise TaskError(f"the speech runs past {max_speech_seconds:g} s, the most one task "
                            f"may make (sentence {index + 1}, at speed {options.speed:g}): "
                            "split the text into shorter requests or speak it faster",
                            ErrorCode.AUDIO_TOO_LONG)
        chunk = SpeechChunk(index, pcm16(piece.audio), rate, piece.characters)
        if speech is not None:
            speech.store(chunk)
        pieces.append(chunk.pcm)
    if not rate:
        raise ValueError("the text is empty")
    pcm, count = b"".join(pieces), len(pieces)
    del pieces
    seconds = round(len(pcm) / 2 / rate, 3)
    usage = {"characters": len(options.text), "audio_seconds": seconds}
    result = {"audio_seconds": seconds, "sample_rate": rate, "format": "wav",
              "characters": len(options.text), "pieces": count,
              "usage": usage, "backend": backend, "model": model}
    return Outcome(result, wav_from_pcm(pcm, rate))


def _analyze(engine: AnalysisEngine, handle: Any, backend: str, model: str,
             params: dict[str, Any], source: Source | None, max_audio_seconds: float | None,
             allowed_roots: tuple[Path, ...], on_decoded: OnDecoded | None) -> Outcome:
    """The clips (uploads in the input blob, paths in `clip_paths`) and the params the row
    declares, checked again here (whatever queued them)."""
    row = BACKENDS[backend]
    sources: dict[str, Source] = {}
    if isinstance(source, bytes):
        sources.update(clips.unpack(source))
    elif source is not None:  # a trusted caller's own file: the main clip
        sources[row.inputs[0].name] = source
    for name, path in (params.get("clip_paths") or {}).items():
        sources[name] = AllowedFile(str(path), allowed_roots)
    declared = {clip.name for clip in row.inputs}
    if unknown := sorted(set(sources) - declared):
        raise ValueError(f"{backend} takes no clip named {', '.join(unknown)}")
    if missing := [clip.name for clip in row.inputs if clip.required and clip.name not in sources]:
        raise AudioError(f"the task's {', '.join(missing)} audio is missing or has expired")
    values = {param.name: param.value(params.get(param.name)) for param in row.params}
    decoded = {name: _decode(item, engine.sample_rate, max_audio_seconds)
               for name, item in sources.items()}
    seconds = round(sum(len(audio) for audio in decoded.values()) / engine.sample_rate, 3)
    if on_decoded is not None:
        on_decoded(seconds)
    result = engine.analyze(handle, decoded, values)
    del decoded
    return Outcome({**result, "usage": {"audio_seconds": seconds}, "backend": backend,
                    "model": model})
