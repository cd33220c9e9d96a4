#!/usr/bin/env bash
# supervisorctl for the stack started by scripts/serve.sh: scripts/ctl.sh status | restart gateway | ...
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
exec .venvs/core/bin/supervisorctl -c deploy/supervisord.conf "$@"
