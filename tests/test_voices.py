"""Custom voices with consent (issue 26) through the real openai SDK, against a real
redis-server, a keyed gateway and three workers: faster-whisper (tiny.en) checks the consent
phrase, voiceprint (Resemblyzer's bundled encoder) checks the sample's speaker, XTTS (the
tiny checkpoint) speaks with the voice. Speakers are espeak-ng voices: `en-us` consents and
gives its sample; `en-us+Annie` (voiceprint score ~0.68 against en-us, under the threshold
0.75: bench/voiceprint_threshold.py) is another person."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
import redis

from common import keys
from common.audio import decode_audio, encode_wav, probe_audio, wav_pcm
from common.settings import CONSENT_PHRASES, Settings
from common.words import negation
from gateway.auth import digest
from harness import procs
from harness.conversation import speak_to
from harness.http_client import http
from tests.audio_fakes import variable_flac
from tests.helpers import wait_done
from tests.test_tts_stream import Pause
from tests.tiny import env_python, tiny_model
from workers.engines.xtts import PAUSE_DIR_VARIABLE

KEY, OTHER = "voices-key-0123456789", "voices-other-0123456789"
AUTH = {"authorization": f"Bearer {KEY}"}
SAMPLE_TEXT = ("Please call Stella and ask her to bring these things with her from the store: "
               "six spoons of fresh snow peas and a snack for her brother Bob.")

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    xtts_python, voiceprint_python = env_python("xtts"), env_python("voiceprint")
    if not xtts_python.exists() or not voiceprint_python.exists():
        pytest.skip(".venvs/xtts or .venvs/voiceprint is missing (scripts/install.sh)")
    workdir = tmp_path_factory.mktemp("voices")
    server = procs.RedisServer(workdir / "redis").start()
    models = {"faster-whisper": {"tiny.en": "bundled"}, "xtts": {"tiny": str(tiny_model("xtts"))},
              "voiceprint": {"resemblyzer": "bundled"}}
    settings = {"models": models, "default_models": {"xtts": "tiny"}}
    services = [
        procs.gateway(server.url, workdir, api_keys=[digest(KEY), digest(OTHER)],
                      max_voices_per_key="2", max_consents_per_key="2", **settings),
        procs.worker(server.url, workdir, models=models, idle_unload_seconds="-1"),
        procs.worker(server.url, workdir, backend="voiceprint", python=voiceprint_python,
                     models=models, idle_unload_seconds="-1"),
        procs.worker(server.url, workdir, backend="xtts", python=xtts_python, models=models,
                     device="cpu", idle_unload_seconds="-1"),
    ]
    pause = Pause(workdir / "pause")  # the tiny XTTS engine's hook: see test_tts_stream
    services[3].env[PAUSE_DIR_VARIABLE] = str(pause.directory)
    clips = {"consent": ("en-us", CONSENT_PHRASES["en"]),
             "not-consent": ("en-us", "The quick brown fox jumps over the lazy dog."),
             "refusal": ("en-us", "I do not consent to my voice being recorded and used to "
                                  "create a synthetic voice."),
             "sample": ("en-us", SAMPLE_TEXT), "other-sample": ("en-us+Annie", SAMPLE_TEXT)}
    for name, (voice, text) in clips.items():
        speak_to(workdir / f"{name}.wav", text, voice)
    try:
        for service in services:
            service.start(wait=False)
        for service in services:
            procs.wait_until(service.healthy, 180, f"{service.args[-1]} health", 0.2)
        yield {"url": services[0].url, "workdir": workdir, "redis": server.url,
               "xtts": services[3], "pause": pause}
    finally:
        for service in reversed(services):
            service.stop()
        server.stop()


def client(stack: dict[str, Any], key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(api_key=key, base_url=f"{stack['url']}/v1", max_retries=0,
                         timeout=300)


def clip(stack: dict[str, Any], name: str) -> Path:
    return stack["workdir"] / f"{name}.wav"


def test_consent_voice_speech_and_ownership(stack: dict[str, Any]) -> None:
    sdk, other = client(stack), client(stack, OTHER)
    config = http.get(f"{stack['url']}/api/config", headers=AUTH)
    assert config.json()["consent_phrases"]["en"] == CONSENT_PHRASES["en"]

    # a consent must read the phrase of its language
    with clip(stack, "not-consent").open("rb") as recording, \
            pytest.raises(openai.BadRequestError) as refused:
        sdk.audio.voice_consents.create(name="fox", language="en-US", recording=recording)
    assert refused.value.code == "consent_phrase_mismatch", refused.value.body
    # … and not refuse it: one inserted "not" is within the word error allowed
    with clip(stack, "refusal").open("rb") as recording, \
            pytest.raises(openai.BadRequestError) as refused:
        sdk.audio.voice_consents.create(name="no", language="en-US", recording=recording)
    assert refused.value.code == "consent_phrase_mismatch", refused.value.body
    assert "refusal" in refused.value.message
    with clip(stack, "consent").open("rb") as recording:
        consent = sdk.audio.voice_consents.create(name="me", language="en-US",
                                                  recording=recording)
    assert consent.id.startswith("cons_") and consent.object == "audio.voice_consent"
    assert consent.language == "en-US" and consent.name == "me"
    assert sdk.audio.voice_consents.retrieve(consent.id).id == consent.id
    assert sdk.audio.voice_consents.update(consent.id, name="me, renamed").name == "me, renamed"
    assert [c.id for c in sdk.audio.voice_consents.list()] == [consent.id]

    # a sample must be the consenting speaker's
    with clip(stack, "other-sample").open("rb") as sample, \
            pytest.raises(openai.BadRequestError) as mismatch:
        sdk.audio.voices.create(name="not me", consent=consent.id, audio_sample=sample)
    assert mismatch.value.code == "voice_mismatch", mismatch.value.body
    # … every part of it: the consenting speaker's own recording, then the other voice,
    # scores above the threshold as a whole, and is refused by its parts
    mixed = encode_wav(np.concatenate([decode_audio(clip(stack, name), 16000)
                                       for name in ("consent", "other-sample")]),
                       16000)
    with pytest.raises(openai.BadRequestError) as partly:
        sdk.audio.voices.create(name="partly me", consent=consent.id,
                                audio_sample=("mixed.wav", mixed))
    assert partly.value.code == "voice_mismatch", partly.value.body
    assert "part of the sample" in str(partly.value.message), partly.value.body
    with clip(stack, "sample").open("rb") as sample:
        voice = sdk.audio.voices.create(name="my voice", consent=consent.id,
                                        audio_sample=sample)
    assert voice.id.startswith("voice_") and voice.object == "audio.voice"
    assert voice.type == "audio_sample" and voice.name == "my voice"
    listed = sdk.get("/audio/voices", cast_to=dict)
    assert [v["id"] for v in listed["data"]] == [voice.id] and not listed["has_more"]
    with pytest.raises(openai.BadRequestError) as cursor:  # no such voice, nor a place
        sdk.get("/audio/voices", cast_to=dict, options={"params": {"after": "voice_x"}})
    assert cursor.value.body["param"] == "after", cursor.value.body  # type: ignore[index]
    # durable: records, indexes and audio carry no TTL
    store = redis.Redis.from_url(stack["redis"])
    # kept as a 16-bit mono WAV at 24 kHz, whatever was uploaded (each speech task with
    # the voice carries a copy: a few MB at most, not the upload's 10 MiB)
    kept = store.get(keys.voice_audio(digest(KEY)[:16], voice.id))  # the key's owner id
    assert kept is not None and wav_pcm(kept)[1] == 24000
    stored = [*store.scan_iter("sg:voice*"), *store.scan_iter("sg:consent*")]
    assert len(stored) >= 6 and all(store.ttl(key) == -1 for key in stored), stored

    # speech with the voice: whole, streamed, and through the Sage submit
    spoken = sdk.audio.speech.create(model="tts-1", voice={"id": voice.id}, input="Hello there.",
                                     response_format="wav")
    assert probe_audio(spoken.read()).duration > 0.1
    with sdk.audio.speech.with_streaming_response.create(
            model="tts-1", voice={"id": voice.id}, input="Hello there.",
            response_format="pcm", stream_format="audio") as streamed:
        assert sum(len(chunk) for chunk in streamed.iter_bytes()) > 1000
    submitted = http.post(f"{stack['url']}/api/xtts-submit",
                           headers=AUTH,
                           data={"text": "Hello there.", "voice": voice.id}, timeout=60)
    assert submitted.status_code == 200, submitted.text
    state = wait_done(stack["url"], submitted.json()["taskid"], 300, headers=AUTH)
    assert state["status"] == "SUCCEEDED", state

    # another key sees none of it
    with pytest.raises(openai.NotFoundError):
        other.audio.voice_consents.retrieve(consent.id)
    with pytest.raises(openai.NotFoundError):
        other.audio.voices.delete(voice.id)
    with pytest.raises(openai.NotFoundError):
        other.audio.speech.create(model="tts-1", voice={"id": voice.id}, input="Hello.")
    assert other.get("/audio/voices", cast_to=dict)["data"] == []

    # the consenting speaker, but too little of the voice to check its every part (a short
    # window of someone else's speech could be chosen offline for its whole score)
    short = encode_wav(decode_audio(clip(stack, "sample"), 16000)[:int(3.5 * 16000)], 16000)
    with pytest.raises(openai.BadRequestError) as brief:
        sdk.audio.voices.create(name="brief", consent=consent.id,
                                audio_sample=("short.wav", short))
    assert brief.value.code == "invalid_audio" and brief.value.param == "audio_sample"
    assert "too little voice" in str(brief.value.message), brief.value.body

    # a file that tells the probe a fraction of its length is not decoded for its hours
    with pytest.raises(openai.BadRequestError) as lying:
        sdk.audio.voice_consents.create(name="long", language="en",
                                        recording=("long.flac", variable_flac(40, 300)))
    assert lying.value.code == "invalid_audio" and "more than 60 s" in str(lying.value.message)

    # a silent sample: a 400 that names the field (not the engine's own clip names)
    with pytest.raises(openai.BadRequestError) as silent:
        sdk.audio.voices.create(name="silent", consent=consent.id,
                                audio_sample=("silent.wav", encode_wav(np.zeros(32000), 16000)))
    assert silent.value.param == "audio_sample" and silent.value.code == "invalid_audio"
    assert "'file'" not in str(silent.value.message), silent.value.body

    # a task queued with the voice, which is deleted before a worker takes it: not spoken
    xtts = stack["xtts"]
    os.kill(xtts.pid, signal.SIGSTOP)  # (our own worker: it takes nothing meanwhile)
    try:
        queued = http.post(f"{stack['url']}/api/xtts-submit",
                           headers=AUTH,
                           data={"text": "Hello again.", "voice": voice.id}, timeout=60)
        assert queued.status_code == 200, queued.text
        task = store.hgetall(keys.task(queued.json()["taskid"]))
        assert json.loads(task[b"params"])["custom_voice"] == voice.id  # what spoke, on record
        assert sdk.audio.voices.delete(voice.id).deleted
    finally:
        os.kill(xtts.pid, signal.SIGCONT)
    state = wait_done(stack["url"], queued.json()["taskid"], 120, headers=AUTH)
    assert state["status"] == "FAILED" and "deleted" in state["error"], state
    with pytest.raises(openai.NotFoundError):
        sdk.audio.speech.create(model="tts-1", voice={"id": voice.id}, input="Hello.")
    with clip(stack, "sample").open("rb") as sample:
        voice = sdk.audio.voices.create(name="my voice", consent=consent.id,
                                        audio_sample=sample)

    # deleted: gone from the list, and speaks no more
    deleted = sdk.audio.voices.delete(voice.id)
    assert deleted.deleted and deleted.id == voice.id
    assert sdk.get("/audio/voices", cast_to=dict)["data"] == []
    with pytest.raises(openai.NotFoundError):
        sdk.audio.speech.create(model="tts-1", voice={"id": voice.id}, input="Hello.")
    assert sdk.audio.voice_consents.delete(consent.id).deleted
    with pytest.raises(openai.NotFoundError):
        sdk.audio.voice_consents.retrieve(consent.id)


def test_a_consent_withdrawn_while_its_voice_speaks_stops_the_speech(
        stack: dict[str, Any]) -> None:
    """A task already speaking with a custom voice when its consent is withdrawn speaks no
    further sentence: it FAILS with what it had spoken kept, not the rest of its text."""
    sdk = client(stack, OTHER)
    with clip(stack, "consent").open("rb") as recording:
        consent = sdk.audio.voice_consents.create(name="me", language="en", recording=recording)
    with clip(stack, "sample").open("rb") as sample:
        voice = sdk.audio.voices.create(name="mine", consent=consent.id, audio_sample=sample)
    store = redis.Redis.from_url(stack["redis"])
    pause: Pause = stack["pause"]
    pause.arm()  # the engine stops once its first sentence is stored
    try:
        submitted = http.post(f"{stack['url']}/api/xtts-submit",
                              headers={"authorization": f"Bearer {OTHER}"}, timeout=60,
                              data={"text": "The first sentence is here. A second one "
                                            "follows it. Then comes a third sentence.",
                                    "voice": voice.id})
        assert submitted.status_code == 200, submitted.text
        task_id = submitted.json()["taskid"]
        assert pause.wait(store) == task_id
        assert sdk.audio.voice_consents.delete(consent.id).deleted
    finally:
        pause.release()
    state = wait_done(stack["url"], task_id, 120,
                      headers={"authorization": f"Bearer {OTHER}"})
    assert state["status"] == "FAILED" and "withdrawn" in state["error"], state
    assert store.xlen(keys.speech_chunks(task_id)) == 1  # the one spoken before


def test_limits_of_samples_and_voices_per_key(stack: dict[str, Any]) -> None:
    """A sample over 30 s, or a consent recording over 60 s, is refused; past
    SPEECH_MAX_VOICES_PER_KEY (2 here) a voice is refused, until one is deleted, and past
    SPEECH_MAX_CONSENTS_PER_KEY (2) a consent."""
    sdk = client(stack)
    with clip(stack, "consent").open("rb") as recording:
        consent = sdk.audio.voice_consents.create(name="me", language="en", recording=recording)
    sample = decode_audio(clip(stack, "sample"), 16000)
    long = encode_wav(np.concatenate([sample] * (31 * 16000 // len(sample) + 1)), 16000)
    with pytest.raises(openai.BadRequestError) as too_long:
        sdk.audio.voices.create(name="long", consent=consent.id, audio_sample=("l.wav", long))
    assert too_long.value.param == "audio_sample" and "30 s" in str(too_long.value.message)
    longer = encode_wav(np.concatenate([sample] * (61 * 16000 // len(sample) + 1)), 16000)
    with pytest.raises(openai.BadRequestError) as rambling:
        sdk.audio.voice_consents.create(name="me", language="en", recording=("r.wav", longer))
    assert rambling.value.param == "recording" and "60 s" in str(rambling.value.message)
    # a tag its consent phrase's language matches, but longer than any tag in use
    with clip(stack, "consent").open("rb") as recording, \
            pytest.raises(openai.BadRequestError) as tagged:
        sdk.audio.voice_consents.create(name="me", language="en-" + "-".join(["abcdefgh"] * 9),
                                        recording=recording)
    assert tagged.value.param == "language", tagged.value.body
    # past SPEECH_MAX_CONSENTS_PER_KEY (2 here) a consent is refused before its check runs
    with clip(stack, "consent").open("rb") as recording:
        second = sdk.audio.voice_consents.create(name="again", language="en",
                                                 recording=recording)
    with clip(stack, "consent").open("rb") as recording, \
            pytest.raises(openai.BadRequestError) as crowded:
        sdk.audio.voice_consents.create(name="third", language="en", recording=recording)
    assert crowded.value.code == "too_many_consents", crowded.value.body
    assert sdk.audio.voice_consents.delete(second.id).deleted
    made = []
    for name in ("one", "two"):
        with clip(stack, "sample").open("rb") as audio:
            made.append(sdk.audio.voices.create(name=name, consent=consent.id,
                                                audio_sample=audio))
    with clip(stack, "sample").open("rb") as audio, \
            pytest.raises(openai.BadRequestError) as full:
        sdk.audio.voices.create(name="three", consent=consent.id, audio_sample=audio)
    assert full.value.code == "too_many_voices"
    # withdrawing the consent deletes its voices
    assert sdk.audio.voice_consents.delete(consent.id).deleted
    assert sdk.get("/audio/voices", cast_to=dict)["data"] == []
    with pytest.raises(openai.NotFoundError):
        sdk.audio.speech.create(model="tts-1", voice={"id": made[0].id}, input="Hello.")


def test_a_refusal_is_no_consent_in_any_shipped_language() -> None:
    """Word error alone passes "I do not consent …" (one inserted word): a negating word the
    phrase lacks refuses it, in every language shipped; the phrase itself passes."""
    refusals = {
        "en-US": "I do not consent to my voice being recorded and used to create a synthetic "
                 "voice.",
        "en": "I don't consent to my voice being recorded and used to create a synthetic voice.",
        "en-GB": "I don\u2019t consent to my voice being recorded and used to create a "
                 "synthetic voice.",  # a typographic apostrophe, as ASR may write it
        "de": "Ich bin nicht damit einverstanden, dass meine Stimme aufgenommen und für eine "
              "synthetische Stimme verwendet wird.",
        "fr": "Je n'accepte pas que ma voix soit enregistrée et utilisée pour créer une voix "
              "synthétique.",
        "es": "No doy mi consentimiento para que mi voz sea grabada y utilizada para crear una "
              "voz sintética."}
    for language, refusal in refusals.items():
        phrase = CONSENT_PHRASES[language[:2]]
        assert negation(phrase, refusal, language) is not None, language
        assert negation(phrase, phrase, language) is None, language
    assert negation("Ich sage es nicht anders.", "Ich sage es nicht anders.", "de") is None
    assert negation("I consent.", "I do not consent.", "xx") is None  # no list: word error
    with pytest.raises(ValueError, match="fewer than"):
        Settings(consent_phrases={"en": "..."})
