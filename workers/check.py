"""Run one engine call in-process, without Redis or HTTP: an operator's and a test's probe.

    python -m workers.check --backend qwen3 --model-source models/tiny/qwen3 audio.flac
    python -m workers.check --backend xtts --model-source DIR --text "Hello there."
    python -m workers.check --backend voiceprint --model-source bundled a.wav --clip reference=b.wav

Prints the result as JSON (for TTS: the synthesis length; `--out` writes a WAV). An analysis
backend runs through the worker's own path (workers.execute: decode, params checked).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import cast

import numpy as np

from common import clips
from common.audio import decode_audio, encode_wav
from common.backends import BACKENDS
from common.schemas import SynthesisOptions, TranscriptionOptions
from common.settings import get_settings
from workers.engines import create_engine
from workers.engines.base import ModelRef, SpeechEngine, TranscriptionEngine
from workers.execute import run_engine


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", required=True)
    parser.add_argument("--model-source", required=True, help="model directory, file or hub id")
    parser.add_argument("--model-name", default="check")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--language")
    parser.add_argument("--task", default="transcribe")
    parser.add_argument("--word-timestamps", action="store_true")
    parser.add_argument("--text", help="text to speak (TTS engines)")
    parser.add_argument("--voice")
    parser.add_argument("--out", type=Path, help="where to write synthesized audio (WAV)")
    parser.add_argument("--repeat", type=int, default=1, help="run the call N times")
    parser.add_argument("--clip", action="append", default=[], metavar="NAME=PATH",
                        help="another clip an analysis backend declares (repeatable)")
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                        help="a param an analysis backend declares (repeatable)")
    parser.add_argument("audio", nargs="?",
                        help="input audio (ASR), reference clip (TTS), main clip (analysis)")
    args = parser.parse_args(argv)
    kind = BACKENDS[args.backend].kind

    engine = create_engine(args.backend, get_settings())  # options from SPEECH_* env
    started = time.perf_counter()
    handle = engine.load(ModelRef(args.model_name, args.model_source), args.device)
    engine.warm_up(handle)
    load_seconds = time.perf_counter() - started
    audio = decode_audio(args.audio, engine.sample_rate) if args.audio else None
    outputs = []
    for _ in range(args.repeat):
        started = time.perf_counter()
        if kind == "analysis":
            uploads = {"file": Path(args.audio).read_bytes()}
            uploads |= {name: Path(path).read_bytes()
                        for name, path in (item.split("=", 1) for item in args.clip)}
            output = run_engine(engine, handle, backend=args.backend, model=args.model_name,
                                params=dict(item.split("=", 1) for item in args.param),
                                source=clips.pack(uploads), on_segment=lambda segment: None).result
        elif kind == "tts" and args.text is not None:
            options = SynthesisOptions(text=args.text, language=args.language or "en",
                                       voice=args.voice)
            pieces = list(cast(SpeechEngine, engine).speak(handle, options, audio))
            samples = np.concatenate([piece.audio for piece in pieces])
            rate = pieces[0].sample_rate
            if args.out:
                args.out.write_bytes(encode_wav(samples, rate))
            output = {"audio_seconds": len(samples) / rate, "sample_rate": rate,
                      "pieces": len(pieces)}
        else:
            options = TranscriptionOptions(language=args.language, task=args.task,
                                           word_timestamps=args.word_timestamps)
            transcription = cast(TranscriptionEngine, engine).transcribe(
                handle, audio, options, lambda segment: None)
            output = transcription.to_result(args.backend, args.model_name,
                                              args.word_timestamps)
        output["seconds"] = round(time.perf_counter() - started, 3)
        outputs.append(output)
    engine.unload(handle)
    json.dump({"load_seconds": round(load_seconds, 3), "results": outputs}, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
