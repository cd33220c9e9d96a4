"""Several uploaded clips in one input blob.

The store keeps one input blob per task, with its lifetimes (deleted by the terminal write,
swept after a crash, kept on SPEECH_BLOB_DIR when large). A task that takes more than one
uploaded clip (an `analysis` backend's `file` and, say, `reference`) keeps them all in that
blob: a short header naming each clip and its size, then the clips' bytes, unchanged.
"""

from __future__ import annotations

import json

MAGIC = b"speech-gateway clips 1\n"
_LENGTH_BYTES = 4
MAX_HEADER_BYTES = 64 * 1024


def pack(clips: dict[str, bytes]) -> bytes:
    """One blob holding `clips` (name -> the uploaded file's bytes), in their order."""
    header = json.dumps([[name, len(data)] for name, data in clips.items()]).encode()
    return b"".join([MAGIC, len(header).to_bytes(_LENGTH_BYTES, "big"), header, *clips.values()])


def unpack(blob: bytes) -> dict[str, bytes]:
    """The clips `pack` put in `blob`; ValueError for anything else."""
    if not blob.startswith(MAGIC):
        raise ValueError("the task's input is not a set of clips")
    start = len(MAGIC) + _LENGTH_BYTES
    length = int.from_bytes(blob[len(MAGIC):start], "big")
    try:
        if length > MAX_HEADER_BYTES:
            raise ValueError
        entries = json.loads(blob[start:start + length])
        sizes = [(str(name), int(size)) for name, size in entries]
    except (ValueError, TypeError):
        raise ValueError("the task's set of clips has a broken header") from None
    offset = start + length
    if any(size < 0 for _, size in sizes) or offset + sum(s for _, s in sizes) != len(blob):
        raise ValueError("the task's set of clips is cut short or too long")
    clips = {}
    for name, size in sizes:
        clips[name] = blob[offset:offset + size]
        offset += size
    return clips
