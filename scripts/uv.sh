# Sourced by scripts/install.sh and scripts/lock.sh: sets UV (the uv binary, installed into
# .venvs/.uv with pip on first use) and UV_OPTS (where packages come from), and `input_hash`.
UV_VERSION=0.13.9
if command -v uv >/dev/null && [ "$(uv --version | cut -d' ' -f2)" = "$UV_VERSION" ]; then
    UV=uv
else
    UV=.venvs/.uv/bin/uv
    if [ ! -x "$UV" ] || [ "$("$UV" --version | cut -d' ' -f2)" != "$UV_VERSION" ]; then
        rm -rf .venvs/.uv
        python3 -m venv .venvs/.uv
        .venvs/.uv/bin/pip install -q "uv==$UV_VERSION" 2>&1 | sed '/^WARNING: Location .* is ignored/d'
    fi
fi
export UV_PYTHON_DOWNLOADS=never UV_NO_PROGRESS=1
# uv reads no pip configuration: hand it the local wheel directories and package indexes pip
# is set up with (a machine's CPU torch wheel, local mirrors), searched like pip does: the best
# match over every index, not the first index that has the package.
UV_OPTS=(--index-strategy unsafe-best-match)
_usable() { case "$1" in /*|file://*) [ -e "${1#file://}" ] ;; *) true ;; esac; }
for location in $(python3 -m pip config get global.find-links 2>/dev/null || true); do
    if _usable "$location"; then UV_OPTS+=(--find-links "$location"); fi
done
for location in $(python3 -m pip config get global.extra-index-url 2>/dev/null || true); do
    if _usable "$location"; then UV_OPTS+=(--extra-index-url "$location"); fi
done

# The lock's inputs, hashed: its requirements file, and the project's own dependencies (or,
# for the test tools, the core lock they are resolved against). Each lock records it on
# its first line, so a requirements file changed without relocking is caught.
input_hash() {  # input_hash NAME
    local name=$1 req=deploy/envs/$1.txt
    [ "$name" = tests ] && req=deploy/envs/tests.in
    if [ "$name" = tests ]; then
        cat "$req" deploy/envs/core.lock
    else
        cat "$req"; sed -n '/^dependencies/,/^]/p' pyproject.toml
    fi | sha256sum | cut -c1-16
}
