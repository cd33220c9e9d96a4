#!/usr/bin/env bash
# One Redis node of deploy/sentinel.supervisord.conf: NAME PORT [PRIMARY_PORT]. Its config
# file is written on the first start only (a replica's names PRIMARY_PORT): the sentinels
# rewrite it on every failover (REPLICAOF + CONFIG REWRITE), so a node that restarts comes
# back in the role they gave it. Flags on the command line would undo that: a promoted
# replica restarted with --replicaof made both nodes replicas, and nothing could write again.
set -euo pipefail
name=$1 port=$2 primary=${3:-}
dir="$SPEECH_RUN_DIR/$name"
conf="$dir/redis.conf"
mkdir -p "$dir"
if [ ! -f "$conf" ]; then
    {
        echo "bind 127.0.0.1"
        echo "port $port"
        echo "dir $dir"
        echo "appendonly yes"
        echo "appendfsync everysec"
        echo 'save ""'
        echo "repl-diskless-sync-delay 0"
        if [ -n "$primary" ]; then
            echo "replicaof ${REDIS_PRIMARY_HOST:-127.0.0.1} $primary"
        fi
    } > "$conf"
fi
exec redis-server "$conf"
