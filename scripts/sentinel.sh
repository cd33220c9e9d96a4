#!/usr/bin/env bash
# One Redis Sentinel of deploy/sentinel.supervisord.conf: NAME PORT. Its config file is
# written on the first start only: Sentinel rewrites it as it learns the replicas, the other
# sentinels and each failover, and must find that again after a restart.
set -euo pipefail
name=$1 port=$2
master=${SPEECH_REDIS_SENTINEL_MASTER:-speech}
conf="$SPEECH_RUN_DIR/$name.conf"
mkdir -p "$SPEECH_RUN_DIR"
if [ ! -f "$conf" ]; then
    {
        echo "bind 127.0.0.1"
        echo "port $port"
        echo "dir $SPEECH_RUN_DIR"
        # quorum 2: two of the three sentinels must agree that the primary is down
        echo "sentinel monitor $master ${REDIS_PRIMARY_HOST:-127.0.0.1} ${REDIS_PRIMARY_PORT:-6379} 2"
        echo "sentinel down-after-milliseconds $master ${SENTINEL_DOWN_AFTER_MS:-5000}"
        echo "sentinel failover-timeout $master 60000"
        echo "sentinel parallel-syncs $master 1"
        if [ -n "${SPEECH_REDIS_PASSWORD:-}" ]; then
            echo "sentinel auth-pass $master $SPEECH_REDIS_PASSWORD"
        fi
        if [ -n "${SPEECH_REDIS_SENTINEL_PASSWORD:-}" ]; then
            echo "requirepass $SPEECH_REDIS_SENTINEL_PASSWORD"
        fi
    } > "$conf"
fi
exec redis-server "$conf" --sentinel
