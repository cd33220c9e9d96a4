"""qwen3, vibevoice and parakeet end to end: gateway -> Redis -> worker in the engine's own
environment, on tiny checkpoints loaded through the production code path (issues 5, 6)."""

from __future__ import annotations

import json
import shutil
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from openai.types.audio import TranscriptionVerbose

from common import keys
from common.backends import BACKENDS as TABLE
from harness import procs
from harness.http_client import http
from harness.procs import TEST_AUDIO, wait_until
from tests.helpers import JFK, submit_file, wait_done
from tests.tiny import env_python, tiny_model

#: every ASR backend on a tiny checkpoint: backend -> (environment, tiny model)
BACKENDS = {name: (row.env, name) for name, row in TABLE.items()
            if row.kind == "asr" and row.fixture.builder}
IDLE_UNLOAD_SECONDS = 3
PARAKEET_WINDOW_SECONDS = 20
SEGMENT_FIELDS = {"id", "seek", "start", "end", "text", "tokens", "temperature",
                  "avg_logprob", "compression_ratio", "no_speech_prob"}


@pytest.fixture(scope="module")
def e2e(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    workdir = tmp_path_factory.mktemp("backends")
    available = {b: tiny_model(m) for b, (env, m) in BACKENDS.items()
                 if env_python(env).exists()}
    if not available:
        pytest.skip("no engine environment (.venvs/hf, .venvs/nemo) is installed")
    broken = workdir / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    models = {}
    for backend, source in available.items():
        broken_source = broken  # a directory, or a checkpoint file that is none
        if entry := TABLE[backend].fixture.entry:
            # an archive (a .nemo file is one) past the engine's cheap look, with no model in it
            broken_source = broken / f"{backend}-broken{Path(entry).suffix}"
            with tarfile.open(broken_source, "w") as archive:
                archive.add(broken / "config.json", arcname="config.json")
        copy = workdir / f"{backend}-copy"
        if source.is_dir():
            shutil.copytree(source, copy)
        else:
            copy.mkdir()
            copy = Path(shutil.copy(source, copy / source.name))
        models[backend] = {"tiny": str(source), "tiny-copy": str(copy),
                           "broken": str(broken_source)}
    redis = procs.RedisServer(workdir / "redis").start()
    gateway = procs.gateway(redis.url, workdir, models=models,
                            allowed_roots=[str(TEST_AUDIO)]).start()
    workers = {}
    for backend in available:
        env = BACKENDS[backend][0]
        workers[backend] = procs.worker(
            redis.url, workdir, backend=backend, python=env_python(env), models=models,
            idle_unload_seconds=str(IDLE_UNLOAD_SECONDS),
            parakeet_window_seconds=str(PARAKEET_WINDOW_SECONDS),
            parakeet_warmup_seconds=[1]).start()
    yield {"gateway": gateway.url, "workers": workers, "redis": redis}
    for worker in workers.values():
        worker.stop()
    gateway.stop()
    redis.stop()


@pytest.fixture(params=list(BACKENDS))
def backend(request: pytest.FixtureRequest, e2e: dict) -> str:
    if request.param not in e2e["workers"]:
        pytest.skip(f"the {BACKENDS[request.param][0]} environment is not installed")
    return request.param


def assert_well_formed(result: dict, backend: str, duration: float) -> None:
    assert result["backend"] == backend and result["model"] in ("tiny", "tiny-copy")
    assert result["duration"] == pytest.approx(duration, abs=0.1)
    assert result["usage"]["audio_seconds"] == pytest.approx(duration, abs=0.1)
    assert isinstance(result["text"], str)
    previous = 0.0
    for index, segment in enumerate(result["segments"]):
        assert segment["id"] == index
        assert previous <= segment["start"] <= segment["end"] <= duration + 0.1, segment
        assert {"start", "end", "text", "speaker"} <= set(segment)
        previous = segment["start"]


def test_sage_and_openai_endpoints(e2e: dict, backend: str) -> None:
    gateway = e2e["gateway"]
    reply = submit_file(gateway, JFK, backend=backend)
    assert reply.status_code == 200, reply.text
    final = wait_done(gateway, reply.json()["taskid"], timeout=240)
    assert final["status"] == "SUCCEEDED", final
    assert_well_formed(final["result"], backend, 11.0)
    assert final["usage"]["audio_seconds"] == pytest.approx(11.0, abs=0.1)
    if words := TABLE[backend].fixture.transcript:  # the taught tiny checkpoints
        assert words in final["result"]["text"]

    url = f"{gateway}/v1/audio/transcriptions"
    verbose = http.post(url, files={"file": JFK.open("rb")}, timeout=240,
                         data={"model": f"{backend}/tiny", "response_format": "verbose_json"})
    assert verbose.status_code == 200, verbose.text
    body = verbose.json()
    assert isinstance(body["duration"], float) and body["duration"] == pytest.approx(11.0, 0.01)
    assert all(set(s) >= SEGMENT_FIELDS for s in body["segments"])
    # the SDK's own type, strictly: `language` is a string even where the engine names none
    TranscriptionVerbose.model_validate(body, strict=True)
    assert body["language"] in ("english", "unknown"), body["language"]
    plain = http.post(url, files={"file": JFK.open("rb")}, timeout=240,
                       data={"model": f"{backend}/tiny", "response_format": "text"})
    assert plain.status_code == 200 and plain.text.strip() == body["text"].strip()
    diarized = http.post(url, files={"file": JFK.open("rb")}, timeout=240,
                          data={"model": f"{backend}/tiny", "response_format": "diarized_json"})
    if TABLE[backend].speakers:
        assert diarized.status_code == 200, diarized.text
        assert {s["speaker"] for s in diarized.json()["segments"]} == {"A", "B"}  # OpenAI's
    elif TABLE[backend].diarization:  # the worker's diarizer: JFK alone is one speaker
        assert diarized.status_code == 200, diarized.text
        assert {s["speaker"] for s in diarized.json()["segments"]} <= {"A"}
    else:
        assert diarized.status_code == 400
    translation = http.post(f"{gateway}/v1/audio/translations", files={"file": JFK.open("rb")},
                             data={"model": f"{backend}/tiny"}, timeout=60)
    assert translation.status_code == 400 and "translate" in translation.json()["error"]["message"]


def streamed(gateway: str, backend: str, **data: str) -> tuple[list[dict], dict]:
    """The deltas and the done event of a `stream=true` transcription."""
    events = []
    with http.stream("POST", f"{gateway}/v1/audio/transcriptions", timeout=240,
                     files={"file": (JFK.name, JFK.read_bytes())},
                     data={"model": f"{backend}/tiny", "stream": "true", **data}) as reply:
        assert reply.status_code == 200, reply.read()
        events = [json.loads(line[len("data: "):]) for line in reply.iter_lines()
                  if line.startswith("data: ")]
    deltas = [e for e in events if e["type"] == "transcript.text.delta"]
    assert events[-1]["type"] == "transcript.text.done", events[-1]
    return deltas, events[-1]


def test_streamed_deltas_add_up_to_the_text(e2e: dict, backend: str) -> None:
    """Whatever the engine joins its segments with (Whisper's carry their own space; these
    engines join theirs with one), a client that concatenates the deltas, as OpenAI's do,
    reads the transcript: live, and from a diarized stream's segments."""
    deltas, done = streamed(e2e["gateway"], backend)
    assert deltas and "".join(d["delta"] for d in deltas) == done["text"], (deltas, done)
    if TABLE[backend].diarization:
        deltas, done = streamed(e2e["gateway"], backend, response_format="diarized_json")
        assert "".join(d["delta"] for d in deltas) == done["text"], (deltas, done)


def test_same_file_twice_gives_the_same_result(e2e: dict, backend: str) -> None:
    finals = [wait_done(e2e["gateway"], submit_file(e2e["gateway"], JFK, backend=backend,
                                                    word_timestamps="false").json()["taskid"],
                        timeout=240) for _ in range(2)]
    assert finals[0]["result"] == finals[1]["result"]


def test_parakeet_long_audio_is_windowed_with_rebased_times(e2e: dict) -> None:
    if "parakeet" not in e2e["workers"]:
        pytest.skip("the nemo environment is not installed")
    audio = TEST_AUDIO / "multilingual.mp3"
    reply = submit_file(e2e["gateway"], audio, backend="parakeet", word_timestamps="true")
    final = wait_done(e2e["gateway"], reply.json()["taskid"], timeout=240)
    assert final["status"] == "SUCCEEDED", final
    result = final["result"]
    assert_well_formed(result, "parakeet", 59.9)
    starts = [s["start"] for s in result["segments"]]
    assert len(starts) >= 3 and max(starts) > 1.9 * PARAKEET_WINDOW_SECONDS  # 3 windows
    words = [w for s in result["segments"] for w in s["words"]]
    assert [w["start"] for w in words] == sorted(w["start"] for w in words)


def test_idle_unload_and_model_switch(e2e: dict, backend: str) -> None:
    worker = e2e["workers"][backend]

    def health() -> dict:
        return http.get(f"{worker.url}/health", timeout=5).json()

    task_id = submit_file(e2e["gateway"], JFK, backend=backend, model="tiny-copy").json()["taskid"]
    wait_until(lambda: health()["loaded_models"] == ["tiny-copy"], 120, "tiny-copy loaded", 0.05)
    assert wait_done(e2e["gateway"], task_id, timeout=240)["status"] == "SUCCEEDED"
    task_id = submit_file(e2e["gateway"], JFK, backend=backend, model="tiny").json()["taskid"]
    wait_until(lambda: health()["loaded_models"] == ["tiny"], 120, "switched to tiny", 0.05)
    assert wait_done(e2e["gateway"], task_id, timeout=240)["status"] == "SUCCEEDED"
    idle = wait_until(lambda: (h := health())["loaded_models"] == [] and h,
                      IDLE_UNLOAD_SECONDS + 10, "idle unload", 0.2)
    assert idle["state"] == "idle"


def test_load_failure_exits_the_worker(e2e: dict, backend: str) -> None:
    """Last in this module: it ends the backend's worker, as it does in production."""
    worker = e2e["workers"][backend]
    task_id = submit_file(e2e["gateway"], JFK, backend=backend, model="broken").json()["taskid"]
    assert worker.proc is not None
    assert worker.proc.wait(timeout=240) == 1
    assert "failed to load" in worker.log()
    record = e2e["redis"].client().hgetall(keys.task(task_id))
    assert b"failed to load" in record[b"error"]
    # stored FAILED before the exit: never redelivered to crash the next worker as well
    assert record[b"state"] == b"FAILED" and record[b"error_code"] == b"model_load_failed"
