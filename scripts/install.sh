#!/usr/bin/env bash
# Installs what the service and its tests need on a fresh Debian machine with python3:
# system packages (when missing) and one virtual environment per deploy/envs/NAME.txt,
# created as .venvs/NAME. Re-running is cheap: an environment is rebuilt only when its
# requirements file or the project's own dependencies (pyproject.toml) changed; the
# project itself is installed editable, so code changes need no rebuild.
#
#   scripts/install.sh            # the core environment (gateway + faster-whisper worker)
#   scripts/install.sh core hf    # several environments
#   scripts/install.sh all        # every environment in deploy/envs/
set -euo pipefail
cd "$(dirname "$0")/.."

missing=()
command -v redis-server >/dev/null || missing+=(redis-server)
command -v espeak-ng >/dev/null || missing+=(espeak-ng)
# the headless browser tests/test_ui_browser.py drives: Debian's package (Ubuntu's, in the
# container image, is a snap stub; the service itself needs no browser)
if ! command -v chromium >/dev/null && grep -qx "ID=debian" /etc/os-release 2>/dev/null; then
    missing+=(chromium)
fi
if [ ${#missing[@]} -gt 0 ]; then
    echo "install: apt-get install ${missing[*]}"
    sudo_cmd=""
    [ "$(id -u)" -ne 0 ] && sudo_cmd="sudo"
    $sudo_cmd apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo_cmd apt-get install -y -qq "${missing[@]}" >/dev/null
fi

envs=("$@")
[ ${#envs[@]} -eq 0 ] && envs=(core)
if [ "${envs[0]}" = all ]; then
    envs=()
    for f in deploy/envs/*.txt; do envs+=("$(basename "$f" .txt)"); done
fi

for name in "${envs[@]}"; do
    req="deploy/envs/$name.txt"
    venv=".venvs/$name"
    [ -f "$req" ] || { echo "install: no $req" >&2; exit 2; }
    stamp=$( (cat "$req"; sed -n '/^dependencies/,/^]/p' pyproject.toml) | sha256sum | cut -c1-16)
    if [ -f "$venv/.stamp" ] && [ "$(cat "$venv/.stamp")" = "$stamp" ]; then
        continue
    fi
    echo "install: building $venv from $req (first time can take minutes)"
    rm -rf "$venv"
    python3 -m venv "$venv"
    # (sed drops this machine's notes about absent local package mirrors; pip's status stands)
    "$venv/bin/pip" install -q --upgrade pip 2>&1 | sed '/^WARNING: Location .* is ignored/d'
    "$venv/bin/pip" install -q -r "$req" -e . 2>&1 | sed '/^WARNING: Location .* is ignored/d'
    echo "$stamp" > "$venv/.stamp"
done
