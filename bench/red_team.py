"""Red-team figures of issue 30: quotas, lanes and the broker, on the real stack.

1. quotas: files whose container claims 0.104 s and holds 55 s (Opus in Matroska) submitted
   8 at once on a 60 s/day key: what is charged at submit, what is accepted, what the key
   has used once every task settled, against the audio really decoded.
2. lanes: 25 batch tasks (jfk.flac, 11 s each) aged past SPEECH_BATCH_PROMOTION_SECONDS
   (5 s), then an interactive call (a key allowed it): its wait (started_at - created_at)
   against its `X-Estimated-Wait`, several times; target within 30 %.
3. broker: a spurious peak past the whole budget recorded for a model: how long until a
   reservation of it succeeds again, against the lease; target within one lease.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import time  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

import httpx  # noqa: E402
from redis.asyncio import Redis  # noqa: E402

from bench import common as bc  # noqa: E402
from common.store.devices import DeviceLedger  # noqa: E402
from gateway.auth import digest  # noqa: E402
from tests.audio_fakes import decoded_seconds, lying_matroska, silence_opus  # noqa: E402

NAME = "red_team"
KEYS = {"small": "red-team-small-key", "batch": "red-team-batch-key",
        "live": "red-team-live-key"}
LEASE = 2.0
#: a wait this short is within target whatever its ratio (a tenth of a second is scheduling)
ABSOLUTE_SLACK = 0.1


def auth(name: str) -> dict[str, str]:
    return {"authorization": f"Bearer {KEYS[name]}"}


def wait(client: httpx.Client, base: str, task_id: str, key: str,
         timeout: float = 300.0) -> dict:
    """The task's REST view once it is terminal (any terminal state)."""
    deadline = time.monotonic() + timeout
    while True:
        view = client.get(f"{base}/v1/tasks/{task_id}", headers=auth(key), timeout=30).json()
        if view["status"] not in ("PENDING", "RUNNING"):
            return view
        if time.monotonic() > deadline:
            raise TimeoutError(f"task {task_id} not done after {timeout:.0f} s")
        time.sleep(0.1)


def entries() -> list[dict]:
    return [{"key": "sha256:" + digest(KEYS["small"]), "name": "small",
             "quotas": {"audio_seconds_per_day": 60}},
            {"key": "sha256:" + digest(KEYS["batch"]), "name": "batch"},
            {"key": "sha256:" + digest(KEYS["live"]), "name": "live", "interactive": True}]


def quotas(stack: bc.Stack, client: httpx.Client) -> dict:
    lying = lying_matroska(silence_opus(55), 1, 0.104)
    real = decoded_seconds(lying)

    def send() -> httpx.Response:
        return client.post(f"{stack.url}/api/faster-whisper-submit", headers=auth("small"),
                           files={"file": ("lie.mka", lying)}, timeout=60)

    with ThreadPoolExecutor(8) as pool:
        replies = list(pool.map(lambda _: send(), range(8)))
    accepted = [r.json()["task_id"] for r in replies if r.status_code == 200]
    for task_id in accepted:
        wait(client, stack.url, task_id, "small")
    used = client.get(f"{stack.url}/v1/usage", headers=auth("small"),
                      timeout=30).json()["day"]["audio_seconds"]["used"]
    row = {"claimed_seconds": 0.104, "decoded_seconds": round(real, 2), "sent": 8,
           "accepted": len(accepted), "refused_429": sum(r.status_code == 429 for r in replies),
           "usage_after": round(used, 2), "quota": 60,
           "usage_equals_decoded": abs(used - real * len(accepted)) < 1.0}
    bc.table("1. quotas: 8 files claiming 0.104 s, holding 55 s, on a 60 s/day key",
             list(row), [list(row.values())])
    return row


def lanes(stack: bc.Stack, client: httpx.Client, reps: int) -> dict:
    jfk = bc.JFK.read_bytes()
    rows = []
    for _ in range(reps):
        batch = [client.post(f"{stack.url}/api/faster-whisper-submit", headers=auth("batch"),
                             files={"file": ("jfk.flac", jfk)}, timeout=60).json()["task_id"]
                 for _ in range(25)]
        time.sleep(6)  # every batch entry past the 5 s promotion age
        reply = client.post(f"{stack.url}/v1/audio/transcriptions", headers=auth("live"),
                            files={"file": ("jfk.flac", jfk)}, data={"model": "whisper-1"},
                            timeout=300)
        task = wait(client, stack.url, reply.headers["x-task-id"], "live")
        waited = task["started_at"] - task["created_at"]
        estimate = float(reply.headers.get("x-estimated-wait", "nan"))
        error = abs(estimate - waited)
        rows.append([round(waited, 2), round(estimate, 2), round(error / max(waited, 1e-3), 2),
                     error <= max(0.3 * waited, ABSOLUTE_SLACK)])
        for task_id in batch:  # drain: the next rep starts from an idle worker
            client.delete(f"{stack.url}/v1/tasks/{task_id}", headers=auth("batch"), timeout=30)
        for task_id in batch:
            wait(client, stack.url, task_id, "batch")
    bc.table("2. lanes: an interactive call behind 25 aged batch tasks (s)",
             ["waited", "estimated", "error ratio", "within 30 % (or 0.1 s)"], rows)
    return {"reps": rows, "median_error_ratio": bc.median([row[2] for row in rows]),
            "within_target": sum(bool(row[3]) for row in rows)}


async def broker(redis_url: str) -> dict:
    client = Redis.from_url(redis_url)
    ledger = DeviceLedger(client, "bench/cpu", "red-team")
    await ledger.record_peak("faster-whisper", "tiny.en", 10_000.0)  # spurious: past 260
    spiked = time.monotonic()
    refusals = 0
    while not (await ledger.reserve("faster-whisper", "tiny.en", 100, 260, LEASE)).reserved:
        refusals += 1
        await asyncio.sleep(0.05)
    recovered = time.monotonic() - spiked
    await ledger.release()
    await client.aclose()
    row = {"budget_mib": 260, "spurious_peak_mib": 10_000, "lease_s": LEASE,
           "refused_reservations": refusals, "recovered_after_s": round(recovered, 2),
           "within_one_lease": recovered <= LEASE + 0.2}
    bc.table("3. broker: a spurious peak past the budget", list(row), [list(row.values())])
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=3, help="lane measurements")
    args = parser.parse_args()
    started = bc.machine()
    settings = {"api_keys": entries()}
    with bc.Stack(NAME, gateway_settings=settings,
                  worker_settings={"batch_promotion_seconds": "5", **settings}) as stack, \
            httpx.Client() as client:
        results = {"quotas": quotas(stack, client), "lanes": lanes(stack, client, args.reps)}
        assert stack.redis is not None
        results["broker"] = asyncio.run(broker(stack.redis.url))
    bc.write_json(NAME, results, started)


if __name__ == "__main__":
    bc.run(main)
