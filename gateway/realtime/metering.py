"""A live session's fair use (issue 30): audio no faster than `realtime_max_speed` x real time
(after a burst of one buffer, at least 10 s), audio that becomes no task charged to the key's
quota as it arrives, and one key at most its share of the sessions: of this process's
(`realtime_key_share`) and of every gateway process's together (`realtime_sessions_per_key`,
leased slots in Redis).

A turn queued as a task is charged like any task (gateway/submit/enqueue.py); what the meter
charges is the rest of the audio a session is sent, once it has left the buffer in no such
turn (silence the VAD dropped, a clear, a turn with transcription off or refused before it was
queued, what was buffered at the end), which would otherwise cost nothing and still take the
gateway's CPU (the VAD) and memory: a session of hours of silence is charged its hours. A
turn whose task fails or is cancelled (at the session's close) gives back what it did not
deliver, as any task does, and the meter charges that part as session audio, so every second
a session is sent is charged once whatever becomes of its turns; all but a turn whose task a
worker was still running at the close and that fails after it (the session is gone: its
refund stands).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import secrets
import time
from collections import Counter

from common.catalog import UnknownBackend, UnknownModel, resolve_public_model
from common.settings import Settings
from common.store import QuotaExceeded, StoreError, TaskStore
from gateway.policy.quotas import charge_of, quota_exceeded
from gateway.realtime.session import Session, SessionEnded
from gateway.realtime.vad import SAMPLE_RATE

#: audio (seconds) a session with transcription off is charged in, at least
CHARGE_STEP_SECONDS = 1.0
#: the smallest burst a session may send ahead of the clock (a client's first seconds, a
#: reconnect's backlog), whatever the buffer
MIN_BURST_SECONDS = 10.0


class SessionMeter:
    def __init__(self, settings: Settings, store: TaskStore, owner: str) -> None:
        self.settings = settings
        self.store = store
        self.owner = owner
        self.billed = 0.0  # seconds of the session's audio the meter has charged
        #: its charges' id in Redis: one sent again after its reply was lost adds nothing twice
        self.id = secrets.token_hex(12)

    def check_speed(self, session: Session) -> SessionEnded | None:
        """The session's audio against the wall clock: past `realtime_max_speed` x real time
        plus a burst of one buffer (at least MIN_BURST_SECONDS), it ends."""
        received = session.buffer.received / SAMPLE_RATE
        elapsed = time.monotonic() - session.opened
        allowed = (self.settings.realtime_max_speed * elapsed
                   + max(MIN_BURST_SECONDS, self.settings.realtime_max_buffer_seconds))
        if received > allowed:
            return SessionEnded("rate_limited", f"audio arrived at {received:.0f} s in "
                                f"{elapsed:.1f} s of wall time; a session takes at most "
                                f"{self.settings.realtime_max_speed:g}x real time",
                                "audio")
        return None

    async def charge(self, session: Session, final: bool = False) -> SessionEnded | None:
        """Charge the audio that left the buffer since the last charge in no turn queued as
        a task; the session ends past the key's quota. The audio still buffered may yet be
        such a turn: it is charged once it leaves the buffer in none, or when the session
        ends (`final`: then past the quota too, or a key at its quota could send a buffer's
        worth a session for nothing)."""
        buffer = session.buffer
        done = buffer.received if final else buffer.settled
        due = done / SAMPLE_RATE - session.turned - self.billed
        if due <= 0 or (due < CHARGE_STEP_SECONDS and not final):
            return None
        try:
            backend, _ = resolve_public_model(self.settings, "whisper-1", "asr")
        except (UnknownModel, UnknownBackend):  # no ASR backend here: nothing prices it
            self.billed += due
            return None
        charge = charge_of(self.settings, self.owner, backend, {}, round(due, 3))
        if final:  # sent and listened to already: charged past the quota too (as a task's
            charge = dataclasses.replace(charge, quotas=None)  # settlement may), never free
        try:
            await self.store.usage.charge_now(charge, session=(self.id, self.billed + due))
        except QuotaExceeded as refused:
            message = quota_exceeded(refused, time.time()).message
            return SessionEnded("quota_exceeded", message, "audio")
        except StoreError:
            return None  # charged with the next append once the store is back
        self.billed += due
        return None


#: a session's slot in Redis lapses this long after its last renewal (its process died)
SLOT_LEASE_SECONDS = 30.0
SLOTS = "sessions"


class SessionShares:
    """Sessions per key: at most `limit` in this process (`realtime_key_share` of its slots)
    and `overall` in every gateway process together. The overall count is leased slots in
    Redis, renewed while a session is open; while Redis is away only this process's share
    is checked."""

    def __init__(self, settings: Settings, store: TaskStore) -> None:
        self.limit = max(1, math.floor(settings.realtime_max_sessions
                                       * settings.realtime_key_share))
        self.overall = settings.realtime_sessions_per_key or self.limit
        self.slots = store.slots
        self.open: Counter[str] = Counter()

    async def admit(self, owner: str, session_id: str) -> str | None:
        """Take a slot for `owner`'s session (keys off, "": one tenant, no share); else why
        not: "process" or "overall"."""
        if not owner:
            return None
        if self.open[owner] >= self.limit:
            return "process"
        self.open[owner] += 1  # before the await: concurrent handshakes of one key see it
        try:
            if not await self._take(owner, session_id):
                self._forget(owner)
                return "overall"
        except StoreError:
            pass  # only this process's share holds until Redis is back
        except BaseException:
            self._forget(owner)
            raise
        return None

    async def hold(self, owner: str, session_id: str) -> None:
        """Renew the session's slot until cancelled (when it closes)."""
        while owner:
            await asyncio.sleep(SLOT_LEASE_SECONDS / 3)
            with contextlib.suppress(StoreError):
                await self._take(owner, session_id)

    async def _take(self, owner: str, session_id: str) -> bool:
        """Take or renew the session's slot; False when the key holds `overall` already."""
        return await self.slots.take(SLOTS, owner, session_id, self.overall,
                                     SLOT_LEASE_SECONDS)

    async def leave(self, owner: str, session_id: str) -> None:
        if not owner:
            return
        self._forget(owner)
        with contextlib.suppress(StoreError):  # else it lapses with its lease
            await self.slots.give_back(SLOTS, owner, session_id)

    def _forget(self, owner: str) -> None:
        self.open[owner] -= 1
        if self.open[owner] <= 0:
            del self.open[owner]
