"""A task's record as the store holds it (one hash, keys.task): the `Task` a worker runs and
the gateway reads. Its HTTP views are the gateway's (gateway/serving/tasks.py)."""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from common import keys
from common.schemas import TaskState


def new_task_id() -> str:
    """Unguessable, URL-safe, fleet-unique (144 random bits), 24 characters."""
    return secrets.token_urlsafe(18)


@dataclass(slots=True)
class Task:
    id: str
    backend: str
    model: str
    state: TaskState
    params: dict[str, Any] = field(default_factory=dict)
    input_path: str = ""  # a file under an allowed root; empty when the input is a blob
    owner: str = ""
    created_at: float = 0.0
    started_at: float | None = None
    finished_at: float | None = None
    attempt: int = 0
    deliveries: int = 0
    #: deliveries that were not its doing (a graceful stop, an entry given back unstarted):
    #: SPEECH_MAX_DELIVERIES counts the others
    spared: int = 0
    entry_id: str = ""
    queue_seq: int = 0  # this entry's number in its stream's add order
    worker: str = ""
    result: dict[str, Any] | None = None
    error: str = ""
    error_code: str = ""
    audio_seconds: float | None = None
    #: its size in its backend's unit (audio-seconds; characters for TTS): what the backlog
    #: and the processing rates count. None: its audio_seconds.
    work: float | None = None
    lane: str = keys.BATCH  # its priority lane: keys.INTERACTIVE or keys.BATCH
    deadline: float | None = None  # epoch seconds: FAILED deadline_exceeded if not started
    #: what its owner was charged ({amount, unit, backend, and the usage keys}); None: unmetered
    charge: dict[str, Any] | None = None
    callback_url: str = ""  # where its webhook goes once it is terminal ("" = none)

    @classmethod
    def from_hash(cls, raw: dict[bytes, bytes]) -> Task:
        data = {k.decode(): v.decode() for k, v in raw.items()}

        def number(name: str) -> float | None:
            return float(data[name]) if data.get(name) else None

        return cls(
            id=data["id"],
            backend=data["backend"],
            model=data.get("model", ""),
            state=TaskState(data["state"]),
            params=json.loads(data.get("params") or "{}"),
            input_path=data.get("input_path", ""),
            owner=data.get("owner", ""),
            created_at=float(data.get("created_at", 0)),
            started_at=number("started_at"),
            finished_at=number("finished_at"),
            attempt=int(data.get("attempt", 0)),
            deliveries=int(data.get("deliveries", 0)),
            spared=int(data.get("spared") or 0),
            entry_id=data.get("entry_id", ""),
            queue_seq=int(data.get("queue_seq") or 0),
            worker=data.get("worker", ""),
            result=json.loads(data["result"]) if data.get("result") else None,
            error=data.get("error", ""),
            error_code=data.get("error_code", ""),
            audio_seconds=number("audio_seconds"),
            work=number("work"),
            lane=data.get("lane") or keys.BATCH,
            deadline=number("deadline"),
            charge=json.loads(data["charge"]) if data.get("charge") else None,
            callback_url=data.get("callback_url", ""),
        )

    def new_hash(self, now: float, charge: str) -> dict[str, str]:
        """The hash a submit writes for this task, queued at `now` and charged `charge` (JSON,
        "" = unmetered)."""
        return {"id": self.id, "backend": self.backend, "model": self.model,
                "state": TaskState.PENDING.value, "params": json.dumps(self.params),
                "input_path": self.input_path, "owner": self.owner, "created_at": repr(now),
                "attempt": "0", "audio_seconds": _number(self.audio_seconds),
                "work": repr(self.work_units), "lane": self.lane,
                "deadline": _number(self.deadline), "charge": charge,
                "callback_url": self.callback_url}

    @property
    def work_units(self) -> float:
        return self.work if self.work is not None else (self.audio_seconds or 0.0)


def _number(value: float | None) -> str:
    return "" if value is None else repr(value)


# --- what a submit may be refused with (nothing is written then) ---

class QueueFull(Exception):
    """A submit found its backend with its most queued tasks: `queued` are waiting; or, with
    `own`, its owner holding its share of them (`queued` are the owner's)."""

    def __init__(self, queued: int, own: bool = False) -> None:
        super().__init__(queued)
        self.queued = queued
        self.own = own


class InputsFull(Exception):
    """A submit whose input would take its owner's unfinished tasks past the input bytes
    they may hold (`held`: what they hold now)."""

    def __init__(self, held: int) -> None:
        super().__init__(held)
        self.held = held


class TooManySubmits(Exception):
    """A submit past its owner's most submits a minute; `retry_after`: seconds until the
    minute ends."""

    def __init__(self, retry_after: float) -> None:
        super().__init__(retry_after)
        self.retry_after = retry_after


class TooManyInFlight(Exception):
    """A submit whose owner already has its most tasks queued or running (`in_flight`)."""

    def __init__(self, in_flight: int) -> None:
        super().__init__(in_flight)
        self.in_flight = in_flight


class Duplicate(Exception):
    """A submit repeated an idempotency key: `task_id` is the task the first one made."""

    def __init__(self, task_id: str) -> None:
        super().__init__(task_id)
        self.task_id = task_id
