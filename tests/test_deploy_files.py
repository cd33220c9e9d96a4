"""Static checks of the deployment files: what they reference exists and agrees."""

from __future__ import annotations

import configparser
import hashlib
import os
import re
import subprocess
import sys

from common.backends import BACKENDS
from harness.procs import ROOT

#: backend -> the variable naming its environment's interpreter
WORKERS = {name: f"SPEECH_{row.env.upper()}_PYTHON" for name, row in BACKENDS.items()}


def defaults() -> dict[str, str]:
    lines = (ROOT / "deploy" / "defaults.env").read_text().splitlines()
    return dict(line.split("=", 1) for line in lines if line and not line.startswith("#"))


def test_containerfile_copies_existing_paths_and_uses_the_installer() -> None:
    text = (ROOT / "Containerfile").read_text()
    copies = re.findall(r"^COPY\s+(.+?)\s+\S+$", text, flags=re.M)
    assert copies
    for sources in copies:
        for source in sources.split():
            assert (ROOT / source).exists(), f"Containerfile copies missing {source}"
    assert re.search(r"^ARG BASE=\S+\nFROM \$\{BASE\}$", text, flags=re.M)
    # the service's installer, without the test tools, its cache gone in the same step
    install = re.search(r"^RUN (?:.*\\\n)*?.*scripts/install\.sh \$ENVS(?:.*\\\n)*.*$", text,
                        flags=re.M)
    assert install and "--tests" not in install.group()
    assert "rm -rf /tmp/uv-cache" in install.group()
    user = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
    assert user and user[-1] not in ("root", "0")
    assert "HEALTHCHECK" in text and "/health" in text
    assert 'CMD ["scripts/run_stack.sh"]' in text
    for script in ("install.sh", "run_stack.sh", "serve.sh", "test.sh", "smoke_test.sh",
                   "lock.sh", "image.sh", "kube_smoke.sh"):
        assert os.access(ROOT / "scripts" / script, os.X_OK), script


def test_supervisord_conf_runs_every_worker_in_its_environment() -> None:
    text = (ROOT / "deploy" / "supervisord.conf").read_text()
    referenced = set(re.findall(r"%\(ENV_(\w+)\)s", text))
    missing = referenced - set(defaults())
    assert not missing, f"variables without a default in deploy/defaults.env: {missing}"
    parser = configparser.RawConfigParser()
    parser.read_string(text)
    for backend, python in WORKERS.items():
        section = parser[f"program:{backend}"]
        assert section["command"].startswith(f"%(ENV_{python})s -m workers")
        assert f'SPEECH_BACKEND="{backend}"' in section["environment"]
        for option in ("autorestart", "startsecs", "startretries", "stopwaitsecs",
                       "stopasgroup", "killasgroup", "numprocs"):
            assert option in section, (backend, option)
        assert int(section["stopwaitsecs"]) > 20  # > the worker's default stop grace
    for env_var in set(WORKERS.values()):
        env_name = defaults()[env_var].split("/")[1]
        assert (ROOT / "deploy" / "envs" / f"{env_name}.txt").is_file()


def test_generated_deploy_files_match_the_backend_table() -> None:
    """supervisord's worker programs, their defaults and the Sage map are what
    scripts/gen_deploy.py makes of common/backends.py: a row changed without rerunning it fails."""
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_deploy.py"), "--check"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_every_backend_names_an_existing_engine_module_and_environment() -> None:
    for name, row in BACKENDS.items():
        module = row.engine.split(":")[0]
        assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), (name, row.engine)
        assert (ROOT / "deploy" / "envs" / f"{row.env}.txt").is_file(), (name, row.env)
        if row.fixture.builder:
            assert (ROOT / "scripts" / "tiny_models" / row.fixture.builder).is_file(), name


def lock_inputs_hash(name: str) -> str:
    """What scripts/uv.sh's input_hash prints: the lock's inputs, hashed."""
    envs = ROOT / "deploy" / "envs"
    if name == "tests":
        data = (envs / "tests.in").read_bytes() + (envs / "core.lock").read_bytes()
    else:
        lines = (ROOT / "pyproject.toml").read_text().splitlines(keepends=True)
        start = next(i for i, line in enumerate(lines) if line.startswith("dependencies"))
        stop = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("]"))
        data = (envs / f"{name}.txt").read_bytes() + "".join(lines[start:stop + 1]).encode()
    return hashlib.sha256(data).hexdigest()[:16]


def test_every_environment_has_a_lock_made_from_its_inputs_as_they_are() -> None:
    """A requirements file (or pyproject's dependencies) changed without rerunning
    scripts/lock.sh fails here, as scripts/install.sh would refuse the stale lock."""
    envs = ROOT / "deploy" / "envs"
    names = [path.stem for path in envs.glob("*.txt")] + ["tests"]
    assert "core" in names
    stale = [name for name in names if not (envs / f"{name}.lock").is_file()
             or (envs / f"{name}.lock").read_text().splitlines()[0]
             != f"# inputs: {lock_inputs_hash(name)}"]
    assert not stale, f"run scripts/lock.sh {' '.join(stale)}"
    for name in names:
        pins = [line for line in (envs / f"{name}.lock").read_text().splitlines()
                if line and not line.startswith("#")]
        assert pins and all("==" in pin and "+" not in pin for pin in pins), name
    service = (envs / "core.lock").read_text()
    for tool in ("pytest", "ruff", "playwright"):  # the service install carries no test tool
        assert f"\n{tool}==" not in service, tool
