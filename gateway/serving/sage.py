"""Sage llmage's submit and poll. Every status reply is HTTP 200 JSON with `status`.

Sage stops polling only on SUCCEEDED, FAILED or UNKNOWN, so a cancelled task is reported
as FAILED (with `state: CANCELLED`) and a store outage as PENDING with a `detail`. A refused
submit is HTTP 200 too, a task FAILED from the start whose id leads to the reason
(gateway.errors.SAGE_SUBMIT_ROUTES), since Sage's client reads no body of a non-2xx reply.
"""

from __future__ import annotations

import contextlib
import json
import logging
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from common.catalog import Kind, kind_of
from common.formats import fastwhisper_legacy
from common.schemas import BATCH, TaskState
from common.settings import Settings
from common.store import StoreError, TaskStore
from common.store.poll import UnknownState
from common.store.running_polls import RunningPolls
from common.store.voices import VoiceStore
from gateway.errors import RequestError, refusal_of, refusals_of, sage_store_reply
from gateway.policy.admission import Outlook, estimate_at
from gateway.policy.signing import output_url
from gateway.serving.tasks import queue_fields
from gateway.serving.voices import use_custom_voice
from gateway.submit.enqueue import enqueue, refuse_fetch_if_full
from gateway.submit.inputs import read_params
from gateway.submit.kinds import read_task_input, resolve_backend_model
from gateway.submit.terms import SubmitTerms, default_lane

log = logging.getLogger("gateway")


async def submit(request: Request, owner: str, settings: Settings, store: TaskStore,
                  backend: str | None) -> Response:
    params = await read_params(request)
    backend = backend or params.get("backend")
    if not backend:
        raise RequestError(400, "missing 'backend'", param="backend")
    model = resolve_backend_model(settings, backend, params.get("model"))
    # the terms are checked before any audio_url fetch
    terms = SubmitTerms.of(request, params, default_lane(settings, owner, BATCH), settings)
    await use_custom_voice(params, owner, VoiceStore.of(store))  # "voice_…": a custom voice
    await refuse_fetch_if_full(store, settings, owner, params, terms)
    options, audio = await read_task_input(params, settings, backend, store.blobs)
    task = await enqueue(store, settings, backend=backend, model=model, options=options,
                         audio=audio, owner=owner, terms=terms)
    reply: dict[str, Any] = {"task_id": task.id, "taskid": task.id, "status": "PENDING"}
    if task.state != TaskState.PENDING:  # an idempotent replay of a task that moved on
        reply["state"] = task.state.value
    else:
        with contextlib.suppress(StoreError):  # the task is queued: estimates are extras
            poll = await store.poll.read(task.id)  # the task and its outlook: one round trip
            if poll is not None and poll.position is not None and poll.outlook is not None:
                estimate = estimate_at(Outlook(*poll.outlook), task, poll.position)
                if estimate is not None:
                    reply.update(estimate.fields())
    return _reply(reply)


async def status(request: Request, owner: str, settings: Settings,
                 polls: RunningPolls) -> Response:
    """A refusal here (a bad key, body or value) is still HTTP 200: gateway.errors renders
    every refusal on these routes so (SAGE_STATUS_ROUTES). The hot path of the Sage
    contract: at most one store round trip (none for a RUNNING task polled often:
    common/store/running_polls.py), no validation model, the stored result spliced into the
    reply unparsed. Nothing but HTTP 200 JSON: a state only a newer version knows (a
    rolling upgrade) is PENDING with a note, as is a store out of reach; a store that answers
    with an error no retry cures (an ACL's NOPERM) and an unexpected error are FAILED, logged."""
    params = await read_params(request)
    task_id = params.get("task_id", "taskid")
    if not task_id:
        raise RequestError(400, "missing task_id", param="task_id")
    try:
        return await _status(request, owner, settings, polls, task_id, params.get("format"))
    except StoreError as exc:
        return _reply(sage_store_reply(task_id, exc))
    except UnknownState as exc:  # a newer version's state: the task lives; Sage polls on
        log.warning("%s", exc)
        return _reply({"task_id": task_id, "taskid": task_id, "status": "PENDING",
                       "detail": "the task is in a state this gateway does not know (a newer "
                                 "version wrote it?); keep polling"})
    except Exception as exc:
        log.exception("the status poll of %s failed", task_id)
        return _reply({"task_id": task_id, "taskid": task_id, "status": "FAILED",
                       "error": f"internal error ({type(exc).__name__})",
                       "code": "server_error"})


async def _status(request: Request, owner: str, settings: Settings, polls: RunningPolls,
                  task_id: str, fmt: str | None) -> Response:
    if (refused := await refusal_of(task_id, refusals_of(request.app))) is not None:
        # a refused submit's (SAGE_SUBMIT_ROUTES)
        return _reply(refused)
    poll = await polls.read(task_id)
    if poll is None or poll.task.owner != owner:  # another key's task does not exist for you
        return _reply({"task_id": task_id, "taskid": task_id, "status": "FAILED",
                       "error": "unknown or expired task"})
    task = poll.task
    reply: dict[str, Any] = {"task_id": task.id, "taskid": task.id, "status": task.state.value}
    if task.state == TaskState.PENDING:
        reply.update(queue_fields(poll))
    elif task.state == TaskState.SUCCEEDED and poll.result is None:  # never written so
        reply.update(status="FAILED", error="the task's result is missing",
                     code="result_missing")
    elif task.state == TaskState.SUCCEEDED:
        kind = kind_of(task.backend)
        audio_url = (output_url(request, settings, task.id)
                     if kind is not None and kind.audio_output else None)
        if poll.usage is None or (fmt == "fastwhisper" and kind is not None
                                  and kind.name == "asr"):
            result = json.loads(poll.result)
            return _reply(succeeded(reply, result, fmt, kind, audio_url))
        tail = b',"usage":' + poll.usage + b',"result":' + poll.result
        if audio_url:
            tail += b',"output_url":' + json.dumps(audio_url).encode()
        return _reply(reply, tail)
    elif task.state == TaskState.FAILED:
        reply.update(error=task.error or "the task failed", code=task.error_code or "failed")
    elif task.state == TaskState.CANCELLED:
        reply.update(status="FAILED", state="CANCELLED", error=task.error or "task was cancelled",
                     code=task.error_code or "cancelled")
    return _reply(reply)


def succeeded(reply: dict[str, Any], result: dict[str, Any], fmt: str | None,
              kind: Kind | None, audio_url: str | None) -> dict[str, Any]:
    """A SUCCEEDED reply built from the decoded result (`format=fastwhisper`, or a task
    stored before its `usage` was kept apart)."""
    reply["usage"] = result.get("usage") or {}
    legacy = fmt == "fastwhisper" and kind is not None and kind.name == "asr"
    reply["result"] = fastwhisper_legacy(result) if legacy else result
    if audio_url:
        reply["output_url"] = audio_url
    return reply


def _reply(reply: dict[str, Any], tail: bytes = b"") -> Response:
    """JSON encoded once; `tail`: members already encoded, spliced in before the brace."""
    body = json.dumps(reply, separators=(",", ":")).encode()
    if tail:
        body = body[:-1] + tail + b"}"
    return Response(body, media_type="application/json")
