# Sourced by scripts: exports every default of deploy/defaults.env that is not already set.
# One derived default: with the bundled Redis (SPEECH_LOCAL_REDIS=true) and no SPEECH_REDIS_URL
# of the caller's, the services connect to the port that Redis is started on, so
# `SPEECH_REDIS_PORT=6380 scripts/serve.sh` moves both.
_speech_url_given=${SPEECH_REDIS_URL+x}
while IFS='=' read -r key value; do
    case "$key" in ''|\#*) continue ;; esac
    if [ -z "${!key+x}" ]; then export "$key=$value"; fi
done < "$(dirname "${BASH_SOURCE[0]}")/../deploy/defaults.env"
if [ -z "$_speech_url_given" ] && [ "$SPEECH_LOCAL_REDIS" = true ]; then
    export SPEECH_REDIS_URL="redis://127.0.0.1:$SPEECH_REDIS_PORT/0"
fi
unset _speech_url_given
