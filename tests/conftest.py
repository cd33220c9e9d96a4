from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from harness import procs
from harness.conversation import speak_to

#: the files that take a minute or more of a test process (their fixtures' engines included),
#: longest first: scripts/test.sh hands files out in collection order (xdist's reordering by
#: test count off), so the parallel part starts on these and ends on short files, not on a
#: lone long one while the other processes sit idle
LONG_FILES = ("test_diarization.py", "test_lifecycle.py", "test_backends_e2e.py",
              "test_realtime.py", "test_core_path.py", "test_ui_browser.py", "test_full_stack.py",
              "test_batching.py", "test_diarization_pyannote.py", "test_engine_xtts.py",
              "test_tts_stream.py", "test_store_lifetimes.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    missing = [name for name in LONG_FILES if not (Path(__file__).parent / name).is_file()]
    if missing:
        raise pytest.UsageError(f"LONG_FILES names files that do not exist: {missing}")
    rank = {name: index for index, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))  # stable


@pytest.fixture(scope="session", autouse=True)
def _stop_leftover_processes() -> Iterator[None]:
    """A fixture that failed half-way leaves no server running after the session."""
    yield
    procs.stop_leftovers()


@pytest.fixture(scope="session")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("stack")


@pytest.fixture(scope="session")
def allowed_dir(workdir: Path) -> Path:
    """A second allowed root, for path-input tests (symlinks, copies)."""
    path = workdir / "allowed"
    path.mkdir()
    return path


@pytest.fixture(scope="session")
def redis_server(workdir: Path) -> Iterator[procs.RedisServer]:
    server = procs.RedisServer(workdir / "redis").start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def module_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[procs.RedisServer]:
    """One redis-server for a test module, which its tests share (through `redis`)."""
    server = procs.RedisServer(tmp_path_factory.mktemp("module-redis")).start()
    yield server
    server.stop()


@pytest.fixture
def redis(module_redis: procs.RedisServer) -> procs.RedisServer:
    """The module's redis-server, emptied (FLUSHALL) for each test: a test sees and counts
    only what it did (one that failed with it stopped does not fail the next ones)."""
    if module_redis.proc is None or module_redis.proc.poll() is not None:
        module_redis.start()
    module_redis.client().flushall()
    return module_redis


@pytest.fixture(scope="session")
def stack(workdir: Path, redis_server: procs.RedisServer, allowed_dir: Path) -> Iterator[dict]:
    """One gateway and one faster-whisper worker (real tiny.en) on a real Redis."""
    roots = [str(procs.TEST_AUDIO), str(allowed_dir)]
    gateway = procs.gateway(redis_server.url, workdir, allowed_roots=roots).start()
    worker = procs.worker(redis_server.url, workdir, idle_unload_seconds="-1",
                          allowed_roots=roots).start()  # it checks task paths again
    yield {"gateway": gateway.url, "worker": worker.url, "redis": redis_server.client(),
           "worker_service": worker, "gateway_service": gateway}
    worker.stop()
    gateway.stop()


@pytest.fixture(scope="session")
def speech_clip(workdir: Path) -> Path:
    """A short clip of real speech with a known text (espeak-ng)."""
    path = workdir / "hello.wav"
    speak_to(path, "Hello world. Testing one two.")
    return path
