"""The gateway while Redis is down: clear answers, Sage-safe polls, and it recovers. Redis
is the process that dies here: the worker runs in-process (tests/inprocess.py)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import redis as redis_lib

from harness import procs
from harness.http_client import http
from tests.helpers import JFK, status, submit_file, wait_done
from tests.inprocess import InProcessWorker, worker_settings


@pytest.fixture
def done(tmp_path: Path) -> Iterator[tuple[procs.RedisServer, str, str]]:
    """A Redis, a gateway and an in-process worker, and a task they ran (its id)."""
    redis = procs.RedisServer(tmp_path / "redis").start()
    gateway = procs.gateway(redis.url, tmp_path).start()
    worker = InProcessWorker(worker_settings(redis.url)).start()
    try:
        task_id = submit_file(gateway.url, JFK).json()["taskid"]
        assert wait_done(gateway.url, task_id)["status"] == "SUCCEEDED"
        yield redis, gateway.url, task_id
    finally:
        worker.stop()
        gateway.stop()
        redis.stop()


def test_gateway_answers_clearly_while_redis_is_down(
        done: tuple[procs.RedisServer, str, str]) -> None:
    redis, base, task_id = done
    redis.stop()
    refused = submit_file(base, JFK)
    assert refused.status_code == 503
    assert refused.json()["status"] == "FAILED" and "unavailable" in refused.json()["error"]
    poll = status(base, task_id)  # 200, and not FAILED: Sage would give up for good
    assert poll["status"] == "PENDING" and "unavailable" in poll["detail"]
    assert http.get(f"{base}/ready").status_code == 503
    assert http.get(f"{base}/health").status_code == 200
    redis.start()  # same port and data directory: the AOF brings the task back
    assert status(base, task_id)["status"] == "SUCCEEDED"
    again = submit_file(base, JFK).json()["taskid"]
    assert wait_done(base, again, timeout=60)["status"] == "SUCCEEDED"
    redis.client().flushall()  # a Redis that lost everything (no AOF): the worker's
    lost = submit_file(base, JFK).json()["taskid"]  # consumer group is gone too
    assert wait_done(base, lost, timeout=60)["status"] == "SUCCEEDED"


def test_polls_answer_within_seconds_while_redis_is_paused(
        done: tuple[procs.RedisServer, str, str]) -> None:
    """A paused Redis (SIGSTOP: its socket open, nothing answered; a stalled host or a
    partition alike) makes no poll wait: Sage's is HTTP 200 PENDING "unavailable" and the
    REST view a 503, each within a few seconds (the client's own timeouts add up to half a
    minute); once Redis resumes the task reads SUCCEEDED."""
    redis, base, task_id = done
    assert redis.proc is not None
    os.kill(redis.proc.pid, signal.SIGSTOP)
    try:
        for _ in range(2):  # the second finds the first's connection still hung
            started = time.monotonic()
            poll = status(base, task_id)
            assert time.monotonic() - started < 5, time.monotonic() - started
            assert poll["status"] == "PENDING" and "unavailable" in poll["detail"], poll
            started = time.monotonic()
            view = http.get(f"{base}/v1/tasks/{task_id}", timeout=30)
            assert time.monotonic() - started < 5 and view.status_code == 503, view.text
    finally:
        os.kill(redis.proc.pid, signal.SIGCONT)
    assert wait_done(base, task_id, timeout=60)["status"] == "SUCCEEDED"


def test_a_store_that_refuses_the_read_fails_the_poll_rather_than_keep_it_pending(
        done: tuple[procs.RedisServer, str, str]) -> None:
    """An error no retry cures (here WRONGTYPE: another application's value at the task's
    key; an ACL's NOPERM alike) is no outage: Sage's poll is FAILED `store_error` (PENDING
    would have it poll forever) and the REST view a 500, neither quoting Redis's text; the
    other tasks are served as before."""
    redis, base, task_id = done
    other = submit_file(base, JFK).json()["taskid"]
    assert wait_done(base, other)["status"] == "SUCCEEDED"
    client = redis.client()
    client.delete(f"sg:task:{task_id}")
    client.set(f"sg:task:{task_id}", "another application's value")
    poll = status(base, task_id)
    assert (poll["status"], poll["code"]) == ("FAILED", "store_error"), poll
    assert "WRONGTYPE" in poll["error"] and "kind of value" not in poll["error"], poll
    view = http.get(f"{base}/v1/tasks/{task_id}", timeout=30)
    assert view.status_code == 500 and view.json()["error"]["code"] == "store_error", view.text
    assert "Retry-After" not in view.headers
    # polls arriving together share one script call: the bad key fails its own poll only
    with ThreadPoolExecutor(max_workers=12) as pool:
        polls = list(pool.map(lambda i: status(base, task_id if i % 4 == 0 else other),
                              range(96)))
    assert all(poll["status"] == "FAILED" for poll in polls[::4]), polls[::4]
    others = [poll for i, poll in enumerate(polls) if i % 4]
    assert all(poll["status"] == "SUCCEEDED" for poll in others), others
    # … where a full Redis (noeviction: tasks expire and finish) is a wait, not a refusal
    client.config_set("maxmemory", 1)
    try:
        full = submit_file(base, JFK)
        assert full.status_code == 503 and full.headers["Retry-After"] == "1", full.text
        assert status(base, other)["status"] in ("PENDING", "SUCCEEDED")
    finally:
        client.config_set("maxmemory", 0)
    # … and an ACL that denies the gateway the read (its user, "default", here) a refusal
    client.acl_setuser("admin", enabled=True, passwords=["+admin"], keys=["*"],
                       channels=["*"], commands=["+@all"])
    admin = redis_lib.Redis(port=redis.port, username="admin", password="admin")
    admin.acl_setuser("default", enabled=True, nopass=True, keys=["*"], channels=["*"],
                      commands=["+@all", "-hmget", "-hgetall"])
    try:
        poll = status(base, other)
        assert (poll["status"], poll["code"]) == ("FAILED", "store_error"), poll
        # (a script's denied command is an ERR; the view's own HGETALL a NOPERM)
        assert "(ERR)" in poll["error"] and "hmget" not in poll["error"], poll
        view = http.get(f"{base}/v1/tasks/{other}", timeout=30)
        assert view.status_code == 500 and "(NOPERM)" in view.json()["error"]["message"], \
            view.text
    finally:
        admin.acl_setuser("default", enabled=True, nopass=True, keys=["*"], channels=["*"],
                          commands=["+@all"])
    assert status(base, other)["status"] == "SUCCEEDED"


def test_which_store_errors_are_a_wait() -> None:
    """The codes a wait cures stay a 503, also where a Redis before 7.0 wraps a script's
    refused write in its own error; those no retry cures are refused, named by code only."""
    from redis.exceptions import NoPermissionError, OutOfMemoryError, ResponseError

    from common.store.connection import error_code, store_refused

    assert not store_refused(OutOfMemoryError("command not allowed", status_code="OOM"))
    assert not store_refused(ResponseError(
        "Error running script (call to f_0123): @user_script:12: -OOM command not allowed "
        "when used memory > 'maxmemory'"))
    assert not store_refused(ResponseError("MISCONF Redis is configured to save RDB snapshots"))
    assert store_refused(NoPermissionError("no permissions to run 'hgetall'", status_code="NOPERM"))
    assert store_refused(ResponseError("WRONGTYPE Operation against a key holding the wrong kind"))
    assert error_code(NoPermissionError("user x: 'hgetall'", status_code="NOPERM")) \
        == "NOPERM"
    assert error_code(ResponseError("user_script:1: Script attempted something")) \
        == "ResponseError"
