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
# a port already taken would leave its program FATAL while the rest runs: the gateway on
# another process's port, or the workers on someone else's Redis (no AOF, not var/redis)
taken() {  # taken HOST PORT: true when something listens there (IPv4 or IPv6)
    python3 -c 'import socket, sys
host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(sys.argv[1], sys.argv[1])
try:
    socket.create_connection((host, int(sys.argv[2])), timeout=1).close()
except OSError:
    sys.exit(1)' "$1" "$2"
}
if [ "$SPEECH_LOCAL_REDIS" = true ] && taken 127.0.0.1 "$SPEECH_REDIS_PORT"; then
    echo "run_stack: port $SPEECH_REDIS_PORT (SPEECH_REDIS_PORT) is taken, but the stack starts its own Redis there: stop what holds it (a distribution's redis-server service?) or set SPEECH_REDIS_PORT" >&2
    exit 2
fi
if taken "$SPEECH_HOST" "$SPEECH_PORT"; then
    echo "run_stack: port $SPEECH_PORT (SPEECH_PORT) is taken: stop what holds it or set SPEECH_PORT" >&2
    exit 2
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
