"""Redis failing over through Sentinel, with real processes: a primary, a replica, three
sentinels, a gateway and workers that find Redis only through the sentinels.

40 submits; after the 10th the primary and the worker are killed with SIGKILL (a host that
died). The old primary comes back a moment later, as supervisord restarts it, and the
sentinels make it the new primary's replica: until a replica confirms a submit (WAIT), a
submit is answered 503 with Retry-After. A second worker takes over the dead one's pending
entry from the promoted replica (the consumer group lives in the stream, so it carried
across). A client polling every 20 ms sees only HTTP 200s and no task going back from a
terminal state.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from common import keys
from common.settings import Settings
from common.store import connection
from harness import procs
from harness.http_client import http

FAILOVER_MS = 1000  # sentinels' down-after-milliseconds: the test stays short
QUIET_DOWN_AFTER_MS = 30_000  # where nothing should fail over
SUBMITS, KILL_AFTER = 40, 10
UNUSABLE_URL = "redis://127.0.0.1:1/0"  # SPEECH_REDIS_URL is not used with sentinels
TERMINAL = ("SUCCEEDED", "FAILED", "CANCELLED")


class Poller(threading.Thread):
    """Polls the accepted tasks' Sage status in turn, every 20 ms, recording each reply."""

    def __init__(self, base: str, task_ids: list[str]) -> None:
        super().__init__(daemon=True)
        self.base, self.task_ids = base, task_ids
        self.codes: list[int] = []
        self.seen: dict[str, list[str]] = {}
        self.halt = threading.Event()

    def run(self) -> None:
        turn = 0
        with httpx.Client(timeout=15) as client:
            while not self.halt.is_set():
                if self.task_ids:
                    task_id = self.task_ids[turn % len(self.task_ids)]
                    turn += 1
                    reply = client.get(f"{self.base}/api/status", params={"taskid": task_id})
                    self.codes.append(reply.status_code)
                    if reply.status_code == 200:
                        states = self.seen.setdefault(task_id, [])
                        state = reply.json()["status"]
                        if not states or states[-1] != state:
                            states.append(state)
                time.sleep(0.02)


def _submit(client: httpx.Client, base: str, clip: Path, key: str,
            refusals: list[tuple[float, str | None]]) -> tuple[str, float]:
    """Submit until accepted, as a client honouring Retry-After does: (task id, when)."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        with clip.open("rb") as handle:
            reply = client.post(f"{base}/api/faster-whisper-submit",
                                files={"file": (clip.name, handle)},
                                headers={"Idempotency-Key": key})
        if reply.status_code == 200:
            return reply.json()["taskid"], time.monotonic()
        assert reply.status_code == 503, reply.text
        refusals.append((time.monotonic(), reply.headers.get("retry-after")))
        time.sleep(min(float(reply.headers.get("retry-after") or 1), 1.0))
    raise TimeoutError(f"submit {key} never accepted")


def _running_entries(node: procs.RedisServer, consumer: str) -> dict[str, str]:
    """entry id -> task id of what `consumer` holds, as `node` (the replica) has it."""
    client = node.client()
    queue = keys.queue("faster-whisper")
    held = client.xpending_range(queue, keys.WORKER_GROUP, "-", "+", 10, consumername=consumer)
    found = {}
    for entry in held:
        for entry_id, fields in client.xrange(queue, entry["message_id"], entry["message_id"]):
            found[entry_id.decode()] = fields[b"task_id"].decode()
    return found


def _restart_after_failover(group: procs.SentinelGroup, old: procs.RedisServer,
                            done: dict[str, Any]) -> None:
    """supervisord's part: the dead node starts again once the sentinels promoted another."""
    procs.wait_until(lambda: group.current_primary() is not old, 30, "a failover", 0.1)
    done["failed_over"] = time.monotonic()
    old.start()


@pytest.mark.alone  # it times the failover: another file's engines would stretch it
def test_failover_loses_no_accepted_task(tmp_path: Path, speech_clip: Path) -> None:
    group = procs.SentinelGroup(tmp_path / "redis", down_after_ms=FAILOVER_MS)
    settings: dict[str, Any] = {**group.settings(), "visibility_timeout_seconds": "4",
                                "idle_unload_seconds": "-1"}
    gateway = procs.gateway(UNUSABLE_URL, tmp_path, **settings).start()
    first = procs.worker(UNUSABLE_URL, tmp_path, consumer="first", **settings).start()
    second = procs.worker(UNUSABLE_URL, tmp_path, consumer="second", **settings)
    accepted: list[str] = []
    poller = Poller(gateway.url, accepted)
    refusals: list[tuple[float, str | None]] = []
    restarted: dict[str, Any] = {}
    try:
        poller.start()
        with httpx.Client(timeout=30) as client:
            for n in range(SUBMITS):
                task_id, when = _submit(client, gateway.url, speech_clip, f"k{n}", refusals)
                accepted.append(task_id)
                if n + 1 == KILL_AFTER:
                    held = procs.wait_until(lambda: _running_entries(group.replica, "first"),
                                            60, "the first worker to hold an entry", 0.005)
                    old = group.primary
                    os.killpg(first.pid, signal.SIGKILL)
                    old.kill()
                    killed = time.monotonic()
                    first.stop()
                    threading.Thread(target=_restart_after_failover,
                                     args=(group, old, restarted), daemon=True).start()
                    second.start(wait=False)
                elif n == KILL_AFTER:
                    accepted_again = when - killed
        finals = {task_id: _final(gateway.url, task_id) for task_id in accepted}
        # an OpenAI call waits on the gateway's pub/sub connection: it found the new primary
        with speech_clip.open("rb") as handle:
            call = http.post(f"{gateway.url}/v1/audio/transcriptions", timeout=60,
                              files={"file": (speech_clip.name, handle)},
                              data={"model": "whisper-1"})
    finally:
        poller.halt.set()
        poller.join(20)
        second.stop()
        first.stop()
        gateway.stop()
        group.stop()
    print(f"accepted again after {accepted_again:.1f} s, {len(refusals)} refusals, "
          f"{len(poller.codes)} polls, held {held}")
    assert call.status_code == 200 and call.json()["text"].strip(), call.text
    assert len(set(accepted)) == SUBMITS  # one task per submit, none twice
    assert {view["status"] for view in finals.values()} == {"SUCCEEDED"}, finals
    assert refusals, "no submit was refused while there was no primary"
    assert all(retry_after for _, retry_after in refusals)
    assert accepted_again < 30, f"submits accepted again only after {accepted_again:.1f} s"
    assert "failed_over" in restarted
    # the dead worker's entry: taken over by the second worker from the promoted replica
    for task_id in held.values():
        assert finals[task_id]["worker"] == "second" and finals[task_id]["deliveries"] >= 2
    assert len(poller.codes) > 200 and set(poller.codes) == {200}
    for task_id, states in poller.seen.items():
        terminal = [i for i, state in enumerate(states) if state in TERMINAL]
        assert not terminal or terminal[0] == len(states) - 1, (task_id, states)
        assert "FAILED" not in states, (task_id, states)


def test_a_sentinel_that_never_answers_costs_a_lookup_a_second(tmp_path: Path) -> None:
    """The primary is looked up from the sentinels one after another: one that accepts
    connections and never answers (its host frozen, or gone with the primary) comes first in
    the list here, and a call through the sentinels still answers within a few seconds (it
    took 30 s: a 10 s socket timeout, tried three times)."""
    primary = procs.RedisServer(tmp_path / "primary").start()
    sentinel = procs.SentinelServer(tmp_path / "sentinel", primary, quorum=1).start()
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # connects complete in the kernel; nothing ever reads or answers

    async def timed_ping() -> float:
        settings = Settings(_env_file=None, redis_sentinel_master=sentinel.master,  # type: ignore[call-arg]
                            redis_sentinels=[f"127.0.0.1:{silent.getsockname()[1]}",
                                             sentinel.address])
        client = connection.worker_client(settings, "lookup")
        started = time.monotonic()
        assert await client.ping()
        took = time.monotonic() - started
        await client.aclose()
        return took

    try:
        took = asyncio.run(timed_ping())
    finally:
        silent.close()
        sentinel.stop()
        primary.stop()
    assert took < 4, f"a call through the sentinels took {took:.1f} s"


def _final(base: str, task_id: str) -> dict[str, Any]:
    def done() -> dict[str, Any] | None:
        view = http.get(f"{base}/v1/tasks/{task_id}", timeout=15)
        if view.status_code != 200:
            return None
        body = view.json()
        return body if body["status"] in TERMINAL else None
    return procs.wait_until(done, 180, f"task {task_id}", 0.2)


def test_the_supervisord_example_runs_a_primary_a_replica_and_three_sentinels(
        tmp_path: Path) -> None:
    ports = {name: procs.free_port() for name in ("REDIS_PRIMARY_PORT", "REDIS_REPLICA_PORT",
                                                  "SENTINEL_PORT_1", "SENTINEL_PORT_2",
                                                  "SENTINEL_PORT_3")}
    # nothing fails over here: a primary a loaded machine starts slowly is not taken for dead
    env = {**os.environ, **{k: str(v) for k, v in ports.items()},
           "SPEECH_RUN_DIR": str(tmp_path), "SENTINEL_DOWN_AFTER_MS": str(QUIET_DOWN_AFTER_MS)}
    supervisord = procs.spawn([str(procs.VENVS / "core" / "bin" / "supervisord"), "-c",
                               str(procs.ROOT / "deploy" / "sentinel.supervisord.conf")],
                              env=env, cwd=procs.ROOT, stdout=(tmp_path / "out").open("ab"),
                              stderr=subprocess.STDOUT)
    try:
        sentinels = {ports[f"SENTINEL_PORT_{n}"]: redis.Redis(
            port=ports[f"SENTINEL_PORT_{n}"], socket_timeout=2, decode_responses=True)
            for n in (1, 2, 3)}
        procs.wait_until(lambda: procs.sentinels_see(sentinels, "speech",
                                                     ports["REDIS_REPLICA_PORT"]),
                         procs.SENTINEL_READY_SECONDS,
                         "the example's sentinels to see the replica and each other", 0.5)
        for sentinel in sentinels.values():
            assert sentinel.sentinel_get_master_addr_by_name("speech") == (
                "127.0.0.1", ports["REDIS_PRIMARY_PORT"])
            state = sentinel.sentinel_master("speech")
            assert int(state["down-after-milliseconds"]) == QUIET_DOWN_AFTER_MS, state
            assert int(state["quorum"]) == 2, state
        replica = redis.Redis(port=ports["REDIS_REPLICA_PORT"], socket_timeout=2)
        link = replica.info("replication")
        assert link["role"] == "slave" and link["master_port"] == ports["REDIS_PRIMARY_PORT"]

        # a switchover promotes the replica; then the promoted node is restarted (a crash
        # and autorestart, a deploy): it must come back as the primary the sentinels named,
        # not as a replica of its own replica (then nothing could write until someone came)
        first = next(iter(sentinels.values()))
        first.execute_command("SENTINEL", "FAILOVER", "speech")
        procs.wait_until(lambda: replica.info("replication")["role"] == "master"
                         and all(s.sentinel_get_master_addr_by_name("speech")[1]
                                 == ports["REDIS_REPLICA_PORT"]
                                 for s in sentinels.values()), 60, "the switchover", 0.2)
        ctl = [str(procs.VENVS / "core" / "bin" / "supervisorctl"), "-c",
               str(procs.ROOT / "deploy" / "sentinel.supervisord.conf")]
        restart = subprocess.run([*ctl, "restart", "redis-replica"], env=env, cwd=procs.ROOT,
                                 capture_output=True, text=True, timeout=60)
        assert "started" in restart.stdout, restart.stdout + restart.stderr

        def writable() -> bool:
            try:
                return replica.info("replication")["role"] == "master" and bool(
                    replica.set("probe", "1"))
            except redis.RedisError:
                return False

        procs.wait_until(writable, 20, "the restarted primary to take writes again", 0.2)
        primary = redis.Redis(port=ports["REDIS_PRIMARY_PORT"], socket_timeout=2)
        procs.wait_until(lambda: primary.info("replication").get("master_port")
                         == ports["REDIS_REPLICA_PORT"], 30, "the old primary to follow it", 0.2)
    finally:
        procs.stop(supervisord, timeout=60)
