"""common/store/voices.py with its audio in a blob directory (SPEECH_BLOB_DIR): an id a
client sends is looked up, never turned into a path, so no id reads or deletes a file the
store did not write, and an id the file system cannot name is simply unknown."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest
from redis.asyncio import Redis

from common import keys
from common.blobs import BlobDir
from common.settings import Settings
from common.store import StoreError, TaskStore
from common.store.voices import (
    CONSENTS,
    FILE_NOTE_SECONDS,
    VOICES,
    UnknownCursor,
    VoiceStore,
    new_id,
)
from gateway.errors import RequestError
from gateway.jobs.sweeper import Sweeper
from gateway.serving.voices import use_custom_voice
from gateway.submit.inputs import Params
from harness import procs

OWNER = "key-a"
CLIENT_IDS = ("../../../outside", "cons_" + "0" * 23 + "/../../outside", "x" * 300,
              "voice_\x00", "cons_" + "g" * 24, "")


def test_client_ids_never_reach_the_blob_directory(redis: procs.RedisServer,
                                                   tmp_path: Path) -> None:
    root = tmp_path / "blobs" / "voices"
    outside = tmp_path / "outside"
    outside.write_bytes(b"not yours")
    real = "cons_" + "ab" * 12

    async def scenario() -> None:
        client = Redis.from_url(redis.url)
        store = VoiceStore(client, BlobDir(root, 0))
        record = {"id": real, "object": "audio.voice_consent", "created_at": 1}
        assert await store.create(CONSENTS, OWNER, record, b"consent audio")
        for object_id in CLIENT_IDS:
            assert await store.audio(OWNER, object_id) is None, object_id
            for kind in (CONSENTS, VOICES):
                assert await store.delete(kind, OWNER, object_id) is False, object_id
        assert await store.audio(OWNER, real) == b"consent audio"
        assert await store.delete(CONSENTS, OWNER, real)
        assert await store.audio(OWNER, real) is None
        await client.aclose()

    asyncio.run(scenario())
    assert outside.read_bytes() == b"not yours"
    assert list(root.iterdir()) == []


def test_no_allowed_root_reaches_into_the_blob_directory(tmp_path: Path) -> None:
    """A path submit under SPEECH_BLOB_DIR would read other keys' inputs, outputs and voice
    clips: settings whose allowed roots hold the blob directory, or lie inside it (symlinks
    resolved), are refused at start; roots beside it are fine."""
    blobs, beside = tmp_path / "data" / "blobs", tmp_path / "data" / "audio"
    blobs.mkdir(parents=True)
    beside.mkdir()
    (tmp_path / "link").symlink_to(blobs)
    for root in (tmp_path / "data", blobs, blobs / "inner", tmp_path / "link"):
        with pytest.raises(ValueError, match="overlaps the blob directory"):
            Settings(blob_dir=blobs, allowed_roots=[beside, root])
    assert Settings(blob_dir=blobs, allowed_roots=[beside]).allowed_roots == [beside]
    assert Settings(allowed_roots=[tmp_path]).blob_dir is None  # no blob directory: no files


def test_a_voice_needs_its_consent_when_stored_and_when_used(redis: procs.RedisServer) -> None:
    """A consent withdrawn while its voice was being checked makes no voice (the check and
    the insert are one step); a voice whose consent is gone is no voice to speak with."""
    consent, voice = "cons_" + "cd" * 12, "voice_" + "ef" * 12

    async def scenario() -> None:
        client = Redis.from_url(redis.url)
        store = VoiceStore(client, None)
        await store.create(CONSENTS, OWNER, {"id": consent}, b"consent audio")
        made = {"id": voice, "consent": consent}
        assert await store.create(VOICES, OWNER, made, b"sample", 3, consent=consent) == 1
        assert await store.delete(CONSENTS, OWNER, consent)  # withdrawn (its voice missed)
        other = {"id": "voice_" + "ab" * 12, "consent": consent}
        assert await store.create(VOICES, OWNER, other, b"sample", 3, consent=consent) == -1
        assert await store.get(VOICES, OWNER, other["id"]) is None
        params = Params({"voice": voice}, {}, {})
        with pytest.raises(RequestError) as refused:
            await use_custom_voice(params, OWNER, store)
        assert refused.value.status_code == 404
        await client.aclose()

    asyncio.run(scenario())


@pytest.mark.parametrize("in_blobs", [False, True])
def test_deleting_a_consents_id_as_a_voice_touches_nothing(
        redis: procs.RedisServer, tmp_path: Path, in_blobs: bool) -> None:
    """Consents and voices share the audio keyspace: `DELETE /v1/audio/voices/{a consent's
    id}` is a 404 and leaves the consent's recording (it deleted it, so no voice could be
    made under the consent again)."""
    consent = "cons_" + "12" * 12

    async def scenario() -> None:
        client = Redis.from_url(redis.url)
        store = VoiceStore(client, BlobDir(tmp_path / "voices", 0) if in_blobs else None)
        assert await store.create(CONSENTS, OWNER, {"id": consent}, b"consent audio") == 1
        assert await store.delete(VOICES, OWNER, consent) is False
        assert await store.get(CONSENTS, OWNER, consent) == {"id": consent}
        assert await store.audio(OWNER, consent) == b"consent audio"
        assert await store.delete(CONSENTS, OWNER, consent) is True
        assert await store.audio(OWNER, consent) is None
        await client.aclose()

    asyncio.run(scenario())


def test_a_list_goes_on_after_an_object_deleted_since_the_page_before(
        redis: procs.RedisServer) -> None:
    """`after` names the last object of the page before; deleted since, the next page still
    starts where it stood (its id carries its creation time, the index's score), with no
    object twice and none skipped, ties of one millisecond included."""
    now = int(time.time() * 1000)
    ids = [f"voice_{now - 5000 + step:012x}{suffix:0>12}"
           for step, suffix in ((0, "000001"), (1, "000002"), (2, "00000a"), (2, "00000b"),
                                (3, "000003"), (4, "000004"))]  # oldest first

    async def scenario() -> list[list[str]]:
        client = Redis.from_url(redis.url)
        store = VoiceStore(client, None)
        for object_id in ids:
            assert await store.create(VOICES, OWNER, {"id": object_id}, b"sample")
        pages, after = [], None
        while True:
            page = await store.list(VOICES, OWNER, after, 2)
            pages.append([item["id"] for item in page.items])
            if not page.has_more:
                break
            after = pages[-1][-1]
            assert await store.delete(VOICES, OWNER, after)  # gone before the next page
        with pytest.raises(UnknownCursor):  # no such object, nor a time to place it by
            await store.list(VOICES, OWNER, "voice_" + "ab" * 12, 2)
        with pytest.raises(UnknownCursor):
            await store.list(VOICES, OWNER, "not an id", 2)
        made = new_id("voice")
        assert await store.create(VOICES, OWNER, {"id": made}, b"sample")
        assert [item["id"] for item in (await store.list(VOICES, OWNER, None, 1)).items] == [
            made]
        await client.aclose()
        return pages

    newest_first = ids[::-1]
    assert asyncio.run(scenario()) == [newest_first[0:2], newest_first[2:4], newest_first[4:6]]


def test_a_file_a_stopped_gateway_left_without_its_record_is_swept(
        redis: procs.RedisServer, tmp_path: Path) -> None:
    """A file and its record change in two steps; a gateway stopped between them (after a new
    voice's file, before its record; after a record's delete, before its file) leaves a file
    no record names, which the gateway's sweeper deletes once its note is old: a create or a
    delete under way, and every stored voice or consent, keep theirs."""
    kept, half_made, half_deleted, under_way, consent = (
        new_id(prefix) for prefix in ("voice", "voice", "cons", "voice", "cons"))

    async def scenario() -> tuple[int, int]:
        client = Redis.from_url(redis.url)
        store = TaskStore(client, 60, BlobDir(tmp_path / "blobs", 0))
        voices = VoiceStore.of(store)
        assert await voices.create(VOICES, OWNER, {"id": kept}, b"kept sample")
        made = await voices.create(CONSENTS, OWNER, {"id": half_deleted}, b"consent")
        assert made and await client.zcard(keys.voice_files()) == 0  # nothing left noted
        old = time.time() - FILE_NOTE_SECONDS - 1
        await voices._write_file(OWNER, half_made, b"never stored")  # then stopped
        await client.zadd(keys.voice_files(), {voices._note(OWNER, half_made): old})
        await client.zadd(keys.voice_files(), {voices._note(OWNER, half_deleted): old})
        await client.delete(CONSENTS.record(OWNER, half_deleted))  # its delete, then stopped
        # a delete of a consent's id as a voice (nothing to delete), stopped before the end
        assert await voices.create(CONSENTS, OWNER, {"id": consent}, b"consent kept")
        await client.zadd(keys.voice_files(), {voices._note(OWNER, consent): old})
        await voices._write_file(OWNER, under_way, b"being stored")  # noted just now
        before = len(list((tmp_path / "blobs" / "voices").iterdir()))
        await Sweeper(store, Settings()).sweep()
        assert await voices.audio(OWNER, kept) == b"kept sample"
        assert await voices.audio(OWNER, under_way) == b"being stored"
        assert await voices.audio(OWNER, consent) == b"consent kept"
        for gone in (half_made, half_deleted):
            assert await voices.audio(OWNER, gone) is None, gone
        assert await client.zcard(keys.voice_files()) == 1  # the create under way's note
        assert await voices.sweep(older_than_seconds=0) == 1  # its record never came
        assert await voices.delete(VOICES, OWNER, kept)
        assert await voices.delete(CONSENTS, OWNER, consent)
        after = len(list((tmp_path / "blobs" / "voices").iterdir()))
        assert await client.zcard(keys.voice_files()) == 0
        await client.aclose()
        return before, after

    assert asyncio.run(scenario()) == (5, 0)


def test_a_voice_file_that_cannot_be_written_leaves_nothing_and_is_a_503(
        redis: procs.RedisServer, tmp_path: Path) -> None:
    """A failing write (here its name is taken by a folder: os.replace fails, as a full disk
    would fail the write) is the store unavailable, not a 500, and leaves no temporary file;
    one a killed gateway left is swept once old."""
    voice = new_id("voice")

    async def scenario() -> list[str]:
        client = Redis.from_url(redis.url)
        store = TaskStore(client, 60, BlobDir(tmp_path / "blobs", 0))
        voices = VoiceStore.of(store)
        assert voices.blob_dir is not None
        taken = voices._path(OWNER, voice)
        taken.mkdir(parents=True)
        with pytest.raises(StoreError, match="voice folder failed"):
            await voices.create(VOICES, OWNER, {"id": voice}, b"sample")
        assert not await client.exists(VOICES.record(OWNER, voice))
        assert sorted(path.name for path in voices.blob_dir.root.iterdir()) == [taken.name]
        taken.rmdir()
        left = voices.blob_dir.root / ".abc-voice_x.1234.tmp"  # a killed gateway's
        left.write_bytes(b"half")
        assert await voices.sweep(older_than_seconds=0) >= 1
        await client.aclose()
        return sorted(path.name for path in voices.blob_dir.root.iterdir())

    assert asyncio.run(scenario()) == []


def test_a_withdrawal_cut_short_is_finished_by_the_sweeper(redis: procs.RedisServer) -> None:
    """A consent's delete removes its record, then its voices, in several calls: a gateway
    stopped in between leaves voices (and the speaker's samples) that can never speak. The
    withdrawal is noted until its voices are gone, and the sweeper finishes an old one; a
    note whose consent still stands (stopped before its delete) touches nothing."""
    withdrawn, kept = new_id("cons"), new_id("cons")
    orphan, keeper = new_id("voice"), new_id("voice")

    async def scenario() -> None:
        client = Redis.from_url(redis.url)
        store = VoiceStore(client, None)
        for consent, voice in ((withdrawn, orphan), (kept, keeper)):
            await store.create(CONSENTS, OWNER, {"id": consent}, b"consent audio")
            assert await store.create(VOICES, OWNER, {"id": voice, "consent": consent},
                                      b"sample", 5, consent=consent) == 1
        old = time.time() - FILE_NOTE_SECONDS - 1
        for consent in (withdrawn, kept):  # both noted, then stopped
            await client.zadd(keys.consents_withdrawn(), {json.dumps([OWNER, consent]): old})
        assert await store.delete(CONSENTS, OWNER, withdrawn)  # … one after its record
        await Sweeper(TaskStore(client, 60), Settings()).sweep()
        assert await store.get(VOICES, OWNER, orphan) is None
        assert await client.get(keys.voice_audio(OWNER, orphan)) is None
        assert await store.get(VOICES, OWNER, keeper) is not None
        assert await client.zcard(keys.consents_withdrawn()) == 0
        assert await store.withdraw(OWNER, kept)  # whole: nothing left noted
        assert await store.get(VOICES, OWNER, keeper) is None
        assert await client.zcard(keys.consents_withdrawn()) == 0
        assert not await store.withdraw(OWNER, kept)  # nothing to remove
        await client.aclose()

    asyncio.run(scenario())
