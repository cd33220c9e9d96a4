#!/usr/bin/env python3
"""Write the deployment files that follow from the backend table (common/backends.py).

- deploy/supervisord.conf: one worker program per backend, between the two marker lines
  (the hand-written header, Redis and gateway programs above them stay as they are);
- deploy/defaults.env: each environment's interpreter and each worker's defaults, between
  the two marker lines;
- deploy/sage/llm_api_map.csv: one Sage llmage row per backend, the whole file;
- deploy/k8s/base/workers.yaml, deploy/k8s/overlays/cpu/workers-cpu.yaml and
  deploy/k8s/components/no-keda/no-keda.yaml: one worker Deployment and KEDA ScaledObject
  per backend, the CPU overlay's patch of each, and the no-KEDA patches (scripts/gen_k8s.py),
  whole files.

    scripts/gen_deploy.py           # rewrite them
    scripts/gen_deploy.py --check   # exit 1 naming each file that differs (a test runs this)

Standard library only: any python3 runs it.
"""

from __future__ import annotations

import argparse
import csv
import io
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the backend table, when run as a script
import gen_k8s  # noqa: E402  (beside this file)

from common.backends import BACKENDS, KINDS, WORKER_PROCESS_ENV, Backend  # noqa: E402

SUPERVISORD = ROOT / "deploy" / "supervisord.conf"
DEFAULTS = ROOT / "deploy" / "defaults.env"
SAGE_MAP = ROOT / "deploy" / "sage" / "llm_api_map.csv"

CONF_BEGIN = "; === worker programs: generated from common/backends.py by scripts/gen_deploy.py ==="
CONF_END = "; === end of the generated worker programs ==="
ENV_BEGIN = "# === generated from common/backends.py by scripts/gen_deploy.py: edit the table ==="
ENV_END = "# === end of the generated lines ==="

#: the core environment runs the gateway too, whichever backends use it
GATEWAY_ENV = "core"

PROGRAM = """\
[program:{name}]
command=%(ENV_{python})s -m workers
process_name=%(program_name)s_%(process_num)02d
numprocs=%(ENV_{prefix}_REPLICAS)s
autostart=%(ENV_{prefix}_ENABLED)s
autorestart=true
priority=30
startsecs=3
startretries=5
stopsignal=TERM
stopwaitsecs=30
stopasgroup=true
killasgroup=true
environment=SPEECH_BACKEND="{name}",SPEECH_DEVICE="%(ENV_{prefix}_DEVICE)s",\
SPEECH_MEMORY_CAP_MIB="%(ENV_{prefix}_MEMORY_CAP_MIB)s",\
SPEECH_IDLE_UNLOAD_SECONDS="%(ENV_{prefix}_IDLE_UNLOAD_SECONDS)s",\
SPEECH_GPU="%(ENV_{prefix}_GPU)s",{process_env}
stdout_logfile=%(ENV_SPEECH_RUN_DIR)s/logs/%(program_name)s_%(process_num)02d.log
stdout_logfile_maxbytes=50MB
stdout_logfile_backups=5
redirect_stderr=true
"""


def python_variable(env: str) -> str:
    return f"SPEECH_{env.upper()}_PYTHON"


def worker_programs() -> str:
    process_env = ",".join(f'{name}="{value}"' for name, value in WORKER_PROCESS_ENV.items())
    return "\n".join(PROGRAM.format(name=row.name, prefix=row.prefix,
                                    python=python_variable(row.env), process_env=process_env)
                     for row in BACKENDS.values())


def defaults_lines() -> str:
    envs = dict.fromkeys([GATEWAY_ENV, *(row.env for row in BACKENDS.values())])
    lines = ["# each environment's interpreter (deploy/envs/NAME.txt, built as .venvs/NAME)"]
    lines += [f"{python_variable(env)}=.venvs/{env}/bin/python" for env in envs]
    lines.append("# one block per worker: ENABLED (autostart), REPLICAS, DEVICE, MEMORY_CAP_MIB, "
                 "IDLE_UNLOAD_SECONDS, GPU (the card it uses: an index or a GPU UUID, its "
                 "CUDA_VISIBLE_DEVICES; empty: the environment's)")
    for row in BACKENDS.values():
        lines += [f"{row.prefix}_{key}={value}" for key, value in _program_defaults(row)]
    return "\n".join(lines) + "\n"


def _program_defaults(row: Backend) -> list[tuple[str, str]]:
    return [("ENABLED", "true" if row.enabled else "false"), ("REPLICAS", str(row.replicas)),
            ("DEVICE", row.device), ("MEMORY_CAP_MIB", str(row.memory_cap_mib)),
            ("IDLE_UNLOAD_SECONDS", str(row.idle_unload_seconds)), ("GPU", "")]


def sage_map() -> str:
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    writer.writerow(["model", "submit_url", "status_url", "request_template",
                     "response_template", "query_period"])
    for row in BACKENDS.values():
        kind = KINDS[row.kind]
        # refusal=task: a refused submit is a FAILED task Sage shows (gateway/errors.py)
        writer.writerow([row.name, f"{{gateway}}/api/{row.name}-submit?refusal=task",
                         f"{{gateway}}/api/{row.name}-status", kind.sage_request,
                         kind.sage_response, row.sage_poll_seconds])
    return out.getvalue()


def between_markers(text: str, begin: str, end: str, body: str, path: Path) -> str:
    """`text` with what lies between its `begin` and `end` lines replaced by `body`."""
    lines = text.splitlines(keepends=True)
    try:
        start = next(i for i, line in enumerate(lines) if line.rstrip("\n") == begin)
        stop = next(i for i, line in enumerate(lines) if line.rstrip("\n") == end)
    except StopIteration:
        raise SystemExit(f"{path}: the marker lines are missing:\n{begin}\n{end}") from None
    if stop < start:
        raise SystemExit(f"{path}: the end marker comes before the begin marker")
    return "".join(lines[:start + 1]) + body + "".join(lines[stop:])


def generated() -> dict[Path, str]:
    """Each generated file's whole text, as the table makes it."""
    return {
        SUPERVISORD: between_markers(SUPERVISORD.read_text(), CONF_BEGIN, CONF_END,
                                     worker_programs(), SUPERVISORD),
        DEFAULTS: between_markers(DEFAULTS.read_text(), ENV_BEGIN, ENV_END, defaults_lines(),
                                  DEFAULTS),
        SAGE_MAP: sage_map(),
        **gen_k8s.generated(),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a file differs from what the table makes")
    args = parser.parse_args()
    stale = []
    for path, text in generated().items():
        current = path.read_text() if path.exists() else ""
        if current == text:
            continue
        stale.append(path.relative_to(ROOT))
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    if args.check and stale:
        print("out of date with common/backends.py (run scripts/gen_deploy.py): "
              + ", ".join(map(str, stale)), file=sys.stderr)
        return 1
    for path in stale:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
