"""The WebSocket's edge: subprotocol, API key, the per-process session limit (and one key's
share of it), and the loop that reads client events until the client leaves or a limit ends
the session (the meter's too: audio past 2x real time, a quota passed).

A refused key is a close with 1008 (policy violation) right after the handshake, before any
event is read: the socket is accepted first only because a close code cannot reach a client
otherwise (a refused handshake is a bare HTTP 403).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Coroutine
from typing import Any

from fastapi import WebSocket
from starlette.websockets import WebSocketDisconnect, WebSocketDisconnected, WebSocketState

from common.settings import Settings
from common.store import new_task_id
from common.store.client_secrets import ClientSecretStore
from gateway.auth import websocket_caller
from gateway.errors import RequestError
from gateway.realtime.metering import SessionMeter, SessionShares
from gateway.realtime.protocol import ProtocolError, error_event
from gateway.realtime.session import Session
from gateway.serving.calls import SyncCalls, first_of

log = logging.getLogger("gateway.realtime")

SUBPROTOCOL = "realtime"
POLICY_VIOLATION = 1008
TRY_AGAIN_LATER = 1013
INTENTS = ("transcription",)
#: what a receive or send raises once the client is gone (uvicorn's ClientDisconnected is an
#: OSError)
GONE = (WebSocketDisconnect, WebSocketDisconnected, OSError)


class RealtimeServing:
    def __init__(self, calls: SyncCalls) -> None:
        self.calls = calls
        self.settings: Settings = calls.settings
        self.sessions = 0  # open in this process
        self.shares = SessionShares(self.settings, calls.store)
        self.secrets = ClientSecretStore.of(calls.store)

    async def serve(self, websocket: WebSocket) -> None:
        offered = websocket.scope.get("subprotocols") or []
        await websocket.accept(subprotocol=SUBPROTOCOL if SUBPROTOCOL in offered else None)
        try:
            owner, preset = await websocket_caller(websocket, self.settings, self.secrets)
        except RequestError as refused:  # a bad key is final; a key store down is not (the
            # SDK reconnects on 1013, and takes any other code as for good)
            await websocket.close(
                TRY_AGAIN_LATER if refused.status_code >= 500 else POLICY_VIOLATION,
                refused.message)
            return
        intent = websocket.query_params.get("intent")
        if intent is not None and intent not in INTENTS:
            await _refuse(websocket, ProtocolError(
                "invalid_value", f"intent {intent[:40]!r} is not served here: only "
                                 "intent=transcription", "intent"), POLICY_VIOLATION)
            return
        if self.sessions >= self.settings.realtime_max_sessions:
            await _refuse(websocket, ProtocolError(
                "too_many_sessions", "this gateway process serves "
                f"{self.settings.realtime_max_sessions} sessions already; retry shortly",
                type="server_error"), TRY_AGAIN_LATER)
            return
        self.sessions += 1  # taken before the await below: concurrent handshakes see it
        slot = new_task_id()
        try:
            refused = await self.shares.admit(owner, slot)
        except BaseException:
            self.sessions -= 1
            raise
        if refused is not None:
            self.sessions -= 1
            held = (f"{self.shares.limit} sessions of this gateway process" if refused ==
                    "process" else f"{self.shares.overall} sessions (every gateway process)")
            await _refuse(websocket, ProtocolError(
                "too_many_sessions", f"this key holds {held} already, its share; retry when "
                "one has ended", type="server_error"), TRY_AGAIN_LATER)
            return
        renewing = asyncio.create_task(self.shares.hold(owner, slot))
        lock = asyncio.Lock()
        stalled = asyncio.Event()
        timeout = self.settings.send_timeout_seconds

        async def send(event: dict[str, Any]) -> None:
            text = json.dumps(event)
            if stalled.is_set():
                return
            try:
                # A client that reads nothing fills the socket's buffers, then every send
                # waits for ever (and the loop with it, past the session's own timers): after
                # `timeout` it counts as gone, and its session slot and turns are freed.
                async with asyncio.timeout(timeout), lock:  # turns send while the loop answers
                    if websocket.application_state == WebSocketState.CONNECTED:
                        with contextlib.suppress(*GONE):  # the client left: the loop sees it
                            await websocket.send_text(text)
            except TimeoutError:
                log.warning("realtime session: the client took no events for %g s; dropped",
                            timeout)
                stalled.set()

        session = Session(self.settings, self.calls, owner, send)
        meter = SessionMeter(self.settings, self.calls.store, owner)
        try:
            await session.open(preset)
            if not await _unless(stalled, self._read(websocket, session, meter)):
                return  # nothing more reaches this client; uvicorn drops the connection
            if session.ended is not None:
                await _unless(stalled, session.drain(self.settings.request_timeout_seconds))
                await _unless(stalled, session.end_turns(session.ended))
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(timeout):
                        await websocket.close(1000, session.ended.code)
        except GONE:
            pass  # the client left
        finally:
            self.sessions -= 1
            renewing.cancel()
            await self.shares.leave(owner, slot)
            await session.close()
            with contextlib.suppress(Exception):
                await meter.charge(session, final=True)

    async def _read(self, websocket: WebSocket, session: Session, meter: SessionMeter) -> None:
        while session.ended is None:
            try:
                async with asyncio.timeout(session.next_timer()):
                    message = await websocket.receive()
            except TimeoutError:
                if (ended := session.timer_expired()) is not None:
                    await session.end(ended)
                continue
            if message["type"] == "websocket.disconnect":
                return
            if message.get("text") is not None:
                await session.handle(message["text"])
                ended = meter.check_speed(session) or await meter.charge(session)
                if ended is not None and session.ended is None:
                    await session.end(ended)
            else:
                await session.handle_error(ProtocolError(
                    "invalid_json", "binary frames are not events: send JSON text frames"))
            if websocket.client_state != WebSocketState.CONNECTED:
                return


async def _unless(stalled: asyncio.Event, work: Coroutine[Any, Any, None]) -> bool:
    """Run `work` unless the client stalls first (then it is cancelled): whether it ran."""
    running, _ = await first_of(work, stalled.wait())
    if stalled.is_set():
        return False
    running.result()  # its exception (the client left) is the caller's
    return True


async def _refuse(websocket: WebSocket, error: ProtocolError, code: int) -> None:
    await websocket.send_text(json.dumps(error_event(error)))
    await websocket.close(code, error.code)
