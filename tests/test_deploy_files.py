"""Static checks of the deployment files: what they reference exists and agrees."""

from __future__ import annotations

import configparser
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
    assert re.search(r"^RUN scripts/install\.sh all", text, flags=re.M)
    user = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
    assert user and user[-1] not in ("root", "0")
    assert "HEALTHCHECK" in text and "/health" in text
    assert 'CMD ["scripts/run_stack.sh"]' in text
    for script in ("install.sh", "run_stack.sh", "serve.sh", "test.sh", "smoke_test.sh"):
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
