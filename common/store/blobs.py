"""A task's input and output blobs: in Redis (keys.input_blob, keys.output_blob), or, from
`SPEECH_BLOB_DIR`'s size up, as files on the shared directory (common/blobs.py). The Lua
writes that own their lifetimes (submit, finish, close) are tasks.py's; this module reads
them, writes the files before those scripts run, and deletes what the scripts cannot."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time

from redis.asyncio import Redis
from redis.exceptions import RedisError

from common import keys
from common.blobs import BlobDir
from common.schemas import TERMINAL_STATES
from common.store.values import text

#: a staged upload nobody renamed (its gateway stopped between the two) is gone after this
STAGED_SECONDS = 300


class BlobStore:
    def __init__(self, redis: Redis, retention_seconds: int,
                 blob_dir: BlobDir | None = None) -> None:
        self.redis = redis
        self.retention = retention_seconds
        self.dir = blob_dir

    def in_file(self, blob: bytes | None) -> bool:
        """Whether `blob` goes to the shared directory rather than into Redis."""
        return self.dir is not None and self.dir.wants(blob)

    async def stage(self, blob: bytes) -> str:
        """Write an upload under a staging key while the gateway probes it, so the submit only
        renames it: the blob's write (its AOF append: ~5 ms for a 1 MB upload) then delays
        neither the submit's reply nor a worker's wake-up. "" where the blob goes to a file,
        or Redis refused (the submit then carries the blob itself)."""
        if self.in_file(blob):
            return ""
        key = keys.staged_input(secrets.token_urlsafe(12))
        try:
            await self.redis.set(key, blob, ex=STAGED_SECONDS)
        except RedisError:
            return ""
        return key

    async def unstage(self, key: str) -> None:
        """Drop a staged upload no task took (a refused submit); its expiry is the backstop."""
        if key:
            with contextlib.suppress(RedisError):
                await self.redis.delete(key)

    async def write_input_file(self, task_id: str, blob: bytes) -> None:
        assert self.dir is not None
        await asyncio.to_thread(self.dir.write, self.dir.input_path(task_id), blob)

    async def write_output_file(self, task_id: str, attempt: int | None, output: bytes,
                                worker: str = "") -> str:
        """The output as a file, per attempt and worker: its name, for the fenced finish
        script."""
        assert self.dir is not None
        name = self.dir.output_name(task_id, attempt, worker)
        await asyncio.to_thread(self.dir.write, self.dir.root / name, output)
        return name

    def delete_input_file(self, task_id: str) -> None:
        if self.dir is not None:
            self.dir.delete(self.dir.input_path(task_id))

    def delete_output_file(self, name: str) -> None:
        if self.dir is not None and name:
            self.dir.delete(self.dir.root / name)

    async def input(self, task_id: str) -> bytes | None:
        blob = await self.redis.get(keys.input_blob(task_id))
        if blob is None and self.dir is not None:
            blob = await asyncio.to_thread(self.dir.read, self.dir.input_path(task_id))
        return blob

    async def output(self, task_id: str) -> bytes | None:
        blob = await self.redis.get(keys.output_blob(task_id))
        if blob is None and self.dir is not None:
            name = await self.redis.hget(keys.task(task_id), "output_file")
            if name:
                blob = await asyncio.to_thread(self.dir.read, self.dir.root / text(name))
        return blob

    async def sweep(self) -> int:
        """Delete files no task can read any more: inputs of finished or vanished tasks (a
        crash between the terminal write and the delete), outputs past the retention."""
        if self.dir is None:
            return 0
        removed = 0
        for path in await asyncio.to_thread(self.dir.stale_files, 60.0):
            task_id, _, kind = path.name.partition(".")
            if kind.startswith("output"):
                try:
                    gone = path.stat().st_mtime < time.time() - self.retention
                except FileNotFoundError:  # another gateway's sweep took it first
                    continue
            else:  # an input, or a temporary file whose writer died
                state = await self.redis.hget(keys.task(task_id), "state") \
                    if kind == "input" else None
                gone = state is None or text(state) in TERMINAL_STATES
            if gone:
                self.dir.delete(path)
                removed += 1
        return removed
