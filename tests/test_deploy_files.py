"""Static checks of the deployment files: what they reference exists and agrees."""

from __future__ import annotations

import configparser
import hashlib
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

from common.backends import BACKENDS
from harness.procs import ROOT, free_port, stack_env

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
    installs = re.findall(r"^RUN (?:.*\\\n)*?.*scripts/install\.sh (?:--[a-z-]+ )?\$ENVS"
                          r"(?:.*\\\n)*.*$", text, flags=re.M)
    assert len(installs) == 2  # the environments, then the project (the test below)
    for install in installs:
        assert "--tests" not in install and "rm -rf /tmp/uv-cache" in install
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
        # pinned per program on a host with several cards (empty by default: the host's)
        prefix = BACKENDS[backend].prefix
        assert f'SPEECH_GPU="%(ENV_{prefix}_GPU)s"' in section["environment"], backend
        assert defaults()[f"{prefix}_GPU"] == "", backend
        for option in ("autorestart", "startsecs", "startretries", "stopwaitsecs",
                       "stopasgroup", "killasgroup", "numprocs"):
            assert option in section, (backend, option)
        assert int(section["stopwaitsecs"]) > 20  # > the worker's default stop grace
    for env_var in set(WORKERS.values()):
        env_name = defaults()[env_var].split("/")[1]
        assert (ROOT / "deploy" / "envs" / f"{env_name}.txt").is_file()


def test_supervisord_lets_the_gateway_drain_before_sigkill() -> None:
    """supervisord SIGKILLs a program stopwaitsecs after SIGTERM: the gateway's servers drain
    for up to the request timeout + 30 s (gateway/process/launcher.py), which the wait covers."""
    from common.settings import Settings

    parser = configparser.RawConfigParser()
    parser.read_string((ROOT / "deploy" / "supervisord.conf").read_text())
    wait = int(parser["program:gateway"]["stopwaitsecs"])
    assert wait >= Settings().request_timeout_seconds + 30 + 5


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


def sourced_env(**variables: str) -> dict[str, str]:
    """What scripts/env.sh exports, from a clean environment holding only `variables`."""
    script = 'source scripts/env.sh; echo "$SPEECH_REDIS_PORT $SPEECH_REDIS_URL $SPEECH_PORT"'
    result = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True,
                            env={"PATH": os.environ["PATH"], **variables}, timeout=30)
    assert result.returncode == 0, result.stderr
    port, url, http_port = result.stdout.split()
    return {"SPEECH_REDIS_PORT": port, "SPEECH_REDIS_URL": url, "SPEECH_PORT": http_port}


def test_the_services_follow_the_bundled_redis_port() -> None:
    """`SPEECH_REDIS_PORT=6380 scripts/serve.sh` starts Redis on 6380 and the services must
    connect there, not to whatever holds 6379; a URL the caller gives is kept."""
    assert sourced_env() == {"SPEECH_REDIS_PORT": "6379", "SPEECH_PORT": "8000",
                             "SPEECH_REDIS_URL": defaults()["SPEECH_REDIS_URL"]}
    assert sourced_env(SPEECH_REDIS_PORT="6380")["SPEECH_REDIS_URL"] \
        == "redis://127.0.0.1:6380/0"
    given = "redis://10.0.0.5:6379/2"
    assert sourced_env(SPEECH_REDIS_PORT="6380", SPEECH_REDIS_URL=given)["SPEECH_REDIS_URL"] \
        == given
    # a remote Redis: the bundled one's port says nothing about it
    assert sourced_env(SPEECH_REDIS_PORT="6380", SPEECH_LOCAL_REDIS="false")[
        "SPEECH_REDIS_URL"] == defaults()["SPEECH_REDIS_URL"]


def test_the_gateway_stops_first_and_the_documented_runs_wait_for_the_whole_stop() -> None:
    """supervisord stops one program at a time, the highest priority first: the gateway's
    drain must come before the workers stop (its open calls wait on tasks they run), Redis
    last; and podman/docker SIGKILL 10 s after `stop`, so every documented `podman run` gives
    the sum of every program's stopwaitsecs."""
    programs: dict[str, dict[str, int]] = {}
    for name, body in re.findall(r"^\[program:([^\]]+)\]\n(.*?)(?=^\[|\Z)",
                                 (ROOT / "deploy" / "supervisord.conf").read_text(),
                                 flags=re.M | re.S):
        settings = dict(re.findall(r"^(priority|stopwaitsecs)=(\d+)$", body, flags=re.M))
        programs[name] = {key: int(value) for key, value in settings.items()}
    workers = [p for name, p in programs.items() if name not in ("gateway", "redis")]
    assert len(workers) >= 5, programs
    assert programs["gateway"]["priority"] > max(p["priority"] for p in workers) \
        > programs["redis"]["priority"], programs
    whole_stop = sum(p["stopwaitsecs"] for p in programs.values())
    assert whole_stop <= 900, whole_stop
    for path in (ROOT / "Containerfile", ROOT / "docs" / "deploy.md"):
        runs = re.findall(r"^\W*(?:podman|docker) run\b.*$", path.read_text(), flags=re.M)
        assert runs, path
        for run in runs:
            assert "--stop-timeout 900" in run, (path.name, run)
    image = (ROOT / "scripts" / "image.sh").read_text()
    assert "--stop-timeout 900" in image and "stop -t 900" in image


def test_containerfile_installs_the_environments_before_the_code() -> None:
    """A code change rebuilds only the project's editable install, not the environments:
    the lock install comes before any code is copied, the project install after it."""
    text = (ROOT / "Containerfile").read_text()
    steps = re.findall(r"^(COPY|RUN)\s+((?:.*\\\n)*.*)$", text, flags=re.M)
    locks = next(i for i, (kind, body) in enumerate(steps)
                 if kind == "RUN" and "scripts/install.sh --no-project $ENVS" in body)
    project = next(i for i, (kind, body) in enumerate(steps)
                   if kind == "RUN" and "scripts/install.sh --project-only $ENVS" in body)
    code = [i for i, (kind, body) in enumerate(steps)
            if kind == "COPY" and re.search(r"\b(common|gateway|workers)/", body)]
    assert code and locks < min(code) and max(code) < project
    for kind, body in steps[:locks]:  # what the environment layer depends on
        if kind == "COPY":
            for source in body.split()[:-1]:
                assert source in ("pyproject.toml", "README.md", "deploy/envs/",
                                  "scripts/install.sh", "scripts/uv.sh"), source
    installer = (ROOT / "scripts" / "install.sh").read_text()
    assert "--no-project" in installer and "--project-only" in installer


def test_the_stack_refuses_to_start_on_a_port_something_else_holds(tmp_path: Path) -> None:
    """A Debian host runs its redis-server package on 6379 unless told not to: the stack's
    own Redis would end FATAL there and the workers quietly use the other one (no AOF, not
    var/redis). run_stack.sh says which port is taken and starts nothing; so for the
    gateway's port."""
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        held = str(holder.getsockname()[1])
        for name, env in (("SPEECH_REDIS_PORT", {"SPEECH_REDIS_PORT": held,
                                                 "SPEECH_PORT": str(free_port())}),
                          ("SPEECH_PORT", {"SPEECH_LOCAL_REDIS": "false", "SPEECH_PORT": held})):
            run = subprocess.run(
                [str(ROOT / "scripts" / "run_stack.sh")], cwd=ROOT, capture_output=True,
                text=True, timeout=60,
                env=stack_env(SPEECH_RUN_DIR=str(tmp_path), SPEECH_SUPERVISORD="false",
                              SPEECH_HOST="127.0.0.1", **env))
            assert run.returncode == 2, (name, run.stdout, run.stderr)
            assert f"port {held} ({name}) is taken" in run.stderr, (name, run.stderr)
