"""The tiny checkpoints, built (once, cached) by scripts/make_tiny_models.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.procs import ROOT

MISSING_ENVIRONMENT = 3


def tiny_model(name: str) -> Path:
    """Path of the tiny checkpoint `name`; skips the test if its environment is missing."""
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "make_tiny_models.py"), name],
                          capture_output=True, text=True, timeout=900)
    if proc.returncode == MISSING_ENVIRONMENT:
        pytest.skip(proc.stderr.strip())
    if proc.returncode != 0:
        pytest.fail(f"building tiny {name} failed:\n{proc.stderr[-3000:]}")
    built, path = proc.stdout.split()[-2:]
    assert built == name
    return Path(path)


def env_python(env: str) -> Path:
    return ROOT / ".venvs" / env / "bin" / "python"
