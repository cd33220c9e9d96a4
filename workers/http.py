"""The worker's own small HTTP server: `GET /health`, and direct `POST /transcribe` or
`POST /synthesize` (no queue: used by the smoke test and for debugging a worker)."""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Generator
from pathlib import Path
from typing import Annotated, Any

import uvicorn
from fastapi import FastAPI, File, Form, UploadFile
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError

from common.schemas import TranscriptionOptions
from workers.runtime import TaskError, Worker

log = logging.getLogger("worker.http")


def create_worker_app(worker: Worker) -> FastAPI:
    app = FastAPI(title=f"speech-gateway worker ({worker.backend})")

    @app.get("/health")
    async def health() -> dict[str, Any]:
        snapshot = worker.health()
        try:
            snapshot["breakers"] = await worker.open_breakers()
        except RedisError:
            snapshot["breakers"] = None  # unknown while Redis is unreachable
        return snapshot

    def model_or_default(model: str | None) -> str:
        return model or worker.settings.default_model(worker.backend) or ""

    @app.post("/transcribe")
    async def transcribe(
        file: Annotated[UploadFile, File()],
        model: Annotated[str | None, Form()] = None,
        language: Annotated[str | None, Form()] = None,
        task: Annotated[str, Form()] = "transcribe",
        word_timestamps: Annotated[bool, Form()] = False,
        prompt: Annotated[str | None, Form()] = None,
        beam_size: Annotated[int, Form()] = 5,
        vad_filter: Annotated[bool, Form()] = False,
    ) -> JSONResponse:
        if worker.engine_kind() != "asr":
            return JSONResponse({"error": "this worker synthesizes; use /synthesize"}, 400)
        data = await file.read()
        if not data:
            return JSONResponse({"error": "the uploaded file is empty"}, 400)
        options = TranscriptionOptions(language=language, task=task,
                                       word_timestamps=word_timestamps, prompt=prompt,
                                       beam_size=beam_size, vad_filter=vad_filter)
        params = {k: getattr(options, k) for k in options.__dataclass_fields__}
        try:
            outcome = await worker.execute(model_or_default(model), params, data, _ignore)
        except TaskError as exc:
            return JSONResponse({"error": str(exc), "code": exc.code}, exc.code.http_status)
        return JSONResponse(outcome.result)

    @app.post("/synthesize")
    async def synthesize(
        text: Annotated[str, Form()],
        model: Annotated[str | None, Form()] = None,
        language: Annotated[str, Form()] = "en",
        voice: Annotated[str | None, Form()] = None,
        speed: Annotated[float, Form()] = 1.0,
        speaker_wav: Annotated[UploadFile | None, File()] = None,
    ) -> Response:
        if worker.engine_kind() != "tts":
            return JSONResponse({"error": "this worker transcribes; use /transcribe"}, 400)
        reference: bytes | Path | None = None
        if speaker_wav is not None:
            reference = await speaker_wav.read()
        elif voice and voice.strip().lower() in worker.settings.voices:
            kind, target = worker.settings.voice(voice)  # a configured public voice name
            voice, reference = (target, None) if kind == "speaker" else (None, Path(target))
        params = {"text": text, "language": language, "voice": voice, "speed": speed}
        try:
            outcome = await worker.execute(model_or_default(model), params, reference or None,
                                           _ignore)
        except TaskError as exc:
            return JSONResponse({"error": str(exc), "code": exc.code}, exc.code.http_status)
        return Response(outcome.output or b"", media_type="audio/wav",
                        headers={"x-audio-seconds": str(outcome.result["audio_seconds"])})

    return app


def _ignore(_: object) -> None:
    return None


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # the worker runtime owns SIGTERM/SIGINT


async def serve_http(worker: Worker) -> None:
    """Serve on 127.0.0.1/`worker_host`:`worker_port` (0 = a free port, published in /health)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((worker.settings.worker_host, worker.settings.worker_port))
    host, port = sock.getsockname()[:2]
    worker.url = f"http://{host}:{port}"
    log.info("worker HTTP on %s", worker.url)
    config = uvicorn.Config(create_worker_app(worker), log_level="warning", access_log=False,
                            lifespan="off")
    await _Server(config).serve(sockets=[sock])
