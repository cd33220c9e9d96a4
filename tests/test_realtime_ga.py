"""The GA realtime transcription fields (issue 26), against a real redis-server, gateway and
faster-whisper worker (tiny.en): G.711 input with manual commits, `languages[]`, `keywords[]`,
`delay`, completed events matched by item_id, and live turns that read like the same span of
audio through the file path (same prefix padding, same prompt from the earlier turns)."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import websockets

from common import g711, keys
from common.audio import decode_audio, encode_wav
from common.settings import Settings
from gateway.auth import digest
from gateway.realtime.protocol import ProtocolError, SessionConfig, Transcription, updated
from gateway.realtime.session import resolve, turn_prompt
from harness import procs
from harness.conversation import speak_to
from harness.http_client import http
from tests.helpers import JFK, JFK_TEXT, wer
from tests.test_realtime import (
    AUTH,
    KEY,
    TRANSCRIPTION,
    Raw,
    check_turn_events,
    chunks,
    configure,
    connect,
    joined_transcript,
    pcm,
    sdk,
    start_worker,
)

#: held-in recordings besides jfk: espeak-ng sentences with a second of silence between
SENTENCES = ("The quick brown fox jumps over the lazy dog.",
             "Please call Stella and ask her to bring these things with her.",
             "Yesterday we walked along the old railway line.",
             "It is easy to tell the depth of a well.")


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    workdir = tmp_path_factory.mktemp("realtime-ga")
    server = procs.RedisServer(workdir / "redis").start()
    gateway = procs.gateway(server.url, workdir, api_keys=[f"sha256:{digest(KEY)}"]).start()
    env: dict[str, Any] = {"redis": server, "gateway": gateway.url, "workdir": workdir,
                           "ws": gateway.url.replace("http://", "ws://") + "/v1/realtime"}
    env["worker"] = start_worker(env)
    yield env
    env["worker"].stop()
    gateway.stop()
    server.stop()


def g711_chunks(audio: np.ndarray, encoding: str) -> list[str]:
    data = g711.encode(audio, encoding)
    return [base64.b64encode(data[i:i + 800]).decode() for i in range(0, len(data), 800)]


@pytest.mark.parametrize("encoding", ["audio/pcmu", "audio/pcma"])
def test_g711_session_with_manual_commit_transcribes_jfk(live: dict[str, Any],
                                                          encoding: str) -> None:
    """Through the openai SDK: `audio/pcmu` / `audio/pcma` at 8 kHz, turn_detection null,
    one commit; the session echoes the format and the transcript reads as jfk."""
    async def run() -> tuple[Any, str]:
        client = sdk(live)
        async with client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
            await conn.session.update(session={
                "type": "transcription", "audio": {"input": {
                    "format": {"type": encoding},
                    "transcription": {"model": "whisper-1", "languages": ["en"]},
                    "turn_detection": None}}})  # type: ignore[typeddict-item]
            for chunk in g711_chunks(decode_audio(JFK, 8000), encoding):
                await conn.input_audio_buffer.append(audio=chunk)
            await conn.input_audio_buffer.commit()
            updated, committed = None, None
            async with asyncio.timeout(60):
                async for event in conn:
                    assert event.type != "error", event
                    if event.type == "session.updated":
                        updated = event
                    elif event.type == "input_audio_buffer.committed":
                        committed = event.item_id
                    elif event.type == f"{TRANSCRIPTION}.completed":
                        assert event.item_id == committed
                        return updated, event.transcript
        raise AssertionError("no completed event")

    updated, transcript = asyncio.run(run())
    assert updated.session.audio.input.format.type == encoding
    assert updated.session.audio.input.turn_detection is None
    assert wer(JFK_TEXT, transcript) <= 0.25, transcript


def test_ga_transcription_fields_reach_the_task_options() -> None:
    settings = Settings(redis_url="redis://127.0.0.1:1/0")
    target = resolve(settings, Transcription(languages=("xx", "EN-us", "de")))
    assert target.options["language"] == "en"  # the first one the backend supports
    assert "language" not in resolve(settings, Transcription(languages=("xx",))).options
    # the first the model takes too: tiny.en is English-only
    assert resolve(settings, Transcription(languages=("de", "en"))).options["language"] == "en"
    assert "language" not in resolve(settings, Transcription(languages=("de",))).options
    # … by its source too: the bundled model is tiny.en, whatever it is named
    renamed = Settings(redis_url="redis://127.0.0.1:1/0",
                       models={"faster-whisper": {"default": "bundled",
                                                  "small": "/models/small"}})
    with pytest.raises(ProtocolError) as english_only:
        resolve(renamed, Transcription(model="faster-whisper/default", language="de"))
    assert english_only.value.code == "unsupported_language"
    assert resolve(renamed, Transcription(model="faster-whisper/small",
                                          language="de")).options["language"] == "de"
    target = resolve(settings, Transcription(prompt="A talk.", keywords=("Kennedy", "Americans")))
    assert target.options["prompt"] == "A talk. Kennedy, Americans"
    assert resolve(settings, Transcription(delay="minimal")).options["beam_size"] == 1
    assert resolve(settings, Transcription(delay="xhigh")).options["beam_size"] == 10
    assert "beam_size" not in resolve(settings, Transcription(delay="medium")).options
    whisper = resolve(settings, Transcription())
    for name in ("gpt-4o-transcribe", "gpt-4o-mini-transcribe"):  # OpenAI's current names
        assert resolve(settings, Transcription(model=name)) == whisper
    assert turn_prompt("Kennedy", ["And so,", " my fellow "]) == "Kennedy And so, my fellow"
    long = turn_prompt("", ["word " * 1000])
    assert 0 < len(long) <= 800 and long.startswith("word")


def test_unknown_session_fields_are_refused_and_nothing_applies() -> None:
    """A beta-shaped update (its fields at the session's top level) or a misspelt GA field is
    refused by name, as OpenAI's GA server refuses it; the valid parts beside it are not
    applied. A session object echoed back from session.created applies as it is."""
    config = SessionConfig()
    for session, param in (
            ({"input_audio_format": "g711_ulaw",
              "audio": {"input": {"format": {"type": "audio/pcmu"}}}},
             "session.input_audio_format"),
            ({"input_audio_transcription": {"model": "whisper-1"}},
             "session.input_audio_transcription"),
            ({"audio": {"output": {"voice": "alloy"}}}, "session.audio.output"),
            ({"audio": {"input": {"format": {"type": "audio/pcmu"}, "noise": None}}},
             "session.audio.input.noise"),
            ({"audio": {"input": {"format": {"type": "audio/pcm", "rate": 16000,
                                             "channels": 2}}}},
             "session.audio.input.format.channels"),
            ({"audio": {"input": {"transcription": {"model": "whisper-1", "temperature": 0}}}},
             "session.audio.input.transcription.temperature"),
            ({"audio": {"input": {"noise_reduction": {"type": "near_field", "gain": 2}}}},
             "session.audio.input.noise_reduction.gain"),
            ({"audio": {"input": {"turn_detection": {"type": "server_vad", "threshold": 0.2,
                                                     "eagerness": "low"}}}},
             "session.audio.input.turn_detection.eagerness"),
            ({"audio": {"input": {"turn_detection": {"type": "semantic_vad",
                                                     "threshold": 0.2}}}},
             "session.audio.input.turn_detection.threshold")):
        with pytest.raises(ProtocolError) as refused:
            updated(config, {"type": "transcription", **session}, "evt_1")
        assert (refused.value.code, refused.value.param) == ("unknown_parameter", param)
        assert refused.value.message == f"Unknown parameter: '{param}'."
        assert refused.value.event_id == "evt_1"
    for bad, param in (({"create_response": "yes"}, "create_response"),
                       ({"idle_timeout_ms": -5}, "idle_timeout_ms")):
        with pytest.raises(ProtocolError) as refused:
            updated(config, {"type": "transcription", "audio": {"input": {
                "turn_detection": {"type": "server_vad", **bad}}}}, None)
        assert refused.value.param == f"session.audio.input.turn_detection.{param}"
    ga = updated(config, {"type": "transcription", "audio": {"input": {"turn_detection": {
        "type": "server_vad", "threshold": 0.3, "create_response": True,
        "interrupt_response": False, "idle_timeout_ms": None}}}}, None)
    assert ga.turn_detection is not None and ga.turn_detection.threshold == 0.3
    changed = replace(config, rate=16000, transcription=Transcription(
        model="whisper-1", language="en", keywords=("Kennedy",)))
    echoed = changed.public("sess_1")
    assert updated(config, echoed, None) == changed
    assert updated(config, {**echoed, "expires_at": 1_800_000_000}, None) == changed


def test_ga_fields_are_echoed_and_checked(live: dict[str, Any]) -> None:
    async def run() -> None:
        client = await connect(live)
        await client.send(type="session.update", session={"type": "transcription", "audio": {
            "input": {"transcription": {"model": "whisper-1", "languages": ["fr", "en"],
                                        "keywords": ["Kennedy"], "delay": "low"}}}})
        await client.wait(lambda: client.of("session.updated"), 10)
        echoed = client.of("session.updated")[0]["session"]["audio"]["input"]["transcription"]
        assert echoed["languages"] == ["fr", "en"] and echoed["keywords"] == ["Kennedy"]
        assert echoed["delay"] == "low"
        for bad, param in (({"delay": "slow"}, "delay"), ({"delay": []}, "delay"),
                           ({"delay": {"a": 1}}, "delay"), ({"keywords": "Kennedy"}, "keywords"),
                           ({"languages": [""]}, "languages"),
                           ({"previous_turns_prompt": "yes"}, "previous_turns_prompt")):
            errors = len(client.of("error"))
            await client.send(type="session.update", session={
                "type": "transcription", "audio": {"input": {"transcription": bad}}})
            error = (await client.next_error(errors))["error"]
            assert error["param"] == f"session.audio.input.transcription.{param}", error
        errors = len(client.of("error"))
        await client.send(type="session.update", session={
            "type": "transcription", "audio": {"input": {"format": {"type": "audio/g729"}}}})
        assert (await client.next_error(errors))["error"]["param"].endswith("format.type")
        await client.socket.close()

    asyncio.run(run())


def test_openai_docs_session_fields_are_taken_and_the_rest_applied(
        live: dict[str, Any]) -> None:
    """An update as OpenAI's examples write it: noise_reduction, include logprobs and
    semantic_vad are taken (not honoured: session.updated shows null, [] and the server VAD
    that runs instead), and the rest of the update applies; the turns then transcribe."""
    async def run() -> None:
        client = await connect(live)
        await client.send(type="session.update", session={
            "type": "transcription", "include": ["item.input_audio_transcription.logprobs"],
            "audio": {"input": {
                "format": {"type": "audio/pcm", "rate": 16000},
                "noise_reduction": {"type": "near_field"},
                "transcription": {"model": "gpt-4o-transcribe", "language": "en"},
                "turn_detection": {"type": "semantic_vad", "eagerness": "low"}}}})
        await client.wait(lambda: client.of("session.updated") or client.of("error"), 10)
        session = client.of("session.updated")[0]["session"]
        assert session["include"] == [] and session["audio"]["input"]["noise_reduction"] is None
        assert session["audio"]["input"]["format"] == {"type": "audio/pcm", "rate": 16000}
        assert session["audio"]["input"]["transcription"]["model"] == "gpt-4o-transcribe"
        assert session["audio"]["input"]["turn_detection"]["type"] == "server_vad"
        for chunk in chunks(pcm(JFK, 16000), 16000):
            await client.send(type="input_audio_buffer.append", audio=chunk)
        await client.wait(client.all_answered, 120)
        check_turn_events(client, vad=True)
        assert wer(JFK_TEXT, joined_transcript(client)) <= 0.15
        assert all("logprobs" not in e for e in client.of(f"{TRANSCRIPTION}.completed"))
        await client.socket.close()

    asyncio.run(run())


def test_unknown_session_values_are_still_refused(live: dict[str, Any]) -> None:
    async def run() -> None:
        client = await connect(live)
        path = "session.audio.input"
        for session, param in (
                ({"include": ["item.input_audio_transcription.everything"]}, "session.include"),
                ({"include": "logprobs"}, "session.include"),
                ({"audio": {"input": {"noise_reduction": {"type": "space_field"}}}},
                 f"{path}.noise_reduction.type"),
                ({"audio": {"input": {"noise_reduction": "on"}}}, f"{path}.noise_reduction"),
                ({"audio": {"input": {"turn_detection": {"type": "magic_vad"}}}},
                 f"{path}.turn_detection.type"),
                ({"audio": {"input": {"turn_detection": {"type": "semantic_vad",
                                                         "eagerness": "eager"}}}},
                 f"{path}.turn_detection.eagerness"),
                ({"input_audio_format": "g711_ulaw",
                  "audio": {"input": {"format": {"type": "audio/pcmu"}}}},
                 "session.input_audio_format"),
                ({"audio": {"input": {"transcription": {"model": "whisper-1",
                                                        "language": "de"}}}},  # tiny.en
                 f"{path}.transcription.language")):
            errors = len(client.of("error"))
            await client.send(type="session.update", session={"type": "transcription",
                                                              **session})
            error = (await client.next_error(errors))["error"]
            assert error["param"] == param, error
        errors = len(client.of("error"))  # a lone surrogate is no text for a prompt
        await client.send(type="session.update", session={"type": "transcription", "audio": {
            "input": {"transcription": {"model": "whisper-1", "prompt": "a \ud800 b"}}}})
        assert "surrogate" in (await client.next_error(errors))["error"]["message"]
        assert not client.of("session.updated")
        await client.socket.close()

    asyncio.run(run())


def test_every_threshold_the_sdk_allows_is_taken_and_a_low_one_still_ends_turns(
        live: dict[str, Any]) -> None:
    """0 and 1 are thresholds (the SDK's range is inclusive); a threshold at or below the
    hysteresis still finds silence (silero's floor: a frame below 0.01), so a turn ends at
    the speaker's pause, not at the buffer's limit; a number past a float's range is refused
    as an error event, the session kept."""
    async def run() -> Raw:
        client = await connect(live)
        vad = {"type": "server_vad", "silence_duration_ms": 300}
        for threshold in (0.0, 1.0, 0.1):
            updated = len(client.of("session.updated"))
            await client.send(type="session.update", session={"type": "transcription", "audio": {
                "input": {"format": {"type": "audio/pcm", "rate": 16000},
                          "transcription": {"model": "whisper-1", "language": "en"},
                          "turn_detection": {**vad, "threshold": threshold}}}})
            await client.wait(lambda seen=updated: len(client.of("session.updated")) > seen, 10)
        errors = len(client.of("error"))
        await client.send(type="session.update", session={"type": "transcription", "audio": {
            "input": {"turn_detection": {**vad, "threshold": 10 ** 400}}}})
        error = (await client.next_error(errors))["error"]
        assert error["param"] == "session.audio.input.turn_detection.threshold", error
        audio = np.concatenate([np.zeros(8000, np.float32),
                                espeak(SENTENCES[0], live["workdir"] / "low.wav"),
                                np.zeros(24000, np.float32)])
        pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
        await client.send(type="input_audio_buffer.append", audio=base64.b64encode(pcm).decode())
        await client.wait(lambda: client.of(f"{TRANSCRIPTION}.completed"), 60)
        await client.socket.close()
        return client

    client = asyncio.run(run())
    assert client.of("session.updated")[-1]["session"]["audio"]["input"]["turn_detection"][
        "threshold"] == 0.1
    assert len(client.of("input_audio_buffer.speech_stopped")) == 1
    (completed,) = client.of(f"{TRANSCRIPTION}.completed")
    assert wer(SENTENCES[0], completed["transcript"]) <= 0.5, completed


def test_completed_events_match_their_turns_by_item_id(live: dict[str, Any]) -> None:
    """Three manual commits in a row, each its own item: every completed event names the item
    its audio was committed as (whatever order they finish in)."""
    async def run() -> Raw:
        client = await connect(live)
        await client.send(type="session.update", session={"type": "transcription", "audio": {
            "input": {"format": {"type": "audio/pcm", "rate": 16000},
                      "transcription": {"model": "whisper-1", "language": "en",
                                        "previous_turns_prompt": False},
                      "turn_detection": None}}})
        await client.wait(lambda: client.of("session.updated"), 10)
        for text in SENTENCES[:3]:
            # a commit holds only what was appended: give it the onset a VAD turn would have
            audio = np.concatenate([np.zeros(4800, np.float32),
                                    espeak(text, live["workdir"] / "one.wav")])
            pcm = (np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes()
            await client.send(type="input_audio_buffer.append",
                              audio=base64.b64encode(pcm).decode())
            await client.send(type="input_audio_buffer.commit")
        await client.wait(lambda: len(client.of(f"{TRANSCRIPTION}.completed")) == 3, 90)
        await client.socket.close()
        return client

    client = asyncio.run(run())
    check_turn_events(client, vad=False)
    committed = [e["item_id"] for e in client.of("input_audio_buffer.committed")]
    texts = {e["item_id"]: e["transcript"] for e in client.of(f"{TRANSCRIPTION}.completed")}
    for item, sentence in zip(committed, SENTENCES, strict=False):
        # each item's text is its own sentence's, not a neighbour's
        closest = min(SENTENCES[:3], key=lambda candidate: wer(candidate, texts[item]))
        assert closest == sentence and wer(sentence, texts[item]) <= 0.5, texts


def test_a_turn_detection_change_mid_speech_ends_that_turn_as_its_item(
        live: dict[str, Any]) -> None:
    """Tuning the VAD while the user talks: the speech so far is stopped and committed as the
    item its speech_started named, and transcribed (it was dropped, but for its last 300 ms,
    and that item never ended); the new detector then takes the rest as turns of its own."""
    async def run() -> Raw:
        client = await connect(live)
        await configure(client, {"type": "server_vad", "silence_duration_ms": 500})
        data = pcm(JFK, silence=1.5)
        parts = chunks(data)
        for index, chunk in enumerate(parts):
            await client.send(type="input_audio_buffer.append", audio=chunk)
            if index == 40:  # 4 s in: JFK is mid-sentence
                await client.wait(lambda: client.of("input_audio_buffer.speech_started"), 10)
                await configure(client, {"type": "server_vad", "silence_duration_ms": 400})
        await client.wait(lambda: client.of("input_audio_buffer.committed") and len(client.of(
            f"{TRANSCRIPTION}.completed")) == len(client.of("input_audio_buffer.committed")), 90)
        await asyncio.sleep(1.0)  # (no late events)
        await client.socket.close()
        return client

    client = asyncio.run(run())
    check_turn_events(client, vad=True)  # every started item stopped, committed, completed
    first = client.of("input_audio_buffer.committed")[0]["item_id"]
    assert first == client.of("input_audio_buffer.speech_started")[0]["item_id"]
    texts = {e["item_id"]: e["transcript"] for e in client.of(f"{TRANSCRIPTION}.completed")}
    assert "fellow" in texts[first].lower(), texts  # the first 4 s, heard
    assert wer(JFK_TEXT, joined_transcript(client)) <= 0.25, joined_transcript(client)


def espeak(text: str, path: Path) -> np.ndarray:
    speak_to(path, text)
    return decode_audio(path, 16000)


def held_in(workdir: Path) -> list[tuple[str, np.ndarray, str]]:
    silence = np.zeros(16000, np.float32)
    parts = [part for text in SENTENCES
             for part in (espeak(text, workdir / "sentence.wav"), silence)]
    return [("jfk", decode_audio(JFK, 16000), JFK_TEXT),
            ("espeak", np.concatenate(parts), " ".join(SENTENCES))]


def test_live_turns_read_as_the_same_span_through_the_file_path(live: dict[str, Any]) -> None:
    """Server VAD with its defaults (prefix padding 300 ms, 500 ms of silence) cuts each
    recording into turns; each turn's span [audio_start_ms, audio_end_ms), sent as a file with
    the prompt the session gave it (the earlier turns' text), reads the same: the live word
    error is within 0.05 of the file path's."""
    async def session(audio: np.ndarray) -> Raw:
        client = await connect(live)
        await client.send(type="session.update", session={"type": "transcription", "audio": {
            "input": {"format": {"type": "audio/pcm", "rate": 16000},
                      "transcription": {"model": "whisper-1", "language": "en"}}}})
        await client.wait(lambda: client.of("session.updated"), 10)
        padded = np.concatenate([audio, np.zeros(32000, np.float32)])
        pcm = (np.clip(padded, -1, 1) * 32767).astype("<i2")
        for i in range(0, len(pcm), 1600):
            await client.send(type="input_audio_buffer.append",
                              audio=base64.b64encode(pcm[i:i + 1600].tobytes()).decode())
        await client.wait(lambda: client.of("input_audio_buffer.speech_stopped")
                          and len(client.of("input_audio_buffer.speech_started"))
                          == len(client.of("input_audio_buffer.speech_stopped"))
                          and client.all_answered(), 90)
        await client.socket.close()
        return client

    for name, audio, reference in held_in(live["workdir"]):
        client = asyncio.run(session(audio))
        check_turn_events(client, vad=True)
        starts = [e["audio_start_ms"] for e in client.of("input_audio_buffer.speech_started")]
        ends = [e["audio_end_ms"] for e in client.of("input_audio_buffer.speech_stopped")]
        assert len(starts) >= 2, (name, starts)
        texts = {e["item_id"]: e["transcript"] for e in client.of(f"{TRANSCRIPTION}.completed")}
        turns = [texts[e["item_id"]] for e in client.of("input_audio_buffer.committed")]
        # the same spans, as files, each with the prompt the session built from the turns
        # before it
        pcm16 = (np.clip(np.concatenate([audio, np.zeros(32000, np.float32)]), -1, 1)
                 * 32767).astype("<i2").astype(np.float32) / 32768.0
        file_texts: list[str] = []
        for i, (start, end) in enumerate(zip(starts, ends, strict=True)):
            span = encode_wav(pcm16[start * 16:end * 16], 16000)
            data = {"model": "whisper-1", "language": "en", "prompt": turn_prompt("", turns[:i])}
            reply = http.post(f"{live['gateway']}/v1/audio/transcriptions", headers=AUTH,
                               files={"file": ("span.wav", span)}, data=data, timeout=60)
            assert reply.status_code == 200, reply.text
            file_texts.append(reply.json()["text"])
        live_wer = wer(reference, " ".join(turns))
        file_wer = wer(reference, " ".join(file_texts))
        assert abs(live_wer - file_wer) <= 0.05, (name, turns, file_texts)
        # a bound against garbage only: tiny.en reads these espeak-ng sentences at 0.15-0.26
        # WER either way; what this test is about is the comparison above
        assert live_wer <= 0.35, (name, turns)


# --- ephemeral keys ------------------------------------------------------------------------

def test_an_ephemeral_key_opens_a_session_until_it_expires(live: dict[str, Any]) -> None:
    """Minted through the SDK (`realtime.client_secrets.create`): the key opens the WebSocket
    only, with the session it was minted with, charges the minting key's usage, and is
    refused (close 1008) once it expires."""
    client = openai.OpenAI(api_key=KEY, base_url=f"{live['gateway']}/v1", max_retries=0)
    usage = http.get(f"{live['gateway']}/v1/usage", headers=AUTH).json()
    before = usage["day"]["audio_seconds"]["used"]
    secret = client.realtime.client_secrets.create(
        expires_after={"anchor": "created_at", "seconds": 10},
        session={"type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcmu"}, "turn_detection": None,
            "transcription": {"model": "whisper-1", "language": "en"}}}})
    assert secret.value.startswith("ek_") and secret.session.type == "transcription"
    assert secret.expires_at - time.time() <= 10
    with pytest.raises(openai.BadRequestError):  # only transcription sessions here
        client.realtime.client_secrets.create(session={"type": "realtime"})
    ephemeral = ["realtime", f"openai-insecure-api-key.{secret.value}"]

    async def run() -> Raw:
        raw = await connect(live, headers=None, subprotocols=ephemeral)
        created = raw.of("session.created")[0]["session"]["audio"]["input"]
        assert created["format"] == {"type": "audio/pcmu"} and created["turn_detection"] is None
        for chunk in g711_chunks(decode_audio(JFK, 8000), "audio/pcmu"):
            await raw.send(type="input_audio_buffer.append", audio=chunk)
        await raw.send(type="input_audio_buffer.commit")
        await raw.wait(raw.all_answered, 60)
        await raw.socket.close()
        return raw

    raw = asyncio.run(run())
    transcript = raw.of(f"{TRANSCRIPTION}.completed")[0]["transcript"]
    assert wer(JFK_TEXT, transcript) <= 0.25, transcript
    # the turn was charged to the key that minted the secret
    usage = http.get(f"{live['gateway']}/v1/usage", headers=AUTH).json()
    assert usage["day"]["audio_seconds"]["used"] >= before + 10
    # an ephemeral key is no API key
    bearer = {"Authorization": f"Bearer {secret.value}"}
    assert http.get(f"{live['gateway']}/v1/models", headers=bearer).status_code == 401
    time.sleep(max(0.0, secret.expires_at - time.time()) + 1.1)

    async def expired() -> websockets.ConnectionClosed:
        socket = await websockets.connect(f"{live['ws']}?intent=transcription",
                                          subprotocols=ephemeral)  # type: ignore[list-item]
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await socket.recv()
        return closed.value

    closed = asyncio.run(expired())
    assert closed.rcvd is not None and closed.rcvd.code == 1008 and "expired" in closed.rcvd.reason


def test_an_ephemeral_key_met_by_a_key_store_outage_is_told_to_come_back(
        tmp_path: Path) -> None:
    """With Redis down the gateway cannot look an ephemeral key up: the socket closes 1013
    (try again later), which the SDK reconnects on, not 1008, which it takes as final."""
    server = procs.RedisServer(tmp_path / "redis").start()
    gateway = procs.gateway(server.url, tmp_path, api_keys=[f"sha256:{digest(KEY)}"]).start()
    server.stop()

    async def run() -> websockets.ConnectionClosed:
        socket = await websockets.connect(
            gateway.url.replace("http://", "ws://") + "/v1/realtime?intent=transcription",
            subprotocols=["realtime", "openai-insecure-api-key.ek_" + "x" * 32])  # type: ignore[list-item]
        with pytest.raises(websockets.ConnectionClosed) as closed:
            await socket.recv()
        return closed.value

    try:
        closed = asyncio.run(run())
    finally:
        gateway.stop()
    assert closed.rcvd is not None and closed.rcvd.code == 1013, closed.rcvd
    assert "unavailable" in closed.rcvd.reason


def test_an_ephemeral_key_goes_with_the_key_that_minted_it(tmp_path: Path) -> None:
    """A revoked API key's ephemeral keys are refused (1008) from then on: they ran on, for
    up to two hours, as an owner no quota, limit or lane share applies to."""
    server = procs.RedisServer(tmp_path / "redis").start()
    other = "sk-another-key-entirely"
    both = [f"sha256:{digest(KEY)}", f"sha256:{digest(other)}"]
    gateways = [procs.gateway(server.url, tmp_path, api_keys=both).start()]
    try:
        minted = http.post(f"{gateways[0].url}/v1/realtime/client_secrets", headers=AUTH,
                           json={"session": {"type": "transcription"}}, timeout=10)
        assert minted.status_code == 200, minted.text
        secret = minted.json()["value"]

        async def opened(url: str) -> int | None:
            socket = await websockets.connect(
                url.replace("http://", "ws://") + "/v1/realtime?intent=transcription",
                subprotocols=["realtime", f"openai-insecure-api-key.{secret}"])  # type: ignore[list-item]
            try:
                event = json.loads(await socket.recv())
                assert event["type"] == "session.created", event
                return None
            except websockets.ConnectionClosed as closed:
                return closed.rcvd.code if closed.rcvd is not None else -1
            finally:
                await socket.close()

        assert asyncio.run(opened(gateways[0].url)) is None  # while its key is configured
        gateways.append(procs.gateway(server.url, tmp_path,
                                      api_keys=[f"sha256:{digest(other)}"]).start())
        assert asyncio.run(opened(gateways[1].url)) == 1008  # once it is not
    finally:
        for gateway in gateways:
            gateway.stop()
        server.stop()


def test_one_key_has_at_most_its_client_secrets_alive(tmp_path: Path) -> None:
    """SPEECH_CLIENT_SECRETS_PER_KEY: each minted key is a record kept until it expires, so a
    key mints at most that many alive (a shorter-lived one does not end the count of the
    longer ones early); candidate languages are a few short tags, and a record keeps its
    text as UTF-8 (escaped, an emoji took 12 bytes)."""
    server = procs.RedisServer(tmp_path / "redis").start()
    gateway = procs.gateway(server.url, tmp_path, api_keys=[f"sha256:{digest(KEY)}"],
                            client_secrets_per_key="2").start()
    url = f"{gateway.url}/v1/realtime/client_secrets"

    def mint(seconds: int, **transcription: Any) -> httpx.Response:
        session = {"type": "transcription", "audio": {"input": {"transcription": {
            "model": "whisper-1", **transcription}}}}
        return http.post(url, headers=AUTH, timeout=10, json={
            "session": session, "expires_after": {"anchor": "created_at", "seconds": seconds}})

    try:
        many = mint(600, languages=[f"l{index}" for index in range(21)])
        assert many.status_code == 400, many.text
        assert many.json()["error"]["param"].endswith("transcription.languages")
        assert mint(600, languages=["x" * 36]).status_code == 400
        assert mint(7200, prompt="\U0001f600" * 50).status_code == 200
        assert mint(10).status_code == 200  # shorter: the count keeps the first one's life
        client = server.client()
        (slots,) = list(client.scan_iter(match=keys.slots("client-secrets", "*")))
        assert client.pttl(slots) > 7000_000
        refused = mint(600)
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "too_many_client_secrets"
        assert "retry-after" in refused.headers
        stored = [client.get(key) for key in client.scan_iter(match=keys.client_secret("*"))]
        assert len(stored) == 2
        assert any("\U0001f600".encode() in one for one in stored), stored
    finally:
        gateway.stop()
        server.stop()


def test_a_client_secret_keeps_only_the_checked_session(live: dict[str, Any]) -> None:
    """What a key is minted with is stored for its life: only the fields a session reads,
    from a body of at most 64 KiB; a field no session has is refused by name."""
    url = f"{live['gateway']}/v1/realtime/client_secrets"
    padded = {"type": "transcription", "ballast": "x" * 70_000}
    assert http.post(url, json={"session": padded}, headers=AUTH).status_code == 413
    padded["ballast"] = "x" * 1000
    refused = http.post(url, json={"session": padded}, headers=AUTH)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["code"] == "unknown_parameter"
    assert refused.json()["error"]["param"] == "session.ballast"
    minted = http.post(url, headers=AUTH, json={"session": {
        "type": "transcription", "id": "sess_" + "x" * 1000, "audio": {"input": {
            "transcription": {"model": "whisper-1", "prompt": "p" * 500}}}}})
    assert minted.status_code == 200, minted.text
    client = live["redis"].client()
    stored = [client.get(key) for key in client.scan_iter(match=keys.client_secret("*"))]
    assert stored and all(b"x" * 100 not in one and len(one) < 2000 for one in stored), stored


def test_live_audio_without_an_asr_backend_keeps_the_session(
        redis: procs.RedisServer, tmp_path: Path) -> None:
    """A gateway with no ASR backend still serves a session with transcription off: its
    audio is not priced (nothing to price it by), not an internal error closing it (1011)."""
    speech_only = {"xtts": {"tiny": "/nonexistent"}}  # no ASR backend's models at all
    service = procs.gateway(redis.url, tmp_path, models=speech_only).start()
    url = service.url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"

    async def run() -> list[str]:
        async with websockets.connect(url) as socket:
            seen = [json.loads(await socket.recv())["type"]]
            await socket.send(json.dumps({"type": "session.update", "session": {
                "type": "transcription", "audio": {"input": {"transcription": None}}}}))
            seen.append(json.loads(await socket.recv())["type"])
            chunk = base64.b64encode(bytes(2 * 2400)).decode()  # 100 ms of 24 kHz silence
            for _ in range(30):
                await socket.send(json.dumps({"type": "input_audio_buffer.append",
                                              "audio": chunk}))
            await socket.send(json.dumps({"type": "session.update", "session": {
                "type": "transcription"}}))
            while (kind := json.loads(await asyncio.wait_for(socket.recv(), 10))["type"]) \
                    != "session.updated":
                seen.append(kind)
            seen.append(kind)
            return seen

    try:
        seen = asyncio.run(run())
    finally:
        service.stop()
    assert seen[:2] == ["session.created", "session.updated"] and seen[-1] == "session.updated"
    assert "error" not in seen, seen
