#!/usr/bin/env bash
# Installs what is missing, then runs Redis + gateway + the faster-whisper worker (CPU,
# bundled tiny.en model) under supervisord in the foreground. Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh core
exec scripts/run_stack.sh
