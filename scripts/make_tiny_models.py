#!/usr/bin/env python3
"""Build the tiny, randomly initialised checkpoints the tests (and a CPU demo) run on.

    scripts/make_tiny_models.py                 # every model whose environment exists
    scripts/make_tiny_models.py qwen3 parakeet  # just these

Each checkpoint is made offline by scripts/tiny_models/NAME.py with the engine's own
classes, in the real on-disk layout, under the engine's environment (.venvs/ENV), into
models/tiny/NAME. A build is skipped when its builder and arguments are unchanged.
Prints one `NAME PATH` line per model (PATH is what SPEECH_MODELS should name).
Exit code 3: an environment a requested model needs is missing (scripts/install.sh ENV).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the backend table, when run as a script
from common.backends import BACKENDS, Fixture  # noqa: E402

BUILDERS = ROOT / "scripts" / "tiny_models"
JFK = ROOT / "tests" / "audio" / "jfk.flac"


@dataclass(frozen=True)
class Recipe:
    env: str
    builder: str
    args: tuple[str, ...] = ()
    helpers: tuple[str, ...] = ()
    #: the file inside the output directory that SPEECH_MODELS names ("" = the directory)
    entry: str = ""

    @classmethod
    def of(cls, env: str, fixture: Fixture) -> Recipe:
        # an argument naming a file of the repository is passed as its absolute path
        args = tuple(str(ROOT / a) if (ROOT / a).is_file() else a for a in fixture.args)
        return cls(env, fixture.builder, args, fixture.helpers, fixture.entry)


#: every backend whose fixture is built (the table's rows), and variants the tests also use
RECIPES: dict[str, Recipe] = {
    name: Recipe.of(row.env, row.fixture) for name, row in BACKENDS.items() if row.fixture.builder
}
# untaught: what a model that has learnt nothing answers (tests/test_engines_hf.py)
RECIPES["vibevoice-random"] = replace(RECIPES["vibevoice"], args=())
# not a backend: the pyannote.audio diarization pipeline an ASR worker loads with
# SPEECH_DIARIZATION_MODEL=pyannote:DIR (tests/test_diarization_pyannote.py)
RECIPES["pyannote"] = Recipe("pyannote", "pyannote_pipeline.py")


def python_of(env: str) -> Path:
    return ROOT / ".venvs" / env / "bin" / "python"


def stamp_of(recipe: Recipe) -> str:
    digest = hashlib.sha256()
    for name in (recipe.builder, *recipe.helpers):
        digest.update((BUILDERS / name).read_bytes())
    digest.update(" ".join(a.replace(str(JFK.parent), "AUDIO") for a in recipe.args).encode())
    return digest.hexdigest()[:16]


def build(name: str, out_root: Path) -> Path:
    recipe = RECIPES[name]
    target = out_root / name
    stamp = stamp_of(recipe)
    stamp_file = target / ".stamp"
    if not (stamp_file.is_file() and stamp_file.read_text() == stamp):
        out_root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(dir=out_root, prefix=f".{name}-"))
        try:
            subprocess.run([str(python_of(recipe.env)), str(BUILDERS / recipe.builder),
                            "--out", str(tmp), *recipe.args], cwd=ROOT, check=True,
                           env={**os.environ, "HF_HUB_OFFLINE": "1"},
                           stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            (tmp / ".stamp").write_text(stamp)
            shutil.rmtree(target, ignore_errors=True)
            os.replace(tmp, target)
        except subprocess.CalledProcessError as exc:
            sys.stderr.write(exc.stderr[-4000:])
            raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target / recipe.entry if recipe.entry else target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", metavar="NAME",
                        help=f"models to build: {', '.join(RECIPES)} (default: all possible)")
    parser.add_argument("--out", type=Path, default=ROOT / "models" / "tiny")
    args = parser.parse_args()
    if unknown := set(args.names) - set(RECIPES):
        parser.error(f"unknown models: {', '.join(sorted(unknown))}")
    names = args.names or [n for n, r in RECIPES.items() if python_of(r.env).exists()]
    missing = sorted({RECIPES[n].env for n in names if not python_of(RECIPES[n].env).exists()})
    if missing:
        print(f"missing environments: {', '.join(missing)} (scripts/install.sh ENV)",
              file=sys.stderr)
        return 3
    for name in names:
        print(name, build(name, args.out), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
