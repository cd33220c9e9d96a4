#!/usr/bin/env bash
# supervisorctl for the stack started by scripts/serve.sh: scripts/ctl.sh status | restart gateway | ...
# `restart gateway` is the zero-downtime restart: SIGHUP to the gateway launcher
# (python -m gateway), which replaces its server processes one at a time on the port it
# holds, so no connection is refused; this waits until it has (docs/operations.md). Every
# other command goes to supervisorctl as it is.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
ctl=(.venvs/core/bin/supervisorctl -c deploy/supervisord.conf)
[ "$*" = "restart gateway" ] || exec "${ctl[@]}" "$@"

state="$SPEECH_RUN_DIR/gateway.state"  # written by the launcher
field() { sed -n "s/^$1=//p" "$state" 2>/dev/null || true; }

pid=$("${ctl[@]}" pid gateway || true)
if [[ "$pid" =~ ^[1-9][0-9]*$ ]]; then
    for _ in $(seq 100); do  # a launcher that just started writes its state at once
        [ "$(field parent)" = "$pid" ] && break
        sleep 0.1
    done
fi
if ! [[ "$pid" =~ ^[1-9][0-9]*$ ]] || [ "$(field parent)" != "$pid" ]; then
    echo "gateway: no running launcher, so an ordinary restart" >&2
    exec "${ctl[@]}" restart gateway
fi

done_before=$(field reloads)
running=$(field reloading)  # a reload already under way may have started the old code
want=$(( (${running:-0} > ${done_before:-0} ? ${running:-0} : ${done_before:-0}) + 1 ))
"${ctl[@]}" signal HUP gateway >/dev/null
# the launcher gives each new server process 60 s to start
for _ in $(seq $(( (60 * SPEECH_GATEWAY_PROCESSES + 30) * 10 ))); do
    if [ "$(field parent)" != "$pid" ] || ! kill -0 "$pid" 2>/dev/null; then
        echo "gateway: the launcher (pid $pid) exited during the reload" >&2
        exit 1
    fi
    if [ "$(field reloads)" -ge "$want" ]; then
        result=$(field result)
        if [ "$result" = ok ]; then
            echo "gateway: reloaded, server pids $(field children)"
            exit 0
        fi
        echo "gateway: reload $result" >&2
        exit 1
    fi
    sleep 0.1
done
echo "gateway: the reload did not finish in time; see $SPEECH_RUN_DIR/logs/gateway.log" >&2
exit 1
