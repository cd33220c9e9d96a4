"""Request bodies: a size limit enforced while the body streams in (Content-Length may lie or
be absent), and a time limit, so a client that trickles its body cannot hold a connection.

Shared by the gateway and the worker's own HTTP server (which must not import the gateway)."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodyRefused(Exception):
    """The request body broke a limit; the middleware answers (if it still can)."""

    status_code = 400
    code = ""

    def message(self, limits: BodyLimitMiddleware) -> str:
        raise NotImplementedError


class BodyTooLarge(BodyRefused):
    status_code = 413
    code = "request_too_large"

    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def message(self, limits: BodyLimitMiddleware) -> str:
        return f"the request body is larger than {self.limit} bytes"


class BodyTimeout(BodyRefused):
    status_code = 408
    code = "request_timeout"

    def message(self, limits: BodyLimitMiddleware) -> str:
        return (f"the request body did not arrive in time (a pause over "
                f"{limits.idle_seconds:g} s, or over {limits.deadline_seconds:g} s in all)")


class BodiesOverBudget(BodyRefused):
    """The bodies this process holds at once would pass its budget: a 503 to retry shortly
    (several large uploads at once would else take the process past its memory limit,
    and every call it serves with it)."""

    status_code = 503
    code = "overloaded"
    retry_after = 2

    def message(self, limits: BodyLimitMiddleware) -> str:
        return (f"this gateway process holds {limits.budget_bytes // 2**20} MiB of uploads "
                "already; retry shortly")


class HolderOverShare(BodiesOverBudget):
    """One caller's bodies in progress would pass its share of the budget: a caller that
    trickles a few large uploads must not leave every other caller's upload refused."""

    def message(self, limits: BodyLimitMiddleware) -> str:
        return (f"this key's uploads in progress hold its share of this gateway process's "
                f"{limits.budget_bytes // 2**20} MiB already; retry shortly")


#: the request's scope -> who holds its body, for the budget's per-holder share (None: no one
#: in particular)
Holder = Callable[[Scope], str | None]
#: where a request's scope carries its `HoldMore`: what the app fetches for it (an
#: `audio_url` download) is held in memory like a body, so it counts in the same budget
HOLD_MORE = "speech.hold_more"
#: bytes more this request holds (until its reply is over) -> None, or why not (the budget's
#: refusal message: the caller answers it as a 503 to retry shortly)
HoldMore = Callable[[int], str | None]
#: (the request's scope, HTTP status, message, code) -> the (HTTP status, JSON body) that
#: answer a refusal
ErrorReply = Callable[[Scope, int, str, str], Awaitable[tuple[int, dict[str, Any]]]]


async def default_error_reply(scope: Scope, status_code: int, message: str,
                        code: str) -> tuple[int, dict[str, Any]]:
    if scope["path"].startswith("/v1/"):
        return status_code, {"error": {"message": message, "type": "invalid_request_error",
                                       "param": "file", "code": code}}
    return status_code, {"status": "FAILED", "error": message}


class BodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, idle_seconds: float = 60.0,
                 deadline_seconds: float = 900.0,
                 error_reply: ErrorReply = default_error_reply,
                 path_limits: dict[str, int] | None = None, budget_bytes: int = 0,
                 holder: Holder | None = None, holder_share: float = 0.5) -> None:
        """`error_reply` shapes a refusal's answer (the gateway passes its own renderer);
        `path_limits`: a smaller limit for the paths that begin with each prefix (a route
        whose uploads are small is not made to read the whole `max_bytes` first);
        `budget_bytes`: the most body bytes the requests in progress may hold together
        (0: no bound; one request alone always may); `holder` names the caller of a request
        (the gateway: its API key), who may hold `holder_share` of the budget at most (again,
        one request of its alone always may)."""
        self.app = app
        self.max_bytes = max_bytes
        self.budget_bytes = budget_bytes
        self.holder = holder
        self.share_bytes = int(budget_bytes * holder_share)
        self.held = 0  # the body bytes of the requests in progress
        self.held_by: dict[str, int] = {}  # … by holder
        self.path_limits = path_limits or {}
        self.idle_seconds = idle_seconds
        self.deadline_seconds = deadline_seconds
        self.error_reply = error_reply

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = min([self.max_bytes, *(most for prefix, most in self.path_limits.items()
                                       if scope["path"].startswith(prefix))])
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._reject(scope, send, BodyTooLarge(limit))
            return
        # a declared length is held from the start (uploads arriving together would all see
        # an empty budget, and one be refused half-way); what arrives past it counts as it comes
        reserved = int(declared) if declared is not None and declared.isdigit() else 0
        who = self.holder(scope) if self.holder is not None and self.budget_bytes else None
        if reserved and (over := self._over_budget(reserved, 0, who)):  # (no body: a poll)
            await self._reject(scope, send, over)
            return
        self._hold(who, reserved)
        counted = reserved  # what this request holds of `held`

        def hold_more(size: int) -> str | None:
            nonlocal counted
            if over := self._over_budget(size, counted, who):
                return over.message(self)
            self._hold(who, size)
            counted += size
            return None

        scope[HOLD_MORE] = hold_more
        received = 0
        body_done = False
        deadline = time.monotonic() + self.deadline_seconds
        response_started = False
        refused: BodyRefused | None = None

        async def limited_receive() -> Message:
            nonlocal received, body_done, refused, counted
            if body_done:  # only http.disconnect is left to wait for: no deadline on that
                return await receive()
            wait = min(self.idle_seconds, deadline - time.monotonic())
            try:
                async with asyncio.timeout(max(wait, 0.0)):
                    message = await receive()
            except TimeoutError:
                refused = BodyTimeout()
                raise refused from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                grown = received > counted  # past what it declared (or had no length)
                if grown:
                    self._hold(who, received - counted)
                    counted = received
                if received > limit:
                    refused = BodyTooLarge(limit)
                    raise refused
                if grown and (over := self._over_budget(0, counted, who)):
                    refused = over
                    raise refused
                body_done = not message.get("more_body", False)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal response_started
            if refused is not None:
                # The app caught the refusal and answers something else (FastAPI's own form
                # parsing turns it into a 400): the refusal is the answer, the app's is dropped.
                if not response_started:
                    response_started = True
                    await self._reject(scope, send, refused)
                return
            response_started = response_started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except BodyRefused as refusal:
            if not response_started:
                response_started = True
                await self._reject(scope, send, refusal)
        finally:  # (its reply is over: the app holds its body no longer)
            self._hold(who, -counted)

    def _hold(self, who: str | None, size: int) -> None:
        self.held += size
        if who is not None:
            if mine := self.held_by.get(who, 0) + size:
                self.held_by[who] = mine
            else:
                self.held_by.pop(who, None)

    def _over_budget(self, coming: int, own: int, who: str | None) -> BodiesOverBudget | None:
        """The refusal when `coming` more bytes (this request holding `own` of `held`
        already) pass the budget, or the holder's share of it; a request alone never does.
        A body counts until its reply is over (a waiting call's upload is still in memory)."""
        if self.budget_bytes <= 0:
            return None
        if who is not None:
            mine = self.held_by.get(who, 0)
            if mine + coming > self.share_bytes and mine > own:
                return HolderOverShare()
        if self.held + coming > self.budget_bytes and self.held > own:
            return BodiesOverBudget()
        return None

    async def _reject(self, scope: Scope, send: Send, refusal: BodyRefused) -> None:
        status, body = await self.error_reply(scope, refusal.status_code, refusal.message(self),
                                        refusal.code)
        payload = json.dumps(body).encode()
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(payload)).encode()), (b"connection", b"close")]
        if isinstance(refusal, BodiesOverBudget):
            headers.append((b"retry-after", str(refusal.retry_after).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": payload})
