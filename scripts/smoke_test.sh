#!/usr/bin/env bash
# Post-deploy smoke test: for every enabled backend, its workers' direct endpoints, the
# Sage submit/poll path and the OpenAI endpoint (speech for TTS). One OK/FAIL line each;
# exits non-zero on any failure. Runs inside the container or from outside.
#
#   scripts/smoke_test.sh [--url http://host:8000] [--key KEY] [--worker-secret SECRET]
#                         [--backends a,b] [--timeout S] [--cold]
#   (or SMOKE_URL, SMOKE_API_KEY, SMOKE_WORKER_SECRET (else SPEECH_WORKER_SECRET),
#    SMOKE_BACKENDS, SMOKE_VOICE, SMOKE_TIMEOUT, SMOKE_COLD)
#   --cold: in a cluster whose workers scale to zero (KEDA), check each backend through the
#   gateway alone (its first submit wakes a worker; allow for the cold start in --timeout)
set -euo pipefail
exec python3 "$(dirname "$0")/smoke_test.py" "$@"
