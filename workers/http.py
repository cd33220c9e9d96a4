"""The worker's own small HTTP server: `GET /health`, `GET /live`, and a direct `POST
/transcribe`, `/synthesize` or `/analyze`, as the backend's kind has it (no queue: used by
the smoke test and for debugging a worker).

It takes the gateway's limits (upload size while the body streams in, the upload budget,
decoded audio length, option ranges, the model's breaker, voice consent, the engine call's
bound) and, where `worker_secret` is set, a bearer token. One direct call runs at a time
(another is a 503 to retry): they wait for the engine behind and before queued tasks, each
holding its upload. Bound to anything but loopback it refuses to start without that secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import ipaddress
import json
import logging
import math
import os
import socket
from collections.abc import Awaitable, Callable, Generator
from typing import Annotated, Any

import uvicorn
from fastapi import FastAPI, File, Form, Request, UploadFile
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError
from starlette.datastructures import UploadFile as FormFile
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from common import clips
from common.audio import AudioError, probe_audio
from common.body_limit import BodyLimitMiddleware
from common.catalog import BACKENDS, KINDS, asr_language, speech_language
from common.paths import AllowedFile
from common.schemas import MAX_SPEED, MIN_SPEED, ErrorCode, TranscriptionOptions
from common.store.values import strict_json
from common.uvicorn_server import QuietServer
from workers.engine_host import EngineHost, call_limit
from workers.execute import Outcome, TaskError

log = logging.getLogger("worker.http")
#: how long a stopping worker's server lets the requests in flight finish
GRACEFUL_SHUTDOWN_SECONDS = 2
#: what /health answers: the worker's whole snapshot (the host's own when none is given)
Health = Callable[[], Awaitable[dict[str, Any]]]
#: a model's breaker: None when it may be loaded now, else why its calls fail fast
Admit = Callable[[str], Awaitable[str | None]]
#: how long a refused direct call is told to wait
BUSY_RETRY_SECONDS = 2


def create_worker_app(host: EngineHost, health: Health | None = None,
                      open_health: bool = True, admit: Admit | None = None) -> ASGIApp:
    """The worker's ASGI app over `host`; `open_health`: /health needs no secret (loopback
    binds); `admit`: the models' breakers (workers/breakers.py), asked before each call."""
    settings = host.settings
    app = FastAPI(title=f"speech-gateway worker ({host.backend})", docs_url=None,
                  redoc_url=None, openapi_url=None)
    direct = asyncio.Lock()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        message = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return _error(f"invalid request: {message}")

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _reply(str(exc.detail), "invalid_request", exc.status_code)

    async def run(model: str | None, params: dict[str, Any], source: Any,
                  work: float) -> Outcome | JSONResponse:
        """One direct call: refused at once while another runs, or while the model's breaker
        is open (a direct load failing half-way would end the worker, queued work and all);
        bounded as a task's engine call is (a call that never returns marks the worker
        stalled: it leaves, and a fresh one takes the queue)."""
        name = model or settings.default_model(host.backend) or ""
        if name not in host.sources:
            known = ", ".join(host.sources) or "none"
            return _reply(f"no model {name!r} on this worker (its models: {known})",
                          "model_not_found", 404)
        if direct.locked():
            return _reply("a direct call is already running on this worker; retry shortly",
                          "overloaded", 503, {"Retry-After": str(BUSY_RETRY_SECONDS)})
        async with direct:
            if admit is not None:
                try:
                    why = await admit(name)
                except RedisError:
                    why = None  # no store to ask: try the load (as the preload does)
                if why:
                    return _error(why, ErrorCode.MODEL_UNAVAILABLE)
            try:
                return await host.execute(name, params, source, _ignore,
                                          limit_seconds=call_limit(settings, host.kind, work))
            except TaskError as exc:
                return _error(str(exc), exc.code)
            except RedisError:  # the device broker's store is out of reach
                return _reply("the worker's store is unavailable; retry shortly",
                              "store_unavailable", 503,
                              {"Retry-After": str(BUSY_RETRY_SECONDS)})

    @app.get("/health")
    async def health_route() -> dict[str, Any]:
        return await health() if health is not None else host.health()

    # A liveness probe's: the worker's event loop answers. It tells nothing, so it needs no
    # secret (a kubelet's httpGet cannot read one from a Secret); a TCP probe would pass on a
    # wedged process too, since the kernel completes the handshake into the backlog.
    @app.get("/live")
    async def live_route() -> dict[str, bool]:
        return {"alive": True}

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
        temperature: Annotated[float, Form()] = 0.0,
    ) -> JSONResponse:
        if host.kind != "asr":
            return _wrong_endpoint(host)
        try:  # the gateway's spellings ("EN", "en-US", "auto")
            code = asr_language(host.backend, language) if language else None
        except ValueError as exc:
            return _error(str(exc))
        params = {"language": code, "task": task, "word_timestamps": word_timestamps,
                  "prompt": prompt, "beam_size": beam_size, "vad_filter": vad_filter,
                  "temperature": temperature}
        try:
            TranscriptionOptions.from_params(params)  # before waiting for the engine
        except ValueError as exc:
            return _error(str(exc))
        data = await file.read()
        if not data:
            return _error("the uploaded file is empty", ErrorCode.INVALID_AUDIO)
        if (info := await _probed(data)) is None:
            return _error("the upload is not audio this worker can decode",
                          ErrorCode.INVALID_AUDIO)
        outcome = await run(model, params, data, info)
        return outcome if isinstance(outcome, JSONResponse) else _result(outcome.result)

    @app.post("/synthesize")
    async def synthesize(
        text: Annotated[str, Form()],
        model: Annotated[str | None, Form()] = None,
        language: Annotated[str, Form()] = "en",
        voice: Annotated[str | None, Form()] = None,
        speed: Annotated[float, Form()] = 1.0,
        speaker_wav: Annotated[UploadFile | None, File()] = None,
    ) -> Response:
        if host.kind != "tts":
            return _wrong_endpoint(host)
        text = text.strip()
        if not text or len(text) > settings.tts_max_characters:
            return _error(f"'text' must have 1 to {settings.tts_max_characters} characters")
        if not (math.isfinite(speed) and MIN_SPEED <= speed <= MAX_SPEED):
            return _error(f"speed must be a number from {MIN_SPEED} to {MAX_SPEED}")
        try:
            language = speech_language(host.backend, language)
        except ValueError as exc:
            return _error(str(exc))
        if voice and speaker_wav is not None:
            return _error("give either 'voice' or 'speaker_wav', not both")
        reference: bytes | AllowedFile | None = None
        if speaker_wav is not None:  # the gateway's rules: a clone needs a recorded consent
            if settings.require_voice_consent:
                return _reply("this service clones only voices with a recorded consent: use "
                              "a configured voice", "consent_required", 403)
            reference = await speaker_wav.read()
            if not reference:
                return _error("the uploaded speaker_wav is empty", ErrorCode.INVALID_AUDIO)
            if await _probed(reference) is None:
                return _error("the uploaded speaker_wav is not audio this worker can decode",
                              ErrorCode.INVALID_AUDIO)
        else:  # a configured public voice name (none: the first); never a raw speaker
            try:
                kind, target = settings.voice(voice)
            except (KeyError, ValueError):
                known = ", ".join(settings.voices) or "none"
                return _reply(f"unknown voice {voice!r} (configured voices: {known})",
                              "unknown_voice", 400)
            if kind == "speaker":
                voice = target
            else:
                voice, reference = None, AllowedFile(target, tuple(settings.allowed_roots))
        params = {"text": text, "language": language, "voice": voice, "speed": speed}
        outcome = await run(model, params, reference, len(text))
        if isinstance(outcome, JSONResponse):
            return outcome
        return Response(outcome.output or b"", media_type="audio/wav",
                        headers={"x-audio-seconds": str(outcome.result["audio_seconds"])})

    @app.post("/analyze")
    async def analyze(request: Request) -> JSONResponse:
        """An analysis backend's clips as uploads under their declared names, its params and
        `model` as form fields (what /api/config lists under `inputs` and `params`)."""
        if host.kind != "analysis":
            return _wrong_endpoint(host)
        row = BACKENDS[host.backend]
        try:
            form = await request.form(max_files=len(row.inputs),
                                      max_fields=len(row.params) + 1)
        except Exception as exc:  # starlette raises HTTPException/MultiPartException variants
            return _error(f"malformed form body: {getattr(exc, 'detail', exc)}")
        fields = {key: value for key, value in form.items() if not isinstance(value, FormFile)}
        params: dict[str, Any] = {}
        for param in row.params:
            try:
                params[param.name] = param.value(fields.get(param.name))
            except ValueError as exc:
                return _error(str(exc))
        uploads: dict[str, bytes] = {}
        for clip in row.inputs:
            upload = form.get(clip.name)
            if isinstance(upload, FormFile):
                uploads[clip.name] = await upload.read()
                if not uploads[clip.name]:
                    return _error(f"the uploaded {clip.name!r} is empty", ErrorCode.INVALID_AUDIO)
            elif clip.required:
                return _error(f"upload the {clip.name!r} clip")
        model = fields.get("model")
        outcome = await run(model if isinstance(model, str) else None, params,
                            clips.pack(uploads), 0.0)
        return outcome if isinstance(outcome, JSONResponse) else _result(outcome.result)

    # as the gateway's: the bodies of the calls in progress share the upload budget (a call
    # alone always passes), and a body that trickles is cut off
    limited = BodyLimitMiddleware(
        app, max_bytes=settings.max_body_bytes, idle_seconds=settings.body_timeout_seconds,
        deadline_seconds=settings.body_deadline_seconds, error_reply=_body_refused,
        budget_bytes=int(settings.upload_budget_mib * 2**20))
    if not settings.worker_secret:
        return limited
    # Outside the body limit: a request without the secret is refused before its body is read.
    return RequireSecret(limited, settings.worker_secret,
                         frozenset({"/health", "/live"}) if open_health
                         else frozenset({"/live"}),
                         drain_bytes=settings.max_body_bytes)


def _wrong_endpoint(host: EngineHost) -> JSONResponse:
    kind = host.kind
    return _error(f"this is a {kind} worker; use {KINDS[kind].worker_path}")


def _result(result: dict[str, Any] | None) -> Response:
    """A direct call's result as JSON every parser reads (a NaN or an infinity is null:
    JSONResponse would raise on it, a 500)."""
    return Response(strict_json(result), media_type="application/json")


def _error(message: str, code: ErrorCode = ErrorCode.INVALID_REQUEST) -> JSONResponse:
    return _reply(message, code.value, code.http_status)


def _reply(message: str, code: str, status: int,
           headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse({"error": message, "code": code}, status, headers=headers)


async def _body_refused(scope: Scope, status_code: int, message: str,
                        code: str) -> tuple[int, dict[str, Any]]:
    return status_code, {"error": message, "code": code or "invalid_request"}


async def _probed(data: bytes) -> float | None:
    """The upload's length (seconds) as its container tells it; None when it is no audio
    (refused before it waits for the engine, and before a model is loaded for it)."""
    try:
        return (await asyncio.to_thread(probe_audio, data)).duration
    except AudioError:
        return None


def _ignore(_: object) -> None:
    return None


class RequireSecret:
    """ASGI middleware: every HTTP request but `open_paths` carries `Authorization: Bearer
    <secret>` (compared in constant time), else a 401. A refused request's body is read and
    dropped first, up to `drain_bytes` (what the route would have read had the secret been
    right) and for at most DRAIN_SECONDS."""

    def __init__(self, app: ASGIApp, secret: str, open_paths: frozenset[str],
                 drain_bytes: int) -> None:
        self.app = app
        self.expected = f"Bearer {secret}".encode()
        self.open_paths = open_paths
        self.drain_bytes = drain_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in self.open_paths:
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(given, self.expected):
                await _drain(receive, self.drain_bytes)
                payload = json.dumps({"error": "this worker needs its secret: "
                                               "Authorization: Bearer <SPEECH_WORKER_SECRET>",
                                      "code": "unauthorized"}).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(payload)).encode()),
                                        (b"www-authenticate", b"Bearer"),
                                        (b"connection", b"close")]})
                await send({"type": "http.response.body", "body": payload})
                return
        await self.app(scope, receive, send)


#: a refused request's body is read (and dropped) for at most this long
DRAIN_SECONDS = 2.0


async def _drain(receive: Receive, most_bytes: int) -> None:
    """Read what is left of the request body, within bounds, before a refusal: a socket
    closed with unread bytes in it is reset, and the reset takes the refusal with it (the
    client sees "connection reset", not the 401 it was sent). A bound below the uploads the
    worker takes would bring the reset back for the large ones (a 1 MiB bound did, for
    jfk.flac's 1.15 MB)."""
    taken = 0
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DRAIN_SECONDS):
            while taken <= most_bytes:
                message = await receive()
                taken += len(message.get("body", b""))
                if message["type"] != "http.request" or not message.get("more_body"):
                    return


def is_loopback(host: str) -> bool:
    """True when every address `host` names is a loopback address ("" and 0.0.0.0 are not)."""
    try:
        infos = socket.getaddrinfo(host, None) if host else []
    except socket.gaierror:
        return False
    addresses = {info[4][0] for info in infos}
    return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)


def listening_socket(host: str, port: int) -> socket.socket:
    """A socket bound to `host`:`port`, IPv6 for an IPv6 address (a pod IP on an IPv6
    cluster), as the gateway's own bind (gateway/process/launcher.py)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def socket_url(sock: socket.socket) -> str:
    """The URL a bound socket serves on, an IPv6 host in brackets."""
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Server(QuietServer):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # the worker runtime owns SIGTERM/SIGINT


async def serve_http(host: EngineHost, health: Health | None = None,
                     on_bound: Callable[[str, int], None] | None = None,
                     listen_fd: int | None = None, admit: Admit | None = None) -> None:
    """Serve on `worker_host`:`worker_port` (0 = a free port, told to `on_bound` with a
    duplicate of the socket's fd: the runtime publishes the URL in /health, and hands the
    socket over when it re-execs the process), or on the socket `listen_fd` an earlier image
    of this process handed over (same port; connections made meanwhile waited in its
    backlog); `admit`: the models' breakers.

    Off loopback without `worker_secret` it does not bind at all: it raises, and the worker
    exits (a direct endpoint open to the network would bypass every gateway key)."""
    settings = host.settings
    loopback = is_loopback(settings.worker_host)
    if not loopback and not settings.worker_secret:
        log.critical("refusing to serve worker HTTP on %r: not a loopback address and "
                     "SPEECH_WORKER_SECRET is empty; set a secret or bind 127.0.0.1",
                     settings.worker_host)
        raise RuntimeError("worker HTTP off loopback needs SPEECH_WORKER_SECRET")
    if listen_fd is not None:
        sock = socket.socket(fileno=listen_fd)
        sock.set_inheritable(False)
    else:
        sock = listening_socket(settings.worker_host, settings.worker_port)
    url = socket_url(sock)
    if on_bound is not None:
        on_bound(url, os.dup(sock.fileno()))  # its own fd: open whatever uvicorn closes
    log.info("worker HTTP on %s (%s)", url,
             "secret required" if settings.worker_secret else "no secret: loopback only")
    config = uvicorn.Config(create_worker_app(host, health, open_health=loopback, admit=admit),
                            log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS)
    server = _Server(config)
    serving = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        await asyncio.shield(serving)
    except asyncio.CancelledError:
        # The worker is leaving (or re-exec'ing): uvicorn's own shutdown closes kept-alive
        # connections (a client sees a close, not a reset) and lets a reply in flight end.
        server.stop()
        with contextlib.suppress(Exception):
            await serving
        raise
