#!/usr/bin/env bash
# Installs everything the tests need (system packages, every environment in deploy/envs, the
# test tools, tiny model fixtures), checks style, then runs the whole suite. Arguments go to
# pytest (a later -n overrides the default: -n 0 runs the files one after another).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --tests all
.venvs/core/bin/ruff check .
# the project's own modules too, once (see install.sh: every gateway and worker the tests
# start would compile them again where PYTHONDONTWRITEBYTECODE is set)
.venvs/core/bin/python -m compileall -q -j 0 bench common gateway harness scripts tests workers \
    >/dev/null
# test processes (see below), each running whole files (a module's fixtures stay in one
# process); the tests' servers bind free ports in per-process temp dirs, so they never meet.
# Then the tests marked `alone` (they time what they check, predicted waits or a failover,
# which another file's engines on the same cores would skew), one after another. Exit code 5
# is "nothing selected" (a run of a few files without such tests). In the parallel part
# every process (workers, and the tests' own engine CLIs) runs one OpenMP thread that waits
# passively: with a team per process on both cores, two files' engines stall at each other's
# barriers (the Parakeet check CLI took 131 s beside another file's engines, 13-17 s alone;
# the whole parallel part 23:30 and 36 CPU-minutes, 18:11 and 31 with one passive thread).
# Files go out longest first (tests/conftest.py LONG_FILES), so the part ends on short files.
# One more process than cores: a quarter of the part's time a file waits (for a timer, an
# idle unload, a browser), and a third process fills those gaps (TEST_PROCESSES sets it).
processes=${TEST_PROCESSES:-$(($(nproc) + 1))}
status=0
OMP_NUM_THREADS=1 OMP_WAIT_POLICY=PASSIVE .venvs/core/bin/pytest -n "$processes" --dist loadfile --no-loadscope-reorder -m "not alone" "$@" || status=$?
[ "$status" -eq 5 ] && status=0
alone=0
.venvs/core/bin/pytest -n 0 -m alone "$@" || alone=$?
[ "$alone" -eq 5 ] && alone=0
[ "$status" -ne 0 ] && exit "$status"
exit "$alone"
