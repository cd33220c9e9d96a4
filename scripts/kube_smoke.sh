#!/usr/bin/env bash
# Runs the CPU overlay (deploy/k8s/overlays/cpu) with `podman kube play` on this host and
# smoke-tests it (scripts/smoke_test.sh), then takes it down. Needs the core image
# (scripts/image.sh build core) and the test tools (scripts/install.sh --tests: kubectl's
# kustomize, PyYAML). scripts/kube_play.py says what it changes for a single podman host.
#
#   scripts/kube_smoke.sh [--keep]     # --keep: leave the pods running afterwards
set -euo pipefail
cd "$(dirname "$0")/.."

keep=false
[ "${1:-}" = --keep ] && keep=true
python=.venvs/core/bin/python
kubectl=.venvs/core/bin/kubectl
[ -x "$kubectl" ] || kubectl=kubectl
work=$(mktemp -d)
# a port free now, below the kernel's ephemeral range (harness/ports.py, standard library)
free_port() { python3 -m harness.ports; }
port=$(free_port)
redis_port=$(free_port)

"$kubectl" kustomize deploy/k8s/overlays/cpu > "$work/rendered.yaml"
"$python" scripts/kube_play.py --port "$port" --redis-port "$redis_port" \
    < "$work/rendered.yaml" > "$work/play.yaml"
echo "kube: $(grep -c '^kind:' "$work/rendered.yaml") objects rendered," \
    "$(grep '^kind:' "$work/play.yaml" | sort | uniq -c | awk '{printf "%s %s, ", $1, $3}')played"

# podman's runtime and the containers' limits, as scripts/image.sh runs them (crun fails on
# some hosts; kube play takes no --ulimit, so they come from a containers.conf of its own)
runtime=${PODMAN_RUNTIME:-$(command -v runc >/dev/null && echo runc || true)}
{
    echo '[containers]'
    echo 'default_ulimits = ["nofile=4096:4096", "nproc=4096:4096"]'
    if [ -n "$runtime" ]; then printf '[engine]\nruntime = "%s"\n' "$runtime"; fi
} > "$work/containers.conf"
export CONTAINERS_CONF=$work/containers.conf
podman=(podman ${runtime:+--runtime "$runtime"})

down() {
    "${podman[@]}" kube down "$work/play.yaml" >/dev/null 2>&1 || true
    for claim in $("$python" -c 'import sys, yaml; print(" ".join(d["metadata"]["name"] for d in yaml.safe_load_all(open(sys.argv[1])) if d and d["kind"] == "PersistentVolumeClaim"))' "$work/play.yaml"); do
        "${podman[@]}" volume rm -f "$claim" >/dev/null 2>&1 || true
    done
    rm -rf "$work"
}
$keep || trap down EXIT

"${podman[@]}" kube play "$work/play.yaml" >/dev/null
url=http://127.0.0.1:$port
# the workers' secret as played (kube_play.py puts a random one where the Secret ships its
# placeholder, which every process refuses)
secret=$("$python" -c 'import sys, yaml
found = {e["name"]: e.get("value") for d in yaml.safe_load_all(open(sys.argv[1]))
         if d and d["kind"] == "Deployment"
         for c in d["spec"]["template"]["spec"]["containers"] for e in c.get("env", [])}
print(found["SPEECH_WORKER_SECRET"])' "$work/play.yaml")
# ready once the gateway answers and the CPU overlay's worker has a heartbeat
for _ in $(seq 240); do
    if python3 -c "import json, sys, urllib.request
r = json.load(urllib.request.urlopen('$url/ready', timeout=2))
sys.exit(0 if r['backends']['faster-whisper']['live'] else 1)" 2>/dev/null; then
        break
    fi
    sleep 0.5
done
"${podman[@]}" pod ps --filter name=speech-gateway --format '{{.Name}} {{.Status}}'
scripts/smoke_test.sh --url "$url" --worker-secret "$secret" || {
    status=$?
    for pod in $("${podman[@]}" pod ps --filter name=speech-gateway --format '{{.Name}}'); do
        echo "--- $pod" >&2
        "${podman[@]}" pod logs --tail 20 "$pod" >&2 || true
    done
    exit $status
}
