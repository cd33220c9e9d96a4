# Sourced by scripts: exports every default of deploy/defaults.env that is not already set.
while IFS='=' read -r key value; do
    case "$key" in ''|\#*) continue ;; esac
    if [ -z "${!key+x}" ]; then export "$key=$value"; fi
done < "$(dirname "${BASH_SOURCE[0]}")/../deploy/defaults.env"
