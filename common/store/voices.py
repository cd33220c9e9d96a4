"""Custom voices and their consents, per owner, kept until deleted (no TTL).

Two kinds of object, stored alike: a record (a JSON string: the OpenAI fields plus what the
checks found, for audit), the owner's index (a sorted set by creation time, for listing and
the per-key limit) and the audio (the consent recording, the voice sample): in the blob
directory when one is configured (`SPEECH_BLOB_DIR`/voices, so every host reads it), else in
Redis. Every key names the owner, so another owner's id is simply not found.

A file and its record cannot change in one step: a file is noted in keys.voice_files before
it is written (or by the script that deletes its record), the create script (or the file's
delete) takes the note away, and `sweep` deletes the file of a note older than
FILE_NOTE_SECONDS whose record is missing (a gateway stopped between the two).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.exceptions import RedisError as StoreError

from common import keys
from common.blobs import BlobDir
from common.store.tasks import TaskStore
from common.store.values import text

T = TypeVar("T")

#: the ids the gateway gives consents and voices ("cons_…", "voice_…": 24 hex digits, the
#: first 12 its creation time in ms, which is also its score in the owner's index)
OBJECT_ID = re.compile(r"[a-z]+_[0-9a-f]{24}")
#: an id whose time reads before this (2020) is not one `new_id` made: ids before it were
#: all random (their place in a list is found only while they exist)
_EARLIEST_MS = 1_577_836_800_000
#: a file's note older than this is a crash's, not a create or delete under way
FILE_NOTE_SECONDS = 300


def new_id(prefix: str) -> str:
    """A new object id: `prefix`, its creation time and 48 random bits, so a list page can
    go on after an object deleted since the page before (`VoiceStore.list`)."""
    return f"{prefix}_{int(time.time() * 1000):012x}{secrets.token_hex(6)}"


def created_ms(object_id: str) -> int | None:
    """The creation time `new_id` put in the id; None for an id it did not make."""
    if not OBJECT_ID.fullmatch(object_id):
        return None
    ms = int(object_id.rpartition("_")[2][:12], 16)
    return ms if _EARLIEST_MS <= ms <= (time.time() + 86_400) * 1000 else None


class UnknownCursor(ValueError):
    """A list's `after` names no object of the owner's, and no place in the list."""

# KEYS: index, record, audio key, keys.voice_files, and (optional) the record that must
# still exist (a voice's consent: withdrawn while the voice was checked, it makes no voice) |
# ARGV: id, score, record JSON, most ("" = no limit), audio ("" = in the blob directory),
# the file's note ("" = none)
# -> 1 stored, 0 the owner has `most` already, -1 the required record is gone
_CREATE = """
if KEYS[5] and redis.call('EXISTS', KEYS[5]) == 0 then return -1 end
if ARGV[4] ~= '' and redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[4]) then return 0 end
redis.call('SET', KEYS[2], ARGV[3])
if ARGV[5] ~= '' then redis.call('SET', KEYS[3], ARGV[5]) end
if ARGV[6] ~= '' then redis.call('ZREM', KEYS[4], ARGV[6]) end
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
return 1
"""

# KEYS: record, index, audio key, keys.voice_files | ARGV: id, now, the file's note ("" =
# none) -> 1 removed (its file noted, for its delete to take the note away), 0 there was no
# such record (its audio left alone: consents and voices share the audio keyspace, and a
# voice's delete must not take a consent's recording of the same id)
_DELETE = """
if redis.call('DEL', KEYS[1]) == 0 then return 0 end
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('DEL', KEYS[3])
if ARGV[3] ~= '' then redis.call('ZADD', KEYS[4], ARGV[2], ARGV[3]) end
return 1
"""


@dataclass(frozen=True, slots=True)
class Kind:
    record: Callable[[str, str], str]
    index: Callable[[str], str]


CONSENTS = Kind(keys.voice_consent, keys.voice_consents)
VOICES = Kind(keys.custom_voice, keys.custom_voices)


@dataclass(frozen=True, slots=True)
class Page:
    items: list[dict[str, Any]]
    has_more: bool


class VoiceStore:
    def __init__(self, redis: Redis, blob_dir: BlobDir | None) -> None:
        self.redis = redis
        self.blob_dir = blob_dir
        self._create = redis.register_script(_CREATE)
        self._delete = redis.register_script(_DELETE)

    @classmethod
    def of(cls, store: TaskStore) -> VoiceStore:
        blobs = store.blobs.dir
        return cls(store.redis, None if blobs is None else BlobDir(blobs.root / "voices", 0))

    async def create(self, kind: Kind, owner: str, record: dict[str, Any], audio: bytes,
                     most: int | None = None, consent: str | None = None) -> int:
        """Store a new object and its audio: 1; 0 (nothing stored) when the owner has `most`,
        -1 when `consent` (a consent's id: the voice's) is gone."""
        object_id = record["id"]
        in_redis = self.blob_dir is None
        note = "" if in_redis else await self._write_file(owner, object_id, audio)
        stored = await self._create(
            keys=[kind.index(owner), kind.record(owner, object_id),
                  keys.voice_audio(owner, object_id), keys.voice_files(),
                  *([CONSENTS.record(owner, consent)] if consent is not None else [])],
            args=[object_id, created_ms(object_id) or int(time.time() * 1000),
                  json.dumps(record),
                  "" if most is None else most, audio if in_redis else "", note])
        if stored != 1 and note:
            await self._delete_file(owner, object_id, note)
        return int(stored)

    async def get(self, kind: Kind, owner: str, object_id: str) -> dict[str, Any] | None:
        raw = await self.redis.get(kind.record(owner, object_id))
        return None if raw is None else json.loads(raw)

    async def update(self, kind: Kind, owner: str, object_id: str,
                     **fields: Any) -> dict[str, Any] | None:
        """The record with `fields` changed; None if the owner has no such object."""
        record = await self.get(kind, owner, object_id)
        if record is None:
            return None
        record.update(fields)
        await self.redis.set(kind.record(owner, object_id), json.dumps(record), xx=True)
        return record

    async def list(self, kind: Kind, owner: str, after: str | None, limit: int) -> Page:
        """The owner's objects, newest first, from the one after `after`; `after` deleted
        since, from where it stood (its id's time); UnknownCursor when it has no place."""
        index = kind.index(owner)
        start = 0
        if after:
            rank = await self.redis.zrevrank(index, after)
            if rank is None:
                if (ms := created_ms(after)) is None:
                    raise UnknownCursor(after)
                # where it stood: after the objects newer than it (and those of its very
                # millisecond that sort after it, as ZREVRANGE orders equal scores)
                newer = await self.redis.zcount(index, f"({ms}", "+inf")
                same = await self.redis.zrangebyscore(index, ms, ms)
                start = newer + sum(text(i) > after for i in same)
            else:
                start = rank + 1
        ids = [text(i) for i in await self.redis.zrevrange(index, start, start + limit)]
        records = await self.redis.mget([kind.record(owner, i) for i in ids[:limit]]) if ids else []
        return Page([json.loads(r) for r in records if r is not None], len(ids) > limit)

    async def count(self, kind: Kind, owner: str) -> int:
        return int(await self.redis.zcard(kind.index(owner)))

    async def delete(self, kind: Kind, owner: str, object_id: str) -> bool:
        """Remove the object and its audio; False (nothing touched) if it is not `kind`'s."""
        # only an id the store made names a file
        note = (self._note(owner, object_id)
                if self.blob_dir is not None and OBJECT_ID.fullmatch(object_id) else "")
        removed = await self._delete(keys=[kind.record(owner, object_id), kind.index(owner),
                                           keys.voice_audio(owner, object_id),
                                           keys.voice_files()],
                                     args=[object_id, time.time(), note])
        if removed and note:
            await self._delete_file(owner, object_id, note)
        return bool(removed)

    async def withdraw(self, owner: str, consent_id: str) -> bool:
        """Delete the consent, then every voice made under it (withdrawn consent speaks no
        more); whether anything was removed. The consent goes first (a voice whose check ends
        meanwhile is refused: its create needs the consent), and the withdrawal is noted
        until its voices are gone, so one cut short (a gateway stopped, Redis lost) is
        finished by the sweeper, not left holding the speaker's samples."""
        note = json.dumps([owner, consent_id])
        await self.redis.zadd(keys.consents_withdrawn(), {note: time.time()})
        removed = await self.delete(CONSENTS, owner, consent_id)
        removed = await self._delete_voices_of(owner, consent_id) or removed
        await self.redis.zrem(keys.consents_withdrawn(), note)
        return removed

    async def _delete_voices_of(self, owner: str, consent_id: str) -> bool:
        removed = False
        for voice in (await self.list(VOICES, owner, None, 10_000)).items:
            if voice.get("consent") == consent_id:
                removed = await self.delete(VOICES, owner, voice["id"]) or removed
        return removed

    async def sweep(self, older_than_seconds: float = FILE_NOTE_SECONDS) -> int:
        """Finish the withdrawals and delete the files whose notes are older than
        `older_than_seconds` (a gateway stopped part way): voices whose consent is gone, and
        files whose record is missing; the number deleted."""
        removed = await self._sweep_withdrawn(older_than_seconds)
        if self.blob_dir is None:
            return removed
        files = keys.voice_files()
        for note in await self.redis.zrangebyscore(files, "-inf",
                                                   time.time() - older_than_seconds):
            name, records = json.loads(note)
            if not await self.redis.exists(*records):
                await _on_disk(self.blob_dir.delete, self.blob_dir.root / name)
                removed += 1
            await self.redis.zrem(files, note)
        # a gateway killed in a write leaves its temporary file (blobs.BlobDir.write)
        for stale in await _on_disk(self.blob_dir.stale_files, older_than_seconds):
            if stale.name.startswith(".") and stale.name.endswith(".tmp"):
                await _on_disk(self.blob_dir.delete, stale)
                removed += 1
        return removed

    async def _sweep_withdrawn(self, older_than_seconds: float) -> int:
        withdrawn, removed = keys.consents_withdrawn(), 0
        for note in await self.redis.zrangebyscore(withdrawn, "-inf",
                                                   time.time() - older_than_seconds):
            owner, consent_id = json.loads(note)
            if not await self.redis.exists(CONSENTS.record(owner, consent_id)):
                removed += await self._delete_voices_of(owner, consent_id)
            await self.redis.zrem(withdrawn, note)
        return removed

    def _note(self, owner: str, object_id: str) -> str:
        """The file's name, and every record that may name it (a delete of a consent's id as
        a voice notes the consent's file too: it must stay while the consent exists)."""
        return json.dumps([self._path(owner, object_id).name,
                           [kind.record(owner, object_id) for kind in (CONSENTS, VOICES)]])

    async def _write_file(self, owner: str, object_id: str, audio: bytes) -> str:
        """The audio's file, noted first: the note, for the create script to take away."""
        assert self.blob_dir is not None
        note = self._note(owner, object_id)
        await self.redis.zadd(keys.voice_files(), {note: time.time()})
        await _on_disk(self.blob_dir.write, self._path(owner, object_id), audio)
        return note

    async def _delete_file(self, owner: str, object_id: str, note: str) -> None:
        assert self.blob_dir is not None
        await _on_disk(self.blob_dir.delete, self._path(owner, object_id))
        await self.redis.zrem(keys.voice_files(), note)

    async def audio(self, owner: str, object_id: str) -> bytes | None:
        if self.blob_dir is not None:
            if not OBJECT_ID.fullmatch(object_id):  # a client's id never becomes a path
                return None
            return await _on_disk(self.blob_dir.read, self._path(owner, object_id))
        return await self.redis.get(keys.voice_audio(owner, object_id))

    def _path(self, owner: str, object_id: str) -> Path:
        assert self.blob_dir is not None
        return self.blob_dir.root / f"{hashlib.sha256(owner.encode()).hexdigest()[:24]}-{object_id}"


async def _on_disk(call: Callable[..., T], *args: Any) -> T:
    """A voice file's read, write or delete, off the event loop (a sample is up to 10 MiB,
    and the folder may be a network volume); a failing disk is the store unavailable (a 503
    to the caller), like a lost Redis."""
    try:
        return await asyncio.to_thread(call, *args)
    except OSError as exc:
        raise StoreError(f"the voice folder failed: {exc.strerror or exc}") from None
