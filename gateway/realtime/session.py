"""One transcription session: its config, input buffer and turns.

A committed turn is an ordinary task on its backend's queue, in the `interactive` lane that
workers read before batch work (gateway/submit/enqueue.py's `enqueue`, as every OpenAI call), so
it has every lifecycle guarantee: one terminal state, redelivery when its worker dies, the
memory cap, the model's breaker. The session listens to the task's events like any waiting
call (one pub/sub connection per gateway process, `EventHub`): each segment the worker
publishes is a `...delta`, the terminal state a `...completed` or `...failed`. Every
committed item gets exactly one of those two.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from common.audio import AudioInfo
from common.catalog import (
    UnknownBackend,
    UnknownModel,
    asr_language,
    model_language_problem,
    resolve_public_model,
)
from common.schemas import INTERACTIVE, MAX_PROMPT_CHARACTERS, TaskState
from common.settings import Settings
from common.store import Task, new_task_id
from gateway.errors import RequestError, openai_error
from gateway.realtime.buffer import (
    MIN_COMMIT_MS,
    InputBuffer,
    SpeechStarted,
    Turn,
    decode_chunk,
)
from gateway.realtime.protocol import (
    DELAYS,
    ClientEvent,
    ProtocolError,
    SessionConfig,
    Transcription,
    error_event,
    new_id,
    read_event,
    server_event,
    updated,
)
from gateway.realtime.vad import SAMPLE_RATE
from gateway.serving.calls import (
    Deltas,
    SyncCalls,
    metered_seconds,
    still_running,
    task_failed,
)
from gateway.submit.asr import AsrRequest, asr_options
from gateway.submit.audio import AudioInput
from gateway.submit.terms import SubmitTerms

log = logging.getLogger("gateway.realtime")

Send = Callable[[dict[str, Any]], Awaitable[None]]
TRANSCRIPTION = "conversation.item.input_audio_transcription"
MODEL_PARAM = "session.audio.input.transcription"
#: the most of the earlier turns' text a turn's prompt carries (Whisper reads only its last
#: 224 tokens of prompt anyway)
PREVIOUS_TEXT_CHARACTERS = 800


class SessionEnded(ProtocolError):
    """A limit ends the session: the error is sent, pending turns finish, the socket closes."""


@dataclass(frozen=True, slots=True)
class Target:
    """Where a turn goes: the backend, model and task options of the session's transcription."""

    backend: str
    model: str
    options: dict[str, Any]


def resolve(settings: Settings, transcription: Transcription,
            event_id: str | None = None) -> Target:
    """The transcription config checked like an OpenAI call's fields (model, language,
    prompt); ProtocolError naming the field."""
    try:
        backend, model = resolve_public_model(settings, transcription.model, "asr")
    except (UnknownModel, UnknownBackend) as exc:
        raise ProtocolError("invalid_value", f"{exc}; GET /v1/models lists them",
                            f"{MODEL_PARAM}.model", event_id) from None
    request = AsrRequest(
        language=transcription.language or _first_supported(settings, backend, model,
                                                            transcription.languages),
        prompt=" ".join(filter(None, (transcription.prompt, ", ".join(transcription.keywords)))),
        beam_size=DELAYS.get(transcription.delay or "medium"))
    try:
        options = asr_options(request, settings, backend)
    except RequestError as exc:
        name = "keywords" if exc.param == "prompt" and transcription.keywords else exc.param
        raise ProtocolError("invalid_value", exc.message, f"{MODEL_PARAM}.{name}",
                            event_id) from None
    if problem := model_language_problem(settings, backend, model, options.get("language")):
        raise ProtocolError("unsupported_language", problem, f"{MODEL_PARAM}.language",
                            event_id)
    return Target(backend, model, options)


def _first_supported(settings: Settings, backend: str, model: str,
                     languages: tuple[str, ...]) -> str | None:
    """`languages[]`: the first one the backend and the model take; none of them: detect."""
    for language in languages:
        try:
            code = asr_language(backend, language)
        except ValueError:
            continue
        if not model_language_problem(settings, backend, model, code):
            return code
    return None


def turn_prompt(prompt: str, earlier: list[str]) -> str:
    """A turn's prompt: the session's (its prompt and keywords), then the tail of the earlier
    turns' text, so a short turn keeps its context (the file path, given the same prompt,
    reads the same span of audio the same way)."""
    history = " ".join(text.strip() for text in earlier if text.strip())
    room = min(PREVIOUS_TEXT_CHARACTERS, MAX_PROMPT_CHARACTERS - len(prompt) - 1)
    if len(history) > room:
        history = history[len(history) - room:].split(" ", 1)[-1]
    return " ".join(filter(None, (prompt, history if room > 0 else "")))


class Session:
    def __init__(self, settings: Settings, calls: SyncCalls, owner: str, send: Send) -> None:
        self.settings = settings
        self.calls = calls
        self.owner = owner
        self._send = send
        self.id = new_id("sess")
        self.config = SessionConfig()
        self.buffer = InputBuffer(self.config.rate, self.config.turn_detection,
                                  int(settings.realtime_max_buffer_seconds * SAMPLE_RATE))
        self.opened = time.monotonic()
        self.last_activity = self.opened
        self.ended: SessionEnded | None = None
        self.turns: set[asyncio.Task[None]] = set()
        # seconds of audio in turns to be queued as tasks (charged as such; a turn refused
        # before its task was queued is taken off again, and the meter charges it)
        self.turned = 0.0
        self._queued: set[str] = set()  # turns whose task was queued
        #: the error each turn still pending gets when a limit ends the session
        self._ending: dict[str, Any] | None = None
        self._previous_item: str | None = None
        self._speech_item: str | None = None
        #: each committed item's transcript once known ("" if it failed), in commit order
        self._texts: dict[str, str] = {}
        self._last_turn: asyncio.Task[None] | None = None
        self._target: Target | None = None
        with contextlib.suppress(ProtocolError):  # no ASR backend: each turn fails, saying so
            self._target = resolve(settings, self.config.transcription or Transcription())

    async def open(self, preset: dict[str, Any] | None = None) -> None:
        """session.created, with the session an ephemeral key was minted with applied."""
        if preset:
            with contextlib.suppress(ProtocolError):  # checked when the key was minted
                config = updated(self.config, preset, None)
                self._apply(config, self._target_of(config, None))
        await self._send(server_event("session.created", session=self.config.public(self.id)))

    async def handle(self, text: str) -> None:
        """One client message; a refusal is an `error` event, and the session goes on (a
        SessionEnded sets `ended`)."""
        self.last_activity = time.monotonic()
        try:
            event = read_event(text)
            if event.type == "session.update":
                await self._update(event)
            elif event.type == "input_audio_buffer.append":
                await self._append(event)
            elif event.type == "input_audio_buffer.commit":
                await self._commit(event)
            else:  # input_audio_buffer.clear
                self.buffer.clear()
                self._speech_item = None
                await self._send(server_event("input_audio_buffer.cleared"))
        except SessionEnded as ended:
            await self.end(ended)
        except ProtocolError as error:
            await self.handle_error(error)

    async def handle_error(self, error: ProtocolError) -> None:
        await self._send(error_event(error))

    async def end(self, ended: SessionEnded) -> None:
        self.ended = ended
        await self._send(error_event(ended))

    def timer_expired(self) -> SessionEnded | None:
        """The wall-clock limits: the session's length, and idleness (no client message and no
        turn being transcribed)."""
        now = time.monotonic()
        if now - self.opened >= self.settings.realtime_max_session_seconds:
            return SessionEnded("session_expired", "the session reached its maximum length of "
                                f"{self.settings.realtime_max_session_seconds:.0f} s")
        if self.turns:
            self.last_activity = now
        elif now - self.last_activity >= self.settings.realtime_idle_timeout_seconds:
            return SessionEnded("idle_timeout", "no event for "
                                f"{self.settings.realtime_idle_timeout_seconds:.0f} s")
        return None

    def next_timer(self) -> float:
        """Seconds until `timer_expired` may have something to say."""
        now = time.monotonic()
        return max(0.0, min(self.opened + self.settings.realtime_max_session_seconds,
                            self.last_activity + self.settings.realtime_idle_timeout_seconds)
                   - now)

    async def drain(self, timeout: float) -> None:
        """Let the turns already committed finish (up to `timeout`)."""
        if self.turns:
            await asyncio.wait(set(self.turns), timeout=timeout)

    async def end_turns(self, ended: SessionEnded) -> None:
        """A limit ended the session and its turns had their time to finish: each one still
        pending gets its `...failed` (the session's reason) while the socket is still open,
        then stops as at a close (a turn no worker has started is dropped)."""
        self._ending = {"type": ended.type, "code": ended.code, "message": ended.message,
                        "param": None}
        await self.close()

    async def close(self) -> None:
        """The client is gone: stop listening; a turn no worker has started yet is
        cancelled, one already running finishes and is kept."""
        for turn in list(self.turns):
            turn.cancel()
        await asyncio.gather(*self.turns, return_exceptions=True)

    # --- client events ----------------------------------------------------------------------

    async def _update(self, event: ClientEvent) -> None:
        config = updated(self.config, event.body.get("session"), event.event_id)
        target = self._target_of(config, event.event_id)  # (a refused update changes nothing)
        if config.turn_detection != self.config.turn_detection and self._speech_item:
            await self._end_speech()  # the new detector starts afresh: this turn ends here
        self._apply(config, target)
        await self._send(server_event("session.updated", session=config.public(self.id)))

    def _target_of(self, config: SessionConfig, event_id: str | None) -> Target | None:
        """Where `config`'s turns go (ProtocolError for a model not served here)."""
        if config.transcription is not None and config.transcription != self.config.transcription:
            return resolve(self.settings, config.transcription, event_id)
        return self._target

    def _apply(self, config: SessionConfig, target: Target | None) -> None:
        if config.rate != self.config.rate:
            self.buffer.set_rate(config.rate)
        if config.turn_detection != self.config.turn_detection:
            self.buffer.set_vad(config.turn_detection)
            self._speech_item = None
        self.config, self._target = config, target

    async def _append(self, event: ClientEvent) -> None:
        limit = self.settings.realtime_max_session_seconds
        samples = decode_chunk(event.body.get("audio"), self.buffer.max_samples,
                               self.config.rate, event.event_id, self.config.encoding)
        if (self.buffer.received / SAMPLE_RATE + len(samples) / self.config.rate) > limit:
            raise SessionEnded("session_expired", f"the session's audio passed its limit of "
                               f"{limit:.0f} s", "audio", event.event_id)
        # the VAD costs ~0.1 ms per 32 ms frame: off the loop, so a large chunk blocks no one
        changes = await asyncio.to_thread(self.buffer.append, samples, event.event_id)
        for change in changes:
            if isinstance(change, SpeechStarted):
                self._speech_item = new_id("item")
                await self._send(server_event("input_audio_buffer.speech_started",
                                              audio_start_ms=_ms(change.sample),
                                              item_id=self._speech_item))
            else:
                item = self._speech_item or new_id("item")
                self._speech_item = None
                await self._send(server_event("input_audio_buffer.speech_stopped",
                                              audio_end_ms=_ms(change.sample), item_id=item))
                await self._committed(item, change.turn)

    async def _end_speech(self) -> None:
        """The speech in progress, stopped and committed as the item its speech_started
        named (a client waits on that item: the turn's audio must not be dropped with it)."""
        item, self._speech_item = self._speech_item or new_id("item"), None
        await self._send(server_event("input_audio_buffer.speech_stopped",
                                      audio_end_ms=_ms(self.buffer.received), item_id=item))
        if (turn := self.buffer.commit()) is not None:
            await self._committed(item, turn)

    async def _commit(self, event: ClientEvent) -> None:
        held = self.buffer.buffered / SAMPLE_RATE * 1000
        turn = self.buffer.commit()
        # a commit during detected speech commits that speech's item (its speech_started
        # named it), not a new one the client never saw start
        item, self._speech_item = self._speech_item or new_id("item"), None
        if turn is None:
            raise ProtocolError("input_audio_buffer_commit_empty", "buffer too small: a commit "
                                f"needs at least {MIN_COMMIT_MS} ms of audio, the buffer holds "
                                f"{held:.2f} ms", None, event.event_id)
        await self._committed(item, turn)

    # --- turns ---------------------------------------------------------------------------------

    async def _committed(self, item: str, turn: Turn) -> None:
        previous, self._previous_item = self._previous_item, item
        await self._send(server_event("input_audio_buffer.committed", item_id=item,
                                      previous_item_id=previous))
        user_item = {"id": item, "type": "message", "object": "realtime.item",
                     "status": "completed", "role": "user",
                     "content": [{"type": "input_audio", "transcript": None}]}
        await self._send(server_event("conversation.item.added", previous_item_id=previous,
                                      item=user_item))
        await self._send(server_event("conversation.item.done", previous_item_id=previous,
                                      item=user_item))
        if self.config.transcription is None:
            return
        self.turned += turn.seconds  # now, before the buffer's audio could be metered
        earlier = list(self._texts)
        self._texts[item] = ""
        if len(self._texts) > 32:  # the prompt keeps only the tail of the text anyway
            del self._texts[next(iter(self._texts))]
        task = asyncio.create_task(self._transcribe(item, turn, self._target,
                                                    self._last_turn, earlier))
        self._last_turn = task
        self.turns.add(task)
        task.add_done_callback(self.turns.discard)

    def _previous_turns_prompt(self) -> bool:
        own = (self.config.transcription or Transcription()).previous_turns_prompt
        return self.settings.realtime_previous_turns_prompt if own is None else own

    async def _transcribe(self, item: str, turn: Turn, target: Target | None,
                          previous: asyncio.Task[None] | None, earlier: list[str]) -> None:
        try:
            if len(self.turns) > self.settings.realtime_max_pending_turns:
                raise RequestError(429, f"this session already has "
                                        f"{self.settings.realtime_max_pending_turns} turns "
                                        "being transcribed", code="too_many_pending_turns")
            if target is None:  # the default model names no enabled backend
                target = resolve(self.settings, self.config.transcription or Transcription())
            if self._previous_turns_prompt() and earlier:
                if previous is not None:  # its text is this turn's context: wait for it, briefly
                    await asyncio.wait({previous},
                                       timeout=self.settings.realtime_previous_turn_wait_seconds)
                prompt = turn_prompt(target.options.get("prompt", ""),
                                     [self._texts.get(i, "") for i in earlier])
                target = Target(target.backend, target.model, {**target.options, "prompt": prompt})
            await self._run_turn(item, turn, target)
        except ProtocolError as error:
            await self._failed(item, {"type": error.type, "code": error.code,
                                      "message": error.message, "param": error.param})
        except RequestError as error:
            await self._failed(item, openai_error(error))
        except asyncio.CancelledError:
            if self._ending is not None:  # the session ends: the turn's one terminal event
                with contextlib.suppress(Exception):
                    await self._failed(item, self._ending)
            raise
        except Exception as exc:  # a turn must never end the session, nor stay unanswered
            log.exception("turn %s failed", item)
            with contextlib.suppress(Exception):
                await self._failed(item, openai_error(RequestError(
                    500, f"internal error ({type(exc).__name__})", code="server_error")))
        finally:
            if item not in self._queued:  # no task carries its charge: the meter does
                self.turned -= turn.seconds
            self._queued.discard(item)

    async def _run_turn(self, item: str, turn: Turn, target: Target) -> None:
        audio = AudioInput(turn.wav(), None, AudioInfo(turn.seconds, SAMPLE_RATE, 1, "pcm_s16le"))
        task_id = new_task_id()  # known before the submit, so a close during it withdraws it
        try:
            call = await self.calls.start(backend=target.backend, model=target.model,
                                          options={**target.options, "streamed": True},
                                          audio=audio,
                                          owner=self.owner,
                                          terms=SubmitTerms(lane=INTERACTIVE, live=True),
                                          task_id=task_id)
        except asyncio.CancelledError:
            await self._withdraw(task_id, target.backend)
            raise
        self._queued.add(item)
        deltas = Deltas()
        try:
            async for event in call.events:  # (each segment once, whatever the attempts)
                if event["type"] == "segment":
                    if delta := deltas.of(event):
                        await self._send(server_event(f"{TRANSCRIPTION}.delta", item_id=item,
                                                      content_index=0, delta=delta))
                elif event["type"] == "done":
                    # what its task gave back is the meter's, before anything is awaited
                    # (a session ending now cancels the turn, and a cancel undoes nothing)
                    if event["task"].state != TaskState.SUCCEEDED:
                        self.turned -= turn.seconds - kept_charge(event["task"])
                    await self._finished(item, event["task"], deltas)
                    return
                elif event["type"] == "timeout":
                    timeout = still_running(call.task_id)
                    await self._failed(item, openai_error(timeout), **timeout.extra)
                    return
        except asyncio.CancelledError:
            if await self._withdraw(call.task_id, target.backend) == TaskState.CANCELLED:
                self._queued.discard(item)  # its charge went back: the meter's again
            raise
        finally:
            await call.events.aclose()

    async def _withdraw(self, task_id: str, backend: str) -> str:
        """The session closed: a turn no worker has started yet is dropped, not run. The
        task's state after ("" if unknown)."""
        with contextlib.suppress(Exception):
            return await asyncio.shield(self.calls.store.cancel(task_id, backend))
        return ""

    async def _finished(self, item: str, task: Task, deltas: Deltas) -> None:
        """The turn's last events (`deltas`: what its stream sent so far)."""
        if task.state == TaskState.SUCCEEDED and task.result is not None:
            self._texts[item] = str(task.result.get("text", ""))
            if rest := deltas.closing(self._texts[item]):
                await self._send(server_event(f"{TRANSCRIPTION}.delta", item_id=item,
                                              content_index=0, delta=rest))
            seconds = float(task.result.get("usage", {}).get("audio_seconds")
                            or task.audio_seconds or 0.0)
            await self._send(server_event(
                f"{TRANSCRIPTION}.completed", item_id=item, content_index=0,
                transcript=task.result.get("text", ""),
                usage={"type": "duration", "seconds": metered_seconds(seconds)}))
        else:
            await self._failed(item, openai_error(task_failed(task)))

    async def _failed(self, item: str, error: dict[str, Any], **extra: Any) -> None:
        """A turn's one `...failed`: its error is what an SSE stream's `error` event carries
        (`extra`, as there: a timeout's `task_id`, the task that goes on)."""
        await self._send(server_event(f"{TRANSCRIPTION}.failed", item_id=item, content_index=0,
                                      error=error, **extra))


def kept_charge(task: Task) -> float:
    """What a task that did not succeed stays charged (what it delivered; the rest of its
    charge went back), in its charge's unit."""
    try:
        return max(0.0, float((task.charge or {}).get("amount") or 0.0))
    except (TypeError, ValueError):
        return 0.0


def _ms(sample: int) -> int:
    return sample * 1000 // SAMPLE_RATE
