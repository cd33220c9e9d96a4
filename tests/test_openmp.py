"""workers/openmp.py: the worker's OpenMP wait policy, decided before its engine loads; read
back from the engine's own libgomp (CTranslate2's wheel ships it), which prints what it runs
with when OMP_DISPLAY_ENV=verbose."""

from __future__ import annotations

import os
import subprocess

import pytest

from harness.procs import CORE_PYTHON, ROOT
from workers import openmp


@pytest.mark.parametrize(("policy", "host_workers", "preset", "chosen", "env"), [
    ("auto", 1, None, "library", None),  # alone on its host: the library's own spin
    ("auto", 0, None, "passive", "PASSIVE"),  # unknown (a pod): cores may be shared
    ("auto", 3, None, "passive", "PASSIVE"),
    ("auto", 1, "ACTIVE", "active", "ACTIVE"),  # an operator's own value stands
    ("auto", 2, "PASSIVE", "passive", "PASSIVE"),  # as after a re-exec
    ("passive", 1, None, "passive", "PASSIVE"),
    ("library", 4, "PASSIVE", "library", None),
])
def test_the_policy_follows_the_setting_and_the_host(
        monkeypatch: pytest.MonkeyPatch, policy: str, host_workers: int, preset: str | None,
        chosen: str, env: str | None) -> None:
    monkeypatch.setenv("OMP_WAIT_POLICY", preset or "")  # restored after, whatever it was
    if preset is None:
        monkeypatch.delenv("OMP_WAIT_POLICY")
    assert openmp.configure(policy, host_workers) == chosen
    assert os.environ.get("OMP_WAIT_POLICY") == env


def _spin_count(host_workers: int) -> str:
    """libgomp's spin count in a process that configures, then loads CTranslate2."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    env["OMP_DISPLAY_ENV"] = "verbose"
    out = subprocess.run(
        [str(CORE_PYTHON), "-c", "from workers import openmp\n"
         f"openmp.configure('auto', {host_workers})\nimport ctranslate2"],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
    (line,) = [line for line in out.stderr.splitlines() if "GOMP_SPINCOUNT" in line]
    return line.split("=")[1].strip().strip("'")


def test_the_engines_openmp_runs_with_the_choice() -> None:
    assert _spin_count(1) == "300000"  # libgomp's default: spin, then sleep
    assert _spin_count(2) == "0"  # PASSIVE: sleep at once
