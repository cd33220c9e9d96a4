"""Webhook delivery, run by every gateway process (like the sweeper), driven only by what
Redis holds: a finished task with a `callback_url` is in the due set from its terminal
write on, until an attempt gets a 2xx or the series gives up. So a worker crash, a gateway
killed between (or during) attempts, or a restart loses no webhook: whichever gateway
claims the entry next sends it. Delivery is at-least-once (a gateway killed after the
receiver answered but before the record sends it again); receivers dedupe on `webhook-id`.

Each attempt POSTs the task's status reply (the JSON of `GET /v1/tasks/{id}`, plus `owner`:
its key's name), signed with its key's own secrets or the global ones
(gateway/policy/webhooks.py), within `webhook_timeout_seconds` for the whole exchange, following no
redirect. A failure (non-2xx, no answer, timeout) is retried after `webhook_retry_seconds`,
multiplied by `webhook_retry_factor` per further failure up to `webhook_retry_max_seconds`;
no attempt starts `webhook_give_up_seconds` after the series' first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from urllib.parse import urlsplit

import httpx

from common.settings import Settings
from common.store import StoreError
from common.store.slots import SlotStore
from common.store.webhooks import Attempt, Claim, Owed, WebhookStore
from gateway.policy.hosts import allowed
from gateway.policy.webhooks import event_id, signature_headers
from gateway.serving.tasks import public_view

log = logging.getLogger("gateway.deliverer")
USER_AGENT = "speech-gateway-webhooks/1"
NO_LONGER_ALLOWED = "its host is no longer in SPEECH_CALLBACK_URL_HOSTS"
SLOTS = "webhooks"  # a key's deliveries on the way (common/store/slots.py)


async def deliver_forever(webhooks: WebhookStore, settings: Settings) -> None:
    deliverer = Deliverer(webhooks, settings)
    try:
        while True:
            try:
                await deliverer.deliver_due()
            except StoreError:
                pass  # Redis is away: the entries wait in it
            except Exception:  # a dead deliverer would stop every webhook of this process
                log.exception("webhook delivery pass failed")
            await asyncio.sleep(settings.webhook_poll_seconds)
    finally:
        await deliverer.close()


class Deliverer:
    """Each claimed delivery runs on its own (a pass never waits for its slowest), up to
    `webhook_concurrency` at once; one key's at most `webhook_concurrency_per_key` in every
    gateway process together (leased slots in Redis, as long as a claim): a key whose
    receiver hangs holds its own slots, not everyone's."""

    def __init__(self, webhooks: WebhookStore, settings: Settings) -> None:
        self.webhooks = webhooks
        self.settings = settings
        # the claim must outlast an attempt (bounded by the timeout) and its record, or a
        # second gateway would send the same event while the first still waits for the answer
        self.lease = 2 * settings.webhook_timeout_seconds
        self.client = httpx.AsyncClient(follow_redirects=False,
                                        timeout=settings.webhook_timeout_seconds,
                                        headers={"user-agent": USER_AGENT})
        self.running: set[asyncio.Task[None]] = set()
        self.slots = SlotStore(webhooks.redis)

    async def close(self) -> None:
        for task in self.running:
            task.cancel()
        await asyncio.gather(*self.running, return_exceptions=True)
        await self.client.aclose()

    async def deliver_due(self) -> int:
        """Claim what is due, as many as there are free slots, and start each; how many
        were claimed."""
        free = self.settings.webhook_concurrency - len(self.running)
        claims = await self.webhooks.claim(
            free, self.lease, self.settings.webhook_concurrency_per_key,
            self.settings.webhook_poll_seconds) if free > 0 else []
        for claim in claims:
            task = asyncio.create_task(self.deliver(claim))
            self.running.add(task)
            task.add_done_callback(self.running.discard)
        return len(claims)

    async def deliver(self, claim: Claim) -> None:
        owner: str | None = None
        try:
            owed = await self.webhooks.owed(claim.task_id)
            if owed is None or not owed.task.callback_url or not owed.task.state.terminal:
                await self.webhooks.drop(claim)  # expired meanwhile: nothing left to send
                return
            if not await self.slots.take(SLOTS, owed.task.owner, claim.task_id,
                                         self.settings.webhook_concurrency_per_key, self.lease):
                # its key has its most on the way (in any gateway): its turn comes next pass
                await self.webhooks.defer(claim, time.time() + self.settings.webhook_poll_seconds)
                return
            owner = owed.task.owner
            started = time.time()
            if allowed(urlsplit(owed.task.callback_url), self.settings.callback_url_hosts):
                status, error = await self.post(owed)
                attempt, next_due = self.judge(owed, started, status, error)
            else:  # the operator has since taken its host off the list: never send it
                attempt, next_due = Attempt(started, 0.0, "gave_up", None, NO_LONGER_ALLOWED), None
            await self.webhooks.record(claim, attempt, owed.since or started, next_due)
        except StoreError:
            pass  # the claim lapses and another pass (of any gateway) tries again
        except Exception:
            log.exception("webhook of task %s failed", claim.task_id)
        finally:
            if owner is not None:
                with contextlib.suppress(StoreError):  # else it lapses with the claim's lease
                    await self.slots.give_back(SLOTS, owner, claim.task_id)

    async def post(self, owed: Owed) -> tuple[int | None, str | None]:
        """(the receiver's HTTP status or None, why the attempt failed or None)."""
        task = owed.task
        key = self.settings.api_key(task.owner)
        # the owner named, so a receiver shared by several keys knows whose task it was
        body = json.dumps({**public_view(task),
                           "owner": key.label if key is not None else None}).encode()
        headers = signature_headers(self.settings.webhook_secrets_of(task.owner),
                                    event_id(task.id, task.state), int(time.time()), body)
        headers["content-type"] = "application/json"
        limit = self.settings.webhook_timeout_seconds
        try:
            # one deadline for the whole exchange: httpx's timeouts are per read
            async with asyncio.timeout(limit), \
                    self.client.stream("POST", task.callback_url, content=body,
                                       headers=headers) as reply:
                status = reply.status_code
        except TimeoutError:
            return None, f"no answer within {limit:g} s"
        except httpx.HTTPError as exc:
            return None, f"{type(exc).__name__}: {exc}"[:300]
        if 200 <= status < 300:
            return status, None
        if 300 <= status < 400:
            return status, f"HTTP {status}: redirects are not followed"
        return status, f"HTTP {status}"

    def judge(self, owed: Owed, started: float, status: int | None,
              error: str | None) -> tuple[Attempt, float | None]:
        """The attempt's record and when the next one is due (None: the series is over)."""
        duration = time.time() - started
        if error is None:
            return Attempt(started, duration, "delivered", status), None
        s = self.settings
        # the exponent capped: a factor of 2 overflows a float past some 1024 failures
        delay = min(s.webhook_retry_seconds * s.webhook_retry_factor ** min(owed.failures, 64),
                    s.webhook_retry_max_seconds)
        next_due = time.time() + delay
        since = owed.since or started
        if next_due > since + s.webhook_give_up_seconds:
            log.warning("webhook of task %s: giving up after %d attempts (%s)",
                        owed.task.id, owed.failures + 1, error)
            return Attempt(started, duration, "gave_up", status, error), None
        return Attempt(started, duration, "failed", status, error), next_due
