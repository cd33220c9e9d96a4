#!/usr/bin/env bash
# Runs the whole stack under supervisord in the foreground (deploy/supervisord.conf, with
# deploy/defaults.env for whatever the environment leaves unset). Used by scripts/serve.sh
# and as the container's entry process; prints the URL once the gateway is ready.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
# how many worker processes this host runs: the replicas of each enabled program (a worker
# alone on its host keeps OpenMP's own wait policy, workers/openmp.py)
if [ -z "${SPEECH_HOST_WORKERS+x}" ]; then
    SPEECH_HOST_WORKERS=0
    for enabled in $(grep -oE '^[A-Z0-9]+_ENABLED' deploy/defaults.env); do
        replicas="${enabled%_ENABLED}_REPLICAS"
        if [ "${!enabled}" = true ]; then
            SPEECH_HOST_WORKERS=$((SPEECH_HOST_WORKERS + ${!replicas}))
        fi
    done
    export SPEECH_HOST_WORKERS
fi
mkdir -p "$SPEECH_RUN_DIR/logs" "$SPEECH_RUN_DIR/redis"
url="http://$SPEECH_HOST:$SPEECH_PORT"
[ "$SPEECH_HOST" = 0.0.0.0 ] && url="http://127.0.0.1:$SPEECH_PORT"
(
    for _ in $(seq 240); do
        if python3 -c "import urllib.request,sys; urllib.request.urlopen('$url/ready', timeout=2)" 2>/dev/null; then
            echo "speech-gateway is up: $url   (config: $url/api/config, logs: $SPEECH_RUN_DIR/logs/)"
            exit 0
        fi
        sleep 0.5
    done
    echo "speech-gateway did not become ready; see $SPEECH_RUN_DIR/logs/" >&2
) &
exec "${SPEECH_SUPERVISORD:-.venvs/core/bin/supervisord}" -n -c deploy/supervisord.conf
