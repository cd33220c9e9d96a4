"""A live session's fair use (issue 30): audio no faster than `realtime_max_speed` x real time
(after a burst of one buffer, at least 10 s), audio that becomes no task (transcription off)
charged to the key's quota as it arrives, and one key at most `realtime_key_share` of a
process's sessions.

A committed turn is a task and is charged like any (gateway/submit/enqueue.py); what the meter
charges is the audio a session with transcription off is sent, which would otherwise cost
nothing and still take the gateway's CPU (the VAD) and memory.
"""

from __future__ import annotations

import math
import time
from collections import Counter

from common.catalog import resolve_public_model
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
        self.billed = 0.0  # seconds of the session's audio already charged or in a turn

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
        """Charge the audio received since the last charge if no turn will carry it
        (transcription off); the session ends past the key's quota."""
        received = session.buffer.received / SAMPLE_RATE
        if session.config.transcription is not None:
            self.billed = received  # its turns are tasks, charged when queued
            return None
        due = received - self.billed
        if due <= 0 or (due < CHARGE_STEP_SECONDS and not final):
            return None
        backend, _ = resolve_public_model(self.settings, "whisper-1", "asr")
        try:
            await self.store.usage.charge_now(charge_of(self.settings, self.owner, backend, {},
                                                  round(due, 3)))
        except QuotaExceeded as refused:
            message = quota_exceeded(refused, time.time()).message
            return SessionEnded("quota_exceeded", message, "audio")
        except StoreError:
            return None  # charged with the next append once the store is back
        self.billed = received
        return None


class SessionShares:
    """Sessions per key in this process: one key at most `realtime_key_share` of them."""

    def __init__(self, settings: Settings) -> None:
        self.limit = max(1, math.floor(settings.realtime_max_sessions
                                       * settings.realtime_key_share))
        self.open: Counter[str] = Counter()

    def admit(self, owner: str) -> bool:
        """Take a slot for `owner` (keys off, "": one tenant, no share); False when it holds
        its share already."""
        if owner and self.open[owner] >= self.limit:
            return False
        self.open[owner] += 1
        return True

    def leave(self, owner: str) -> None:
        self.open[owner] -= 1
        if self.open[owner] <= 0:
            del self.open[owner]
