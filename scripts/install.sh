#!/usr/bin/env bash
# Installs what the service needs on a fresh Debian machine with python3: system packages
# (when missing) and one virtual environment per deploy/envs/NAME.txt, created as .venvs/NAME
# with uv from the committed lock deploy/envs/NAME.lock (scripts/lock.sh writes the locks).
# uv's cache hardlinks each wheel into every environment that uses it, so torch and the other
# shared packages are on disk once. Re-running is cheap: an environment is rebuilt only when
# its lock or the project's own dependencies (pyproject.toml) changed; the project itself is
# installed editable, so code changes need no rebuild.
#
#   scripts/install.sh                  # the core environment (gateway + faster-whisper worker)
#   scripts/install.sh core hf          # several environments
#   scripts/install.sh all              # every environment in deploy/envs/
#   scripts/install.sh --tests all      # and the test tools (deploy/envs/tests.in) in core
#
# The Containerfile installs in two steps, so that a code change rebuilds only the second:
#   scripts/install.sh --no-project all     # the environments from their locks, no project
#   scripts/install.sh --project-only all   # then the project alone, editable, into each
set -euo pipefail
cd "$(dirname "$0")/.."

tests=false
mode=full  # full | no-project | project-only
envs=()
for arg in "$@"; do
    case "$arg" in
        --tests) tests=true ;;
        --no-project) mode=no-project ;;
        --project-only) mode=project-only ;;
        *) envs+=("$arg") ;;
    esac
done
[ ${#envs[@]} -eq 0 ] && envs=(core)
if [ "${envs[0]}" = all ]; then
    envs=()
    for f in deploy/envs/*.txt; do envs+=("$(basename "$f" .txt)"); done
fi
$tests && [[ " ${envs[*]} " != *" core "* ]] && envs+=(core)

missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v espeak-ng >/dev/null || missing+=(espeak-ng)
# uv comes from a venv of python3's own (Debian splits ensurepip off), and a few locked
# packages ship only as sources (webrtcvad): a compiler and Python's headers build them
python3 -c 'import ensurepip' 2>/dev/null || missing+=(python3-venv)
command -v cc >/dev/null || missing+=(build-essential)
python3 -c 'import os, sys, sysconfig
sys.exit(not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")))' \
    || missing+=(python3-dev)
# the headless browser tests/test_ui_browser.py drives: Debian's package (Ubuntu's is a snap
# stub; the service itself needs no browser)
if $tests && ! command -v chromium >/dev/null && grep -qx "ID=debian" /etc/os-release 2>/dev/null; then
    missing+=(chromium)
fi
if [ ${#missing[@]} -gt 0 ]; then
    echo "install: apt-get install ${missing[*]}"
    sudo_cmd=""
    [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
    # Debian starts the package's own Redis on 6379 under systemd: the stack runs its own
    # (deploy/supervisord.conf, AOF in var/redis) on that port, so the one just installed
    # must not hold it
    if [[ " ${missing[*]} " == *" redis-server "* ]] && [ -d /run/systemd/system ]; then
        $sudo_cmd systemctl disable --now redis-server >/dev/null 2>&1 || true
    fi
fi

source scripts/uv.sh
# Every package is compiled to bytecode once, here: where PYTHONDONTWRITEBYTECODE is set (CI
# machines, many images) nothing else ever writes it, and each worker start would compile
# torch's or NeMo's sources again (17.6 s to import NeMo's ASR collection, 7.6 s compiled).
BYTECODE="compiled bytecode"
python=$(python3 -c 'import sys; print(sys.executable)')

fresh_lock() {  # fresh_lock NAME: exit unless NAME.lock was made from its inputs as they are
    local lock=deploy/envs/$1.lock
    [ -f "$lock" ] && [ "$(head -1 "$lock")" = "# inputs: $(input_hash "$1")" ] && return
    echo "install: $lock is missing or older than its inputs: run scripts/lock.sh $1" >&2
    exit 2
}

for name in "${envs[@]}"; do
    venv=.venvs/$name
    [ -f "deploy/envs/$name.txt" ] || { echo "install: no deploy/envs/$name.txt" >&2; exit 2; }
    fresh_lock "$name"
    stamp=$( (cat "deploy/envs/$name.lock"; sed -n '/^dependencies/,/^]/p' pyproject.toml
              echo "$BYTECODE") | sha256sum | cut -c1-16)
    if [ "$mode" = project-only ]; then
        # the environment as --no-project left it: add the project, and the stamp that
        # says the environment is whole
        [ -x "$venv/bin/python" ] || {
            echo "install: no $venv: run scripts/install.sh --no-project $name first" >&2; exit 2; }
        echo "install: the project into $venv"
        "$UV" pip install -q --python "$venv/bin/python" "${UV_OPTS[@]}" --no-deps -e .
        echo "$stamp" > "$venv/.stamp"
        continue
    fi
    if [ -f "$venv/.stamp" ] && [ "$(cat "$venv/.stamp")" = "$stamp" ]; then
        continue
    fi
    echo "install: building $venv from deploy/envs/$name.lock"
    rm -rf "$venv"
    "$UV" venv -q --python "$python" "$venv"
    "$UV" pip install -q --python "$venv/bin/python" "${UV_OPTS[@]}" --compile-bytecode \
        -r "deploy/envs/$name.lock"
    # --no-project: no stamp yet (the environment lacks the project until --project-only)
    [ "$mode" = no-project ] && continue
    "$UV" pip install -q --python "$venv/bin/python" "${UV_OPTS[@]}" --no-deps -e .
    echo "$stamp" > "$venv/.stamp"
done

if $tests; then
    fresh_lock tests
    stamp=$(cat deploy/envs/tests.lock .venvs/core/.stamp | sha256sum | cut -c1-16)
    if [ ! -f .venvs/core/.stamp-tests ] || [ "$(cat .venvs/core/.stamp-tests)" != "$stamp" ]; then
        echo "install: the test tools into .venvs/core from deploy/envs/tests.lock"
        "$UV" pip install -q --python .venvs/core/bin/python "${UV_OPTS[@]}" \
            --compile-bytecode -r deploy/envs/tests.lock
        echo "$stamp" > .venvs/core/.stamp-tests
    fi
fi
