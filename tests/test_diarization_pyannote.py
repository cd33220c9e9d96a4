"""pyannote.audio from a local checkpoint directory (issue 25): a real gateway and a
faster-whisper worker running in `.venvs/pyannote` with SPEECH_DIARIZATION_MODEL=pyannote:DIR,
DIR being the tiny randomly initialised pipeline scripts/tiny_models/pyannote_pipeline.py saves in
pyannote's own layout (loaded by `Pipeline.from_pretrained`, as a real checkpoint is).

The pipeline is random, so its speakers mean nothing: what is checked is the path (a diarized
task end to end, labels on every segment, the pipeline loaded with the model and unloaded with
it, its memory given back).
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.settings import Settings
from harness import conversation, procs
from harness.http_client import http
from tests.helpers import JFK, settled_idle, submit_file, wait_done, wait_sampling_loaded
from tests.tiny import env_python, tiny_model

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not env_python("pyannote").exists(),
                                 reason="the pyannote environment is not installed "
                                        "(scripts/install.sh pyannote)")]
IDLE_UNLOAD_SECONDS = 3


@pytest.fixture(scope="module")
def service(workdir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    root = tmp_path_factory.mktemp("pyannote")
    talk = root / "conversation.wav"
    conversation.build(talk, conversation.TURNS[:3])  # two voices, ~10 s: the path is the point
    pipeline = tiny_model("pyannote")
    redis = procs.RedisServer(workdir / "redis-pyannote").start()
    models = {"faster-whisper": {"tiny.en": "bundled"}}
    gateway = procs.gateway(redis.url, workdir, allowed_roots=[str(root)], models=models).start()
    worker = procs.worker(redis.url, workdir, python=env_python("pyannote"),
                          allowed_roots=[str(root)], models=models,
                          diarization_model=f"pyannote:{pipeline}",
                          idle_unload_seconds=str(IDLE_UNLOAD_SECONDS)).start()
    yield {"gateway": gateway.url, "worker": worker.url, "talk": talk}
    worker.stop()
    gateway.stop()
    redis.stop()


def test_a_diarized_task_runs_on_the_tiny_pipeline_and_its_memory_goes_back(
        service: dict) -> None:
    base, health = service["gateway"], f"{service['worker']}/health"
    cycles = []
    # two load-unload cycles (the second proves the first left nothing behind); the first
    # runs two tasks back to back while loaded
    for cycle in (({"num_speakers": 2}, {}), ({"min_speakers": 1, "max_speakers": 3},)):
        samples: list[float] = []
        for params in cycle:
            reply = submit_file(base, service["talk"], diarize="true", **params)
            assert reply.status_code == 200, reply.text
            final, seen = wait_sampling_loaded(base, health, reply.json()["taskid"])
            samples += seen
            assert final["status"] == "SUCCEEDED", final
            result = final["result"]
            assert result["segments"] and result["speakers"], result
            for segment in result["segments"]:
                assert segment["speaker"] in result["speakers"]
            assert list(result["speakers"]) == [f"SPEAKER_{i:02d}"
                                                for i in range(len(result["speakers"]))]
            if "num_speakers" in params:
                assert len(result["speakers"]) <= 2
        # nothing loaded, and RSS back within the re-exec ratio of the fresh image's
        idle = settled_idle(health, Settings().reexec_rss_ratio)
        cycles.append((max(samples), idle["memory"]["rss_mib"]))
    # the pipeline's weights (~27 MB: WeSpeaker ResNet34 + PyanNet) and tiny.en (~75 MB) go
    # with each unload
    for loaded_mib, idle_mib in cycles:
        assert loaded_mib - idle_mib > 30, cycles


def test_a_diarizer_that_fails_to_load_stops_diarized_tasks_only(
        workdir: Path, tmp_path: Path) -> None:
    """A pipeline whose config is broken fails at load (after the model's): the task FAILS,
    the worker exits (as for any half-built load), and the failure opens the diarizer's
    breaker, not tiny.en's: diarized submits are refused, plain ones still run."""
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model("pyannote"), broken)
    (broken / "config.yaml").write_text("pipeline: [unclosed\n")
    redis = procs.RedisServer(workdir / "redis-broken-diarizer").start()
    models = {"faster-whisper": {"tiny.en": "bundled"}}
    settings = {"models": models, "diarization_model": f"pyannote:{broken}",
                "breaker_failures": "1", "min_uptime_seconds": "0"}
    gateway = procs.gateway(redis.url, workdir, **settings).start()
    worker = procs.worker(redis.url, workdir, python=env_python("pyannote"), **settings).start()
    try:
        diarized = submit_file(gateway.url, JFK, diarize="true").json()["taskid"]
        assert wait_done(gateway.url, diarized)["status"] == "FAILED"
        assert worker.proc is not None and worker.proc.wait(timeout=60) != 0  # it exits
        breakers = http.get(f"{gateway.url}/ready", timeout=30).json()[
            "backends"]["faster-whisper"]["breakers"]
        assert breakers["diarizer"]["state"] == "open", breakers
        assert breakers["tiny.en"]["state"] == "closed", breakers
        refused = submit_file(gateway.url, JFK, diarize="true")
        assert refused.status_code == 503 and "the diarizer" in refused.json()["error"]
        plain = submit_file(gateway.url, JFK).json()["taskid"]
        worker = procs.worker(redis.url, workdir, python=env_python("pyannote"),
                              **settings).start()
        assert wait_done(gateway.url, plain)["status"] == "SUCCEEDED"
        reset = http.delete(f"{gateway.url}/v1/breakers/faster-whisper/diarizer", timeout=30)
        assert reset.status_code == 200 and reset.json()["previous"]["state"] == "open"
        assert submit_file(gateway.url, JFK, diarize="true").status_code == 200
        metrics = http.get(f"{gateway.url}/metrics", timeout=30).text
        assert 'model="diarizer"' in metrics
    finally:
        worker.stop()
        gateway.stop()
        redis.stop()
