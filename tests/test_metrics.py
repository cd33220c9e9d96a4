"""`/metrics` exists and moves: a task increments counters and histograms get samples."""

from __future__ import annotations

import re

from harness.http_client import http
from tests.helpers import JFK, submit_file, wait_done


def sample(text: str, name: str, **labels: str) -> float:
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
        if line.split("{")[0].split(" ")[0] == name and all(found.get(k) == v
                                                             for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


def test_metrics_move_with_a_task(stack: dict) -> None:
    gateway = stack["gateway"]
    before = http.get(f"{gateway}/metrics").text
    fw = {"backend": "faster-whisper"}
    wait_done(gateway, submit_file(gateway, JFK).json()["taskid"])
    after = http.get(f"{gateway}/metrics").text
    assert sample(after, "speech_redis_up") == 1
    assert (sample(after, "speech_tasks_total", outcome="SUCCEEDED", **fw)
            == sample(before, "speech_tasks_total", outcome="SUCCEEDED", **fw) + 1)
    for histogram in ("queue_wait_seconds", "inference_seconds", "end_to_end_seconds",
                      "realtime_factor"):
        name = f"speech_{histogram}_count"
        assert sample(after, name, **fw) == sample(before, name, **fw) + 1, histogram
        assert sample(after, f"speech_{histogram}_sum", **fw) > 0
    assert sample(after, "speech_model_load_seconds_count", **fw) >= 1  # the first load
    assert sample(after, "speech_workers_live", **fw) >= 1
    assert sample(after, "speech_worker_rss_mib", **fw) > 10
    assert sample(after, "speech_worker_model_loaded", model="tiny.en", **fw) == 1
    assert sample(after, "speech_queue_waiting", **fw) == 0  # its one task is done
    assert sample(after, "speech_worker_starts_total", **fw) >= 1
