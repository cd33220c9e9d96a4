#!/usr/bin/env bash
# Builds the container image with podman and smoke-tests it.
#
#   scripts/image.sh build [core|all]   # speech-gateway:core (gateway + faster-whisper) or :all
#   scripts/image.sh smoke [core|all]   # runs it and scripts/smoke_test.sh against it
#   scripts/image.sh base               # just the Debian base (below)
#
# BASE (default: the Containerfile's CUDA runtime image) is pulled first; where it cannot be
# pulled, `build` makes a Debian base with mmdebstrap (apt-get install mmdebstrap) holding
# every system package the Containerfile needs, and builds on that (CPU only).
# PODMAN_RUNTIME picks podman's OCI runtime (default: runc where installed: crun fails on
# some hosts' cgroups and setrlimit); containers get explicit ulimits for the same reason.
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE=${SPEECH_IMAGE:-localhost/speech-gateway}
DEBIAN_BASE=localhost/speech-gateway-base:bookworm
runtime=${PODMAN_RUNTIME:-$(command -v runc >/dev/null && echo runc || true)}
podman=(podman ${runtime:+--runtime "$runtime"})
limits=(--ulimit nofile=4096:4096 --ulimit nproc=4096:4096)

default_base() { sed -n 's/^ARG BASE=//p' Containerfile; }

debian_base() {
    "${podman[@]}" image exists "$DEBIAN_BASE" && return
    echo "image: making $DEBIAN_BASE with mmdebstrap"
    mmdebstrap --variant=apt --aptopt='APT::Install-Recommends "false"' \
        --include=ca-certificates,python3,python3-venv,python3-dev,build-essential,ffmpeg,redis-server,espeak-ng \
        bookworm - | "${podman[@]}" import --change 'CMD ["/bin/bash"]' - "$DEBIAN_BASE" >/dev/null
}

build() {
    local envs=${1:-core} base=${BASE:-$(default_base)}
    [ "$envs" = core ] || [ "$envs" = all ] || { echo "image: build core|all" >&2; exit 2; }
    if ! "${podman[@]}" image exists "$base" && ! timeout 120 "${podman[@]}" pull -q "$base" >/dev/null; then
        echo "image: cannot pull $base; building on a Debian base instead (CPU only)"
        debian_base
        base=$DEBIAN_BASE
    fi
    # a local wheel directory pip is set up with (a CPU torch, say) is mounted into the build
    local mounts=() wheels=""
    for location in $(python3 -m pip config get global.find-links 2>/dev/null || true); do
        [ -d "$location" ] && mounts+=(--volume "$location:$location:ro") && wheels=$location
    done
    # and the CA bundle of a host that reaches the registries through a TLS proxy
    local ca=""
    if [ -f "${SSL_CERT_FILE:-}" ]; then
        ca=/run/host-ca-bundle.crt
        mounts+=(--volume "$SSL_CERT_FILE:$ca:ro")
    fi
    local started=$SECONDS
    "${podman[@]}" build --format docker "${limits[@]}" "${mounts[@]}" \
        --build-arg "BASE=$base" --build-arg "ENVS=$envs" --build-arg "WHEELS=$wheels" \
        --build-arg "CA_BUNDLE=$ca" \
        -t "$IMAGE:$envs" -f Containerfile .
    local size
    size=$("${podman[@]}" image inspect --format '{{.Size}}' "$IMAGE:$envs")
    echo "image: $IMAGE:$envs built in $((SECONDS - started)) s on $base, $((size / 1000000)) MB"
}

# a port free now, below the kernel's ephemeral range (harness/ports.py, standard library)
free_port() { python3 -m harness.ports; }

smoke() {
    local envs=${1:-core}
    local port redis_port
    name=speech-gateway-smoke-$$  # global: the EXIT trap stops it
    port=$(free_port)
    redis_port=$(free_port)
    "${podman[@]}" image exists "$IMAGE:$envs" || { echo "image: build $envs first" >&2; exit 2; }
    # host networking on free loopback ports: this runs beside whatever else the host serves
    # --stop-timeout 900: supervisord's own shutdown (the gateway, workers, Redis) runs to the
    # end before SIGKILL, as docs/deploy.md tells every `podman run` to
    "${podman[@]}" run -d --rm --stop-timeout 900 --name "$name" --network=host "${limits[@]}" \
        -e SPEECH_HOST=127.0.0.1 -e SPEECH_PORT="$port" -e SPEECH_REDIS_PORT="$redis_port" \
        -e SPEECH_REDIS_URL="redis://127.0.0.1:$redis_port/0" "$IMAGE:$envs" >/dev/null \
        2> >(grep -v 'systemd connection' >&2)  # (no systemd: podman runs the check on demand)
    trap '"${podman[@]}" stop -t 900 "$name" >/dev/null 2>&1 || true' EXIT
    local url=http://127.0.0.1:$port ready=false
    for _ in $(seq 240); do
        if python3 -c "import urllib.request; urllib.request.urlopen('$url/ready', timeout=2)" 2>/dev/null; then
            ready=true
            break
        fi
        sleep 0.5
    done
    if ! $ready; then
        echo "image: the container did not become ready; its log:" >&2
        "${podman[@]}" logs --tail 40 "$name" >&2 || true
        exit 1
    fi
    echo "image: $IMAGE:$envs ready at $url (user $("${podman[@]}" exec "$name" id -un))"
    # (a failing check must fail the smoke: `a && b` under set -e would only skip the echo)
    if ! "${podman[@]}" healthcheck run "$name"; then
        echo "FAIL HEALTHCHECK" >&2
        exit 1
    fi
    echo "OK HEALTHCHECK"
    scripts/smoke_test.sh --url "$url"
}

case "${1:-}" in
    build) build "${2:-core}" ;;
    smoke) smoke "${2:-core}" ;;
    base) debian_base ;;
    *) echo "usage: scripts/image.sh build|smoke [core|all] | base" >&2; exit 2 ;;
esac
