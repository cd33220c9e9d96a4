#!/usr/bin/env bash
# Installs everything the tests need (system packages, every environment in deploy/envs, the
# test tools, tiny model fixtures), checks style, then runs the whole suite. Arguments go to
# pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh --tests all
.venvs/core/bin/ruff check .
exec .venvs/core/bin/pytest "$@"
