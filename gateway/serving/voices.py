"""Custom voices with consent, in OpenAI's shapes: `/v1/audio/voice_consents` and
`/v1/audio/voices`.

A consent is a recording of the speaker reading the consent phrase of its language
(SPEECH_CONSENT_PHRASES): its transcript, through the default ASR backend as an ordinary
task of the caller's, must be within SPEECH_CONSENT_MAX_WER of the phrase. A voice is a
sample (at most 30 s, 10 MiB) under a consent: the voiceprint backend's score between the
sample and the consent recording must reach SPEECH_VOICE_MATCH_THRESHOLD. What each check
found is stored with the object, for audit. Both belong to the key that made them: any other
key gets a 404. `voice: {"id": "voice_…"}` then speaks with the sample as XTTS's reference.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import Request

from common import clips
from common.audio import (
    AudioError,
    AudioInfo,
    AudioTooLong,
    decode_audio,
    encode_wav,
    probe_audio,
)
from common.catalog import (
    BACKENDS,
    UnknownBackend,
    UnknownModel,
    asr_language,
    backend_info,
    resolve_public_model,
)
from common.schemas import INTERACTIVE, TaskState
from common.settings import Settings
from common.store.voices import CONSENTS, VOICES, Kind, UnknownCursor, VoiceStore, new_id
from common.words import negation, wer
from gateway.errors import RequestError
from gateway.serving.calls import Disconnected, SyncCalls, task_failed
from gateway.submit.audio import AudioInput
from gateway.submit.enqueue import guard_store
from gateway.submit.inputs import Params, read_params, read_upload
from gateway.submit.terms import SubmitTerms

MAX_SAMPLE_SECONDS = 30.0
#: the fewest 3 s parts (every 1.5 s) of a sample's voice the check must score: with fewer,
#: the part check barely differs from the whole's, and a short window of another person's
#: speech chosen offline for its score (the encoder is public) could pass as the speaker's
MIN_SAMPLE_PARTS = 3
#: the rates clips are kept at: a consent's is read by ASR and the voiceprint (16 kHz), a
#: sample's by the speech engine too (XTTS speaks at 24 kHz)
CONSENT_RATE, SAMPLE_RATE = 16000, 24000
#: a consent recording says one phrase: longer than this is not one, and is not transcribed
MAX_CONSENT_SECONDS = 60.0
MAX_AUDIO_BYTES = 10 * 1024 * 1024
#: a consent's or a voice's whole request: its one clip and the form around it (the routes'
#: body limit: gateway/app.py, so a 200 MiB body is refused as it arrives, not read first)
MAX_BODY_BYTES = MAX_AUDIO_BYTES + 1024 * 1024
MAX_NAME_CHARACTERS = 256
#: the longest language tag a consent keeps (BCP 47 tags in use stay well under it)
MAX_LANGUAGE_TAG = 35
VOICEPRINT = "voiceprint"
VOICE_PREFIX = "voice_"
CONSENT_FIELDS = ("id", "object", "name", "language", "created_at")
VOICE_FIELDS = ("id", "object", "name", "type", "created_at")


def consent_phrase(settings: Settings, language: str) -> str | None:
    """The phrase for a BCP 47 tag: the tag itself, else its base language ("en-US" -> "en")."""
    phrases = {tag.lower(): phrase for tag, phrase in settings.consent_phrases.items()}
    tag = language.strip().lower().replace("_", "-")
    return phrases.get(tag) or phrases.get(tag.split("-", 1)[0])


class VoiceServing:
    def __init__(self, calls: SyncCalls) -> None:
        self.calls = calls
        self.settings = calls.settings
        self.voices = VoiceStore.of(calls.store)

    # --- consents ------------------------------------------------------------------------------

    async def create_consent(self, request: Request, owner: str) -> dict[str, Any]:
        params = await read_params(request)
        name = _name(params)
        language = params.get("language")
        if not language:
            raise RequestError(400, "missing 'language' (a BCP 47 tag such as en-US)",
                               param="language")
        if len(language) > MAX_LANGUAGE_TAG:  # kept on the record, shown in every list
            raise RequestError(400, f"language must be a BCP 47 tag of at most "
                                    f"{MAX_LANGUAGE_TAG} characters", param="language")
        phrase = consent_phrase(self.settings, language)
        if phrase is None:
            raise RequestError(400, f"no consent phrase for language {language[:20]!r}; "
                                    f"configured: {', '.join(self.settings.consent_phrases)}",
                               param="language", code="unsupported_language")
        most = self.settings.max_consents_per_key
        if await guard_store(self.voices.count(CONSENTS, owner)) >= most:
            raise _too_many(CONSENTS, most)
        audio, info = await _audio(params, "recording", CONSENT_RATE, MAX_CONSENT_SECONDS)
        if info.duration > MAX_CONSENT_SECONDS:
            raise RequestError(400, f"the recording lasts {info.duration:.1f} s; a consent "
                                    f"recording says its phrase in at most "
                                    f"{MAX_CONSENT_SECONDS:.0f} s", param="recording")
        transcript = await self._transcribe(request, owner, audio, info, language)
        error = wer(phrase, transcript)
        if word := negation(phrase, transcript, language):
            raise RequestError(400, f"the consent check failed: the recording says "
                                    f"{transcript.strip()[:200]!r}, which {word!r} makes a "
                                    f"refusal of the consent phrase {phrase!r}",
                               param="recording", code="consent_phrase_mismatch")
        if error > self.settings.consent_max_wer:
            raise RequestError(400, f"the consent check failed: the recording says "
                                    f"{transcript.strip()[:200]!r}, not the consent phrase "
                                    f"{phrase!r} (word error {error:.2f}; at most "
                                    f"{self.settings.consent_max_wer:.2f})", param="recording",
                               code="consent_phrase_mismatch")
        record = {"id": new_id("cons"), "object": "audio.voice_consent", "name": name,
                  "language": language, "created_at": int(time.time()),
                  "check": {"phrase": phrase, "transcript": transcript,
                            "word_error": round(error, 3), "seconds": round(info.duration, 3)}}
        if not await guard_store(self.voices.create(CONSENTS, owner, record, audio, most)):
            raise _too_many(CONSENTS, most)
        return _public(record, CONSENT_FIELDS)

    async def retrieve_consent(self, owner: str, consent_id: str) -> dict[str, Any]:
        return _public(await self._get(CONSENTS, owner, consent_id), CONSENT_FIELDS)

    async def update_consent(self, request: Request, owner: str,
                             consent_id: str) -> dict[str, Any]:
        name = _name(await read_params(request))
        record = await guard_store(self.voices.update(CONSENTS, owner, consent_id, name=name))
        if record is None:
            raise _not_found(CONSENTS, consent_id)
        return _public(record, CONSENT_FIELDS)

    async def delete_consent(self, owner: str, consent_id: str) -> dict[str, Any]:
        """The consent, then every voice made under it (VoiceStore.withdraw): withdrawn
        consent speaks no more. A retry after a failure part way, or the sweeper, removes
        what is left (a 404 only when there was nothing to remove)."""
        if not await guard_store(self.voices.withdraw(owner, consent_id)):
            raise _not_found(CONSENTS, consent_id)
        return {"id": consent_id, "object": "audio.voice_consent", "deleted": True}

    async def list(self, kind: Kind, owner: str, after: str | None,
                   limit: int) -> dict[str, Any]:
        if not 1 <= limit <= 100:
            raise RequestError(400, "limit must be from 1 to 100", param="limit")
        try:
            page = await guard_store(self.voices.list(kind, owner, after, limit))
        except UnknownCursor:
            what = "consent" if kind is CONSENTS else "voice"
            raise RequestError(400, f"'after' names no {what} of this key's, nor a place in "
                                    "the list (list again from the start)",
                               param="after") from None
        fields = CONSENT_FIELDS if kind is CONSENTS else VOICE_FIELDS
        data = [_public(item, fields) for item in page.items]
        return {"object": "list", "data": data, "has_more": page.has_more,
                "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None}

    # --- voices --------------------------------------------------------------------------------

    async def create_voice(self, request: Request, owner: str) -> dict[str, Any]:
        params = await read_params(request)
        if (params.get("type") or "audio_sample") != "audio_sample":
            raise RequestError(400, "only audio_sample voices are made here (type 'prompt' "
                                    "needs a voice-design model)", param="type")
        name = _name(params)
        consent_id = params.get("consent")
        if not consent_id:
            raise RequestError(400, "missing 'consent': the id of the speaker's consent "
                                    "recording (POST /v1/audio/voice_consents)", param="consent")
        consent = await self._get(CONSENTS, owner, consent_id, param="consent")
        most = self.settings.max_voices_per_key
        if await guard_store(self.voices.count(VOICES, owner)) >= most:
            raise _too_many(VOICES, most)
        sample, info = await _audio(params, "audio_sample", SAMPLE_RATE, MAX_SAMPLE_SECONDS)
        if info.duration > MAX_SAMPLE_SECONDS:
            raise RequestError(400, f"the sample lasts {info.duration:.1f} s; at most "
                                    f"{MAX_SAMPLE_SECONDS:.0f} s", param="audio_sample")
        if (shortest := _min_reference_seconds(self.settings)) > info.duration:
            raise RequestError(400, f"the sample lasts {info.duration:.1f} s; the speech "
                                    f"backend needs at least {shortest} s", param="audio_sample")
        recording = await guard_store(self.voices.audio(owner, consent_id))
        if recording is None:
            raise _not_found(CONSENTS, consent_id, "consent")
        score, lowest, parts = await self._match(request, owner, sample, recording, info)
        if parts < MIN_SAMPLE_PARTS:
            raise RequestError(400, "the sample holds too little voice to check every part "
                                    "of it: more than 4.5 s of speech (silences cut) is needed, "
                                    "and 6-30 s clones best", param="audio_sample",
                               code="invalid_audio")
        threshold = self.settings.voice_match_threshold
        part_threshold = self.settings.voice_match_part_threshold
        if score < threshold:
            raise RequestError(400, f"the voice check failed: the sample's speaker does not "
                                    f"match the consent recording's (voiceprint score "
                                    f"{score:.2f}; at least {threshold:.2f})",
                               param="audio_sample", code="voice_mismatch")
        if lowest < part_threshold:
            raise RequestError(400, "the voice check failed: part of the sample is not the "
                                    "consent recording's speaker (every part of a sample must "
                                    "be the consenting speaker alone)",
                               param="audio_sample", code="voice_mismatch")
        record = {"id": new_id(VOICE_PREFIX.rstrip("_")), "object": "audio.voice", "name": name,
                  "type": "audio_sample", "created_at": int(time.time()), "consent": consent_id,
                  "check": {"score": round(score, 4), "threshold": threshold,
                            "lowest_part_score": round(lowest, 4), "parts": parts,
                            "part_threshold": part_threshold,
                            "seconds": round(info.duration, 3)},
                  "consent_check": consent.get("check")}
        stored = await guard_store(self.voices.create(VOICES, owner, record, sample, most,
                                                      consent=consent_id))
        if stored == -1:  # withdrawn while the voice was checked: no voice without it
            raise _not_found(CONSENTS, consent_id, "consent")
        if stored == 0:
            raise _too_many(VOICES, most)
        return _public(record, VOICE_FIELDS)

    async def retrieve_voice(self, owner: str, voice_id: str) -> dict[str, Any]:
        return _public(await self._get(VOICES, owner, voice_id), VOICE_FIELDS)

    async def delete_voice(self, owner: str, voice_id: str) -> dict[str, Any]:
        if not await guard_store(self.voices.delete(VOICES, owner, voice_id)):
            raise _not_found(VOICES, voice_id)
        return {"id": voice_id, "object": "audio.voice.deleted", "deleted": True}

    # --- the checks, as internal tasks of the caller -------------------------------------------

    async def _transcribe(self, request: Request, owner: str, audio: bytes, info: AudioInfo,
                          language: str) -> str:
        try:
            backend, model = resolve_public_model(self.settings, "whisper-1", "asr")
        except (UnknownModel, UnknownBackend):
            raise RequestError(503, "no ASR backend is enabled to check the consent phrase",
                               code="backend_unavailable") from None
        options: dict[str, Any] = {"task": "transcribe", "word_timestamps": False}
        try:
            if (code := asr_language(backend, language)) is not None:
                options["language"] = code
        except ValueError as exc:
            raise RequestError(400, f"the consent phrase cannot be checked: {exc}",
                               param="language", code="unsupported_language") from None
        result = await self._run(request, owner, backend, model, options,
                                 AudioInput(audio, None, info))
        return str(result.get("text", ""))

    async def _match(self, request: Request, owner: str, sample: bytes, recording: bytes,
                     info: AudioInfo) -> tuple[float, float, int]:
        """The sample's voiceprint score against the recording, its lowest part's, and how
        many parts were scored."""
        try:
            backend_info(self.settings, VOICEPRINT)
        except UnknownBackend:
            raise RequestError(503, "the voiceprint backend is not enabled: a sample cannot be "
                                    "checked against its consent", code="backend_unavailable"
                               ) from None
        model = self.settings.voice_match_model
        options = {"threshold": self.settings.voice_match_threshold}
        blob = clips.pack({"file": sample, "reference": recording})
        try:
            result = await self._run(request, owner, VOICEPRINT, model, options,
                                     AudioInput(blob, None, info))
        except RequestError as refused:
            if refused.status_code != 400 or not any(
                    f"the {clip!r} clip" in refused.message for clip in ("file", "reference")):
                raise
            # the engine found no voice to score in a clip (silent, too short): say which
            message = (refused.message.replace("the 'file' clip", "the sample")
                       .replace("the 'reference' clip", "the consent recording"))
            raise RequestError(400, f"the voice check could not score it: {message}",
                               param="audio_sample", code="invalid_audio") from None
        if "lowest_part_score" not in result:  # a voiceprint worker older than this gateway
            raise RequestError(503, "the voiceprint worker does not score a sample's parts: "
                                    "upgrade it to this gateway's version",
                               code="backend_unavailable")
        return (float(result["score"]), float(result["lowest_part_score"]),
                int(result.get("parts", 0)))

    async def _run(self, request: Request, owner: str, backend: str, model: str,
                   options: dict[str, Any], audio: AudioInput) -> dict[str, Any]:
        call = await self.calls.start(backend=backend, model=model, options=options,
                                      audio=audio, owner=owner,
                                      terms=SubmitTerms(lane=INTERACTIVE))
        finished = await call.outcome(request)
        if isinstance(finished, Disconnected):
            raise RequestError(499, "the client left during the check")
        if finished.state != TaskState.SUCCEEDED or finished.result is None:
            raise task_failed(finished)
        return finished.result

    async def _get(self, kind: Kind, owner: str, object_id: str,
                   param: str | None = None) -> dict[str, Any]:
        record = await guard_store(self.voices.get(kind, owner, object_id))
        if record is None:
            raise _not_found(kind, object_id, param)
        return record


async def use_custom_voice(params: Params, owner: str, voices: VoiceStore) -> None:
    """`voice` naming one of the caller's custom voices ("voice_…", or `{"id": …}` in JSON):
    its sample becomes the speech task's reference clip; a 404 if the caller has no such
    voice (another key's voice included)."""
    voice = params.get("voice")
    if not voice or not voice.startswith(VOICE_PREFIX):
        return
    if params.upload("speaker_wav") is not None or params.get("speaker_wav"):
        raise RequestError(400, "give either 'voice' or 'speaker_wav', not both", param="voice")
    record = await guard_store(voices.get(VOICES, owner, voice))
    if record is not None and await guard_store(
            voices.get(CONSENTS, owner, str(record.get("consent")))) is None:
        record = None  # its consent was withdrawn: it speaks no more
    sample = None if record is None else await guard_store(voices.audio(owner, voice))
    if sample is None:
        raise RequestError(404, f"no voice {voice[:80]!r} for this key", param="voice",
                           code="voice_not_found")
    params.voice_sample = sample
    params.custom_voice = (voice, str(record["consent"]))
    params.override("voice", None)


async def _audio(params: Params, name: str, rate: int,
                 most_seconds: float) -> tuple[bytes, AudioInfo]:
    """The upload as it is checked and kept: a 16-bit mono WAV at `rate`, decoded up to
    `most_seconds` (a file that tells the probe less is refused, not decoded for hours),
    and its length as decoded. One the probe finds longer comes back as it is, for the
    caller to refuse by its length. Kept so, a stored clip is at most a few MB whatever was
    uploaded (every speech task with a custom voice carries a copy of its sample)."""
    upload = params.upload(name)
    if upload is None:
        raise RequestError(400, f"missing '{name}': upload the audio under that name",
                           param=name)
    audio = read_upload(upload, MAX_AUDIO_BYTES, name)
    try:
        info = await asyncio.to_thread(probe_audio, audio)
        if info.duration > most_seconds:
            return audio, info
        samples = await asyncio.to_thread(decode_audio, audio, rate, most_seconds)
    except AudioTooLong:
        raise RequestError(400, f"the '{name}' audio holds more than {most_seconds:.0f} s "
                                "(its file tells less)", param=name,
                           code="invalid_audio") from None
    except AudioError as exc:
        raise RequestError(400, f"the '{name}' audio is unusable: {exc}", param=name,
                           code="invalid_audio") from None
    return encode_wav(samples, rate), AudioInfo(round(len(samples) / rate, 3), rate, 1,
                                                "pcm_s16le")


def _min_reference_seconds(settings: Settings) -> float:
    try:
        backend, _ = resolve_public_model(settings, "tts-1", "tts")
    except (UnknownModel, UnknownBackend):
        return 0.0
    return BACKENDS[backend].min_reference_seconds


def _name(params: Params) -> str:
    name = (params.get("name") or "").strip()
    if not name or len(name) > MAX_NAME_CHARACTERS:
        raise RequestError(400, f"'name' must be 1 to {MAX_NAME_CHARACTERS} characters",
                           param="name")
    return name


def _public(record: dict[str, Any], fields: tuple[str, ...]) -> dict[str, Any]:
    return {name: record[name] for name in fields}


def _too_many(kind: Kind, most: int) -> RequestError:
    what = "consents" if kind is CONSENTS else "voices"
    return RequestError(400, f"this key has {most} {what} already, the most it may keep: "
                             "delete one first", code=f"too_many_{what}")


def _not_found(kind: Kind, object_id: str, param: str | None = None) -> RequestError:
    """404 for an id of `kind` the caller has not; `param`: the field that named it (the
    path's id by default)."""
    what, path = ("consent", "consent_id") if kind is CONSENTS else ("voice", "voice_id")
    return RequestError(404, f"no {what} {object_id[:80]!r} for this key", param=param or path,
                        code=f"{what}_not_found")
