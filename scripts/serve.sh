#!/usr/bin/env bash
# Installs what is missing, then runs Redis + gateway + the faster-whisper worker (CPU,
# bundled tiny.en model) under supervisord in the foreground. Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install.sh core
source scripts/env.sh
mkdir -p "$SPEECH_RUN_DIR/logs" "$SPEECH_RUN_DIR/redis"
url="http://$SPEECH_HOST:$SPEECH_PORT"
(
    for _ in $(seq 120); do
        if curl -sf "$url/ready" >/dev/null 2>&1; then
            echo "speech-gateway is up: $url   (config: $url/api/config, logs: $SPEECH_RUN_DIR/logs/)"
            exit 0
        fi
        sleep 0.5
    done
    echo "speech-gateway did not become ready; see $SPEECH_RUN_DIR/logs/" >&2
) &
exec .venvs/core/bin/supervisord -n -c deploy/supervisord.conf
