"""The whole product as an operator runs it: supervisord with Redis, the gateway and every
worker of the backend table (each in its own environment, on its test fixture), checked by
the post-deploy smoke test, which must also name a worker that is down (issue 8)."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import httpx
import pytest

from common.backends import BACKENDS, KINDS
from harness import procs
from harness.http_client import http
from harness.procs import ROOT, TEST_AUDIO, wait_until
from tests.helpers import openmp_policies
from tests.tiny import env_python, tiny_model


def fixture_source(backend: str) -> str:
    fixture = BACKENDS[backend].fixture
    return fixture.source or str(tiny_model(backend))


def smoke_checks(backend: str) -> tuple[str, ...]:
    """The smoke test's gateway checks of a backend: Sage, and OpenAI where its kind has one."""
    return ("sage", "openai") if KINDS[BACKENDS[backend].kind].openai_names else ("sage",)


@pytest.fixture(scope="module")
def full_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    missing = sorted({row.env for row in BACKENDS.values() if not env_python(row.env).exists()})
    if missing:
        pytest.skip(f"environments missing: {', '.join(missing)} (scripts/install.sh all)")
    models = {name: {row.fixture.model: fixture_source(name)} for name, row in BACKENDS.items()}
    workdir = tmp_path_factory.mktemp("full")
    port, redis_port = procs.free_port(), procs.free_port()
    overrides = {f"{row.prefix}_ENABLED": "true" for row in BACKENDS.values()}
    env = procs.stack_env(
        SPEECH_RUN_DIR=str(workdir), SPEECH_PORT=str(port), SPEECH_LOCAL_REDIS="true",
        SPEECH_REDIS_PORT=str(redis_port), SPEECH_REDIS_URL=f"redis://127.0.0.1:{redis_port}/0",
        SPEECH_MODELS=models, SPEECH_ALLOWED_ROOTS=[str(TEST_AUDIO)], HF_HUB_OFFLINE="1",
        SPEECH_HEARTBEAT_SECONDS="0.5", SPEECH_PARAKEET_WARMUP_SECONDS="[1]",
        **overrides)
    supervisor = procs.Supervisor(workdir, env).start()
    url = f"http://127.0.0.1:{port}"

    def live_backends() -> set[str]:
        try:
            ready = http.get(f"{url}/ready", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return set()
        return {name for name, entry in ready.get("backends", {}).items() if entry["live"]}

    try:
        wait_until(lambda: live_backends() == set(BACKENDS), 180, "every worker live", 0.5)
        yield {"url": url, "supervisor": supervisor, "live": live_backends}
    finally:
        supervisor.stop()


def smoke(url: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(ROOT / "scripts" / "smoke_test.sh"), "--url", url, *args],
                          capture_output=True, text=True, timeout=600)


def test_smoke_test_passes_on_the_full_stack(full_stack: dict) -> None:
    result = smoke(full_stack["url"])
    assert result.returncode == 0, result.stdout + result.stderr
    lines = result.stdout.splitlines()
    assert not [line for line in lines if line.startswith("FAIL")]
    for backend in BACKENDS:
        for check in smoke_checks(backend):
            assert f"OK {backend} {check}:" in result.stdout, (backend, check)
        assert any(line.startswith(f"OK {backend} worker ") for line in lines), backend


def test_workers_sharing_a_host_run_openmp_passive(full_stack: dict) -> None:
    """Six programs enabled: scripts/run_stack.sh counts six workers on this host, so none
    spins between parallel regions (workers/openmp.py)."""
    logs = full_stack["supervisor"].workdir / "logs"
    for row in BACKENDS.values():
        chosen = openmp_policies(logs / f"{row.name}_00.log")
        assert chosen == {"passive"}, (row.name, chosen)


def test_smoke_test_names_a_broken_worker(full_stack: dict) -> None:
    supervisor: procs.Supervisor = full_stack["supervisor"]
    supervisor.ctl("stop", "parakeet:*")
    wait_until(lambda: "parakeet" not in full_stack["live"](), 30, "parakeet down", 0.2)
    result = smoke(full_stack["url"], "--backends", "faster-whisper,parakeet")
    assert result.returncode == 1
    assert "FAIL parakeet: no live worker" in result.stdout
    assert "OK faster-whisper sage:" in result.stdout
    # --cold, as in a KEDA cluster at zero: the gateway's checks wait for a worker to come
    cold = subprocess.Popen([str(ROOT / "scripts" / "smoke_test.sh"), "--url",
                             full_stack["url"], "--cold", "--backends", "parakeet",
                             "--timeout", "300"], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        time.sleep(2.0)  # its first submit is queued with no worker; then one starts
        supervisor.ctl("start", "parakeet:*")
        output, _ = cold.communicate(timeout=400)
    finally:
        if cold.poll() is None:
            cold.kill()
    assert cold.returncode == 0, output
    for check in smoke_checks("parakeet"):
        assert f"OK parakeet {check}:" in output, output
    assert "OK parakeet worker" not in output  # direct endpoints skipped
