"""Large task audio on a shared directory (`SPEECH_BLOB_DIR`) instead of Redis.

A volume every host mounts; the same lifetimes as Redis blobs: an input lives until its
task's terminal write, an output for the retention. Files are written under a temporary
name and renamed, so a reader never sees half a file. Whoever wins a task's terminal
write deletes its input; `sweep` removes what a crash between the two left behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import time
from pathlib import Path


class BlobDir:
    def __init__(self, root: Path, min_bytes: int) -> None:
        self.root = root
        self.min_bytes = min_bytes  # smaller blobs stay in Redis: a file costs more than it saves
        root.mkdir(parents=True, exist_ok=True)

    def wants(self, blob: bytes | None) -> bool:
        return blob is not None and len(blob) >= self.min_bytes

    def input_path(self, task_id: str) -> Path:
        return self.root / f"{task_id}.input"

    def output_name(self, task_id: str, attempt: int | None, worker: str = "") -> str:
        """Per attempt and worker, so a stale attempt never overwrites the file the winner
        points at (after a failover lost a start, two workers can hold one attempt number)."""
        name = f"{task_id}.output.{attempt or 0}"
        return f"{name}.{hashlib.sha256(worker.encode()).hexdigest()[:12]}" if worker else name

    def write(self, path: Path, data: bytes) -> None:
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            temporary.write_bytes(data)
            os.replace(temporary, path)
        except BaseException:  # a full disk, an I/O error: no half-written file left behind
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise

    def read(self, path: Path) -> bytes | None:
        try:
            return path.read_bytes()
        except FileNotFoundError:
            return None

    def delete(self, path: Path) -> None:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()

    def stale_files(self, older_than_seconds: float) -> list[Path]:
        """Files last written before the cutoff (candidates for the janitor)."""
        cutoff = time.time() - older_than_seconds
        stale = []
        for path in self.root.iterdir():
            with contextlib.suppress(FileNotFoundError):
                # a folder (voices/: kept until deleted) is no task's blob
                if path.is_file() and path.stat().st_mtime < cutoff:
                    stale.append(path)
        return stale
