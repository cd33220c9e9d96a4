"""Speaker diarization (issue 15): a real gateway and faster-whisper worker with the bundled
diarizer (silero-vad + Resemblyzer, weights from their PyPI packages) on a two-voice
espeak-ng conversation (harness/conversation.py), through Sage, REST and the OpenAI SDK.

The worker here unloads after 3 idle seconds, so the last tests can see the diarizer go with
the model and its memory come back.
"""

from __future__ import annotations

import base64
import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import openai
import psutil
import pytest

from common.audio import decode_audio, encode_wav
from common.backends import BACKENDS
from common.schemas import DiarizationOptions, Segment, Transcription, Word
from common.settings import Settings
from harness import conversation, diarization_set, procs
from harness.http_client import http
from harness.procs import TEST_AUDIO
from tests.helpers import (
    queue_counts,
    settled_idle,
    submit_file,
    wait_done,
    wait_sampling_loaded,
)
from tests.tiny import env_python, tiny_model
from workers.diarize import Diarization, Diarizer, Turn, attach, der, own_speakers

pytestmark = pytest.mark.timeout(600)
IDLE_UNLOAD_SECONDS = 3
#: the ASR backends besides faster-whisper that run the worker's diarizer: their environments
OTHER_BACKENDS = {name: row.env for name, row in BACKENDS.items()
                  if row.kind == "asr" and row.diarization and not row.speakers
                  and row.env != "core"}


@pytest.fixture(scope="module")
def clips(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("diarization")
    talk = root / "conversation.wav"
    turns = conversation.build(talk)
    single = root / "single.wav"
    conversation.build(single, tuple(("alice", text) for _, text in conversation.TURNS[:4]))
    short = root / "short.wav"
    short.write_bytes(encode_wav(conversation.speak("en-us", "Hi.")[:16000], 16000))
    garbage = root / "garbage.wav"
    garbage.write_bytes(b"RIFF\x00\x00\x00\x00WAVEnothing here at all" * 10)
    references = {name: conversation.reference_clip(root / f"{name}.wav", name)
                  for name in conversation.VOICES}
    return {"root": root, "talk": talk, "turns": turns, "single": single, "short": short,
            "garbage": garbage, "references": references}


@pytest.fixture(scope="module")
def service(workdir: Path, clips: dict) -> Iterator[dict]:
    redis = procs.RedisServer(workdir / "redis-diarization").start()
    roots = [str(TEST_AUDIO), str(clips["root"])]
    # xtts is configured on the gateway only: a TTS backend to refuse `diarize` for
    models = {"faster-whisper": {"tiny.en": "bundled"}, "xtts": {"tiny": "/nonexistent"}}
    others = [b for b, env in OTHER_BACKENDS.items() if env_python(env).exists()]
    for backend in others:  # their tiny checkpoints, in their own environments
        models[backend] = {"tiny": str(tiny_model(backend))}
    gateway = procs.gateway(redis.url, workdir, allowed_roots=roots, models=models).start()
    workers = [procs.worker(redis.url, workdir, allowed_roots=roots,
                            idle_unload_seconds=str(IDLE_UNLOAD_SECONDS)).start()]
    for backend in others:
        workers.append(procs.worker(redis.url, workdir, backend=backend,
                                    python=env_python(OTHER_BACKENDS[backend]),
                                    allowed_roots=roots, models=models,
                                    parakeet_window_seconds="20",
                                    parakeet_warmup_seconds=[1]).start())
    yield {"gateway": gateway.url, "worker": workers[0].url, "redis": redis.client(),
           "others": others}
    for worker in workers:
        worker.stop()
    gateway.stop()
    redis.stop()


def voice_of(turns: list[conversation.RefTurn], start: float, end: float) -> str:
    """The reference turn a stretch of time falls in most."""
    return max(turns, key=lambda t: min(end, t.end) - max(start, t.start)).speaker


def diarized(base: str, path: Path, **params: object) -> dict:
    reply = submit_file(base, path, diarize="true", **params)
    assert reply.status_code == 200, reply.text
    final = wait_done(base, reply.json()["taskid"], timeout=240)
    assert final["status"] == "SUCCEEDED", final
    return final["result"]


def assert_matches_turns(result: dict, turns: list[conversation.RefTurn]) -> dict[str, str]:
    """Every segment's speaker is its turn's voice, under one label-to-voice mapping."""
    mapping: dict[str, str] = {}
    for segment in result["segments"]:
        voice = voice_of(turns, segment["start"], segment["end"])
        assert mapping.setdefault(segment["speaker"], voice) == voice, (segment, mapping)
    assert sorted(mapping.values()) == sorted(conversation.VOICES)
    return mapping


# --- pure functions --------------------------------------------------------------------------

def test_der() -> None:
    ref = [Turn(0.0, 4.0, "a"), Turn(5.0, 9.0, "b")]
    assert der(ref, ref) == 0.0
    assert der(ref, [Turn(0.0, 4.0, "x"), Turn(5.0, 9.0, "y")]) == 0.0  # labels are mapped
    assert der(ref, [], collar=0.0) == 1.0  # all missed
    assert der(ref, [Turn(0.0, 4.0, "x"), Turn(5.0, 9.0, "x")], collar=0.0) == \
        pytest.approx(0.5, abs=0.01)  # one speaker for two: half confused
    assert der(ref, [Turn(0.0, 5.0, "x"), Turn(5.0, 9.0, "y")], collar=0.0) == \
        pytest.approx(0.125, abs=0.01)  # one second of false alarm in eight


def test_a_few_windows_cut_off_one_voice_rejoin_it() -> None:
    """merge_small: a small found speaker goes back to its nearest one unless the two are
    unlike; a small one of its own voice stays, as does the lower bound on the count."""
    import numpy as np

    from workers import speaker_clusters

    rng = np.random.default_rng(4)
    centres = rng.normal(size=(3, 32))
    windows = np.stack([centres[v] + rng.normal(scale=0.1, size=32)
                        for v, n in ((0, 10), (1, 10), (2, 3)) for _ in range(n)])
    windows /= np.linalg.norm(windows, axis=1, keepdims=True)
    cut = np.r_[np.zeros(7), np.full(3, 2), np.ones(10)].astype(int)  # voice 0 in two
    merged = speaker_clusters.merge_small(windows[:20], cut, 1)
    assert merged.max() == 1 and len(set(merged[:10])) == 1 and merged[0] != merged[10]
    assert speaker_clusters.merge_small(windows[:20], cut, 3).max() == 2
    found = np.r_[np.zeros(10), np.ones(10), np.full(3, 2)].astype(int)  # a third voice
    assert (speaker_clusters.merge_small(windows, found, 1) == found).all()


def test_a_segment_that_changes_speaker_is_split_at_the_word_boundary() -> None:
    words = [Word(" Hello", 0.0, 0.5), Word(" there.", 0.5, 1.0), Word(" Hi", 1.6, 2.0),
             Word(" back.", 2.0, 2.4)]
    transcription = Transcription(" Hello there. Hi back.", "en", 3.0, [
        Segment(0, 0.0, 2.4, " Hello there. Hi back.", words=words, tokens=[1, 2])])
    turns = [Turn(0.0, 1.1, "SPEAKER_00"), Turn(1.5, 2.5, "SPEAKER_01")]
    attach(transcription, Diarization(turns, ["SPEAKER_00", "SPEAKER_01"]))
    assert [(s.id, s.start, s.end, s.text, s.speaker) for s in transcription.segments] == [
        (0, 0.0, 1.0, " Hello there.", "SPEAKER_00"), (1, 1.6, 2.4, " Hi back.", "SPEAKER_01")]
    assert [w.speaker for s in transcription.segments for w in s.words or []] == [
        "SPEAKER_00", "SPEAKER_00", "SPEAKER_01", "SPEAKER_01"]
    assert transcription.speakers == {"SPEAKER_00": {"seconds": 1.1, "segments": 1},
                                      "SPEAKER_01": {"seconds": 1.0, "segments": 1}}
    # words that carry no spaces of their own (Parakeet's) keep one between them
    words = [Word("good", 0.0, 0.4), Word("morning", 0.4, 0.9), Word("to", 1.6, 1.8),
             Word("you", 1.8, 2.2)]
    spaced = Transcription("good morning to you", "en", 3.0, [
        Segment(0, 0.0, 2.2, "good morning to you", words=words)])
    attach(spaced, Diarization(turns, ["SPEAKER_00", "SPEAKER_01"]))
    assert [s.text for s in spaced.segments] == ["good morning", "to you"]
    # Chinese (Whisper's words carry no space, and the text has none): none is added
    words = [Word("你", 0.0, 0.4), Word("好", 0.4, 0.9), Word("世", 1.6, 1.8),
             Word("界", 1.8, 2.2)]
    unspaced = Transcription("你好世界", "zh", 3.0, [Segment(0, 0.0, 2.2, "你好世界",
                                                              words=words)])
    attach(unspaced, Diarization(turns, ["SPEAKER_00", "SPEAKER_01"]))
    assert [s.text for s in unspaced.segments] == ["你好", "世界"]


def test_labels_follow_first_appearance_on_the_segments() -> None:
    """One long segment (qwen3 gives one a clip) under a short turn of one voice and a long
    one of another: it is the second voice's, and so that voice is SPEAKER_00 on segments,
    words and in `speakers` (it was SPEAKER_01, with no SPEAKER_00 on any segment); the voice
    no segment took comes after it. A known name keeps its name."""
    turns = [Turn(0.0, 1.0, "SPEAKER_00"), Turn(1.0, 9.0, "SPEAKER_01")]
    one = Transcription("long", "en", 9.0, [Segment(0, 0.0, 9.0, " long")])
    attach(one, Diarization(turns, ["SPEAKER_00", "SPEAKER_01"]))
    assert one.segments[0].speaker == "SPEAKER_00"
    assert list(one.speakers or {}) == ["SPEAKER_00", "SPEAKER_01"]
    assert one.speakers == {"SPEAKER_00": {"seconds": 8.0, "segments": 1},
                            "SPEAKER_01": {"seconds": 1.0, "segments": 0}}
    words = [Word(" a", 0.2, 0.6), Word(" b", 1.5, 2.0), Word(" c", 3.0, 3.5)]
    turns = [Turn(0.0, 1.0, "SPEAKER_01"), Turn(1.0, 2.5, "Ada"),
             Turn(2.5, 4.0, "SPEAKER_00")]
    named = Transcription(" a b c", "en", 4.0, [Segment(0, 0.0, 3.5, " a b c", words=words)])
    attach(named, Diarization(turns, ["SPEAKER_01", "Ada", "SPEAKER_00"]))
    assert [(s.text, s.speaker) for s in named.segments] == [
        (" a", "SPEAKER_00"), (" b", "Ada"), (" c", "SPEAKER_01")]
    assert [w.speaker for s in named.segments for w in s.words or []] == [
        "SPEAKER_00", "Ada", "SPEAKER_01"]
    assert list(named.speakers or {}) == ["SPEAKER_00", "Ada", "SPEAKER_01"]


def test_an_engines_own_speakers_take_the_same_labels() -> None:
    transcription = Transcription("a b c", "en", 3.0, [
        Segment(0, 0.0, 1.0, "a", speaker="1"), Segment(1, 1.0, 2.0, "b", speaker="0"),
        Segment(2, 2.0, 3.0, "c", speaker="1")])
    own_speakers(transcription)
    assert [s.speaker for s in transcription.segments] == ["SPEAKER_00", "SPEAKER_01",
                                                           "SPEAKER_00"]
    assert transcription.speakers == {"SPEAKER_00": {"seconds": 2.0, "segments": 2},
                                      "SPEAKER_01": {"seconds": 1.0, "segments": 1}}
    # an id that looks like a label is relabelled too: two speakers stay two
    mixed = Transcription("a b c", "en", 3.0, [
        Segment(0, 0.0, 1.0, "a", speaker="1"), Segment(1, 1.0, 2.0, "b", speaker="SPEAKER_00"),
        Segment(2, 2.0, 3.0, "c", speaker="1")])
    own_speakers(mixed)
    assert [s.speaker for s in mixed.segments] == ["SPEAKER_00", "SPEAKER_01", "SPEAKER_00"]


def test_an_unusable_diarizer_source_fails_only_the_task_that_asks() -> None:
    from common.settings import Settings
    from workers.engines.faster_whisper import FasterWhisperEngine
    from workers.models import ModelSlot

    engine = FasterWhisperEngine(Settings(_env_file=None))  # type: ignore[call-arg]
    for source, why in (("/models/pyannote", r"is not supported: 'bundled'"),
                        ("pyannote:/nonexistent", r"holds no pyannote pipeline")):
        slot = ModelSlot(engine, "cpu", {"tiny.en": "bundled"}, Diarizer(source))
        with pytest.raises(KeyError, match=why):
            slot.acquire("tiny.en", diarize=True)
        assert slot.loaded_models == ["tiny.en"] and slot.diarizer_handle is None
        slot.unload()


# --- the evaluation set (harness/diarization_set.py), in-process ----------------------------------

@pytest.fixture(scope="module")
def diarizer_handle() -> Iterator[tuple[Diarizer, object]]:
    diarizer = Diarizer()
    handle = diarizer.load()
    yield diarizer, handle
    diarizer.unload(handle)


def reference(item: diarization_set.Conversation) -> list[Turn]:
    return [Turn(t.start, t.end, t.speaker) for t in item.turns]


def test_the_set_is_seeded() -> None:
    assert diarization_set.spec(3) == diarization_set.spec(3)
    assert diarization_set.spec(3) != diarization_set.spec(4)
    assert [len(diarization_set.spec(i).voices) for i in range(4)] == [2, 3, 4, 5]
    for index in range(diarization_set.COUNT):
        item = diarization_set.spec(index)
        assert len({v.variant for v in item.voices}) == len(item.voices)
        assert {line.speaker for line in item.lines} == set(range(len(item.voices)))
    long = diarization_set.lengthened(diarization_set.spec(2), 40)
    assert long == diarization_set.lengthened(diarization_set.spec(2), 40)
    assert len(long.lines) == 40 and long.voices == diarization_set.spec(2).voices
    assert all(a.speaker != b.speaker for a, b in itertools.pairwise(long.lines))
    assert diarization_set.monologue(1) == diarization_set.monologue(1)


def test_the_untuned_voices_are_espeaks_and_none_of_the_sets() -> None:
    import re
    import subprocess

    listed = subprocess.run(["espeak-ng", "--voices=variant"], capture_output=True, text=True,
                            check=True).stdout
    # the File column ("!v/Mr serious": a name may hold one space), then two or more
    files = {re.search(r"!v/(.*?)(?:\s{2,}|\s*$)", line)[1] for line in listed.splitlines()[1:]}
    untuned = set(diarization_set.UNTUNED_VARIANTS)
    assert untuned <= files and not untuned & set(diarization_set.VARIANTS)
    item = diarization_set.spec(3, variants=diarization_set.UNTUNED_VARIANTS)
    assert {v.variant for v in item.voices} <= untuned and len(item.voices) == 5


def tone_archive(path: Path, meetings: dict[str, dict[str, float]]) -> Path:
    """A zip in the layout of speakerbox's diarized.zip (MEETING/SPEAKER/START-END.wav): each
    speaker a steady tone of its own (Hz), in two 8 s clips."""
    import io
    import zipfile

    import numpy as np
    import soundfile

    times = np.arange(8 * 16000) / 16000
    with zipfile.ZipFile(path, "w") as bundle:
        for meeting, speakers in meetings.items():
            for speaker, hz in speakers.items():
                for clip in range(2):
                    buffer = io.BytesIO()
                    tone = (0.3 * np.sin(2 * np.pi * hz * times)).astype(np.float32)
                    soundfile.write(buffer, tone, 16000, format="WAV")
                    bundle.writestr(f"{meeting}/{speaker}/{clip}-{clip + 1}.wav",
                                    buffer.getvalue())
    return path


def test_the_real_voices_set_is_seeded_and_labelled(tmp_path: Path) -> None:
    import numpy as np

    from harness import real_voices

    tones = {"a": 200.0, "b": 300.0, "c": 450.0, "d": 700.0, "e": 1100.0}
    archive = tone_archive(tmp_path / "diarized.zip",
                           {"one": tones, "two": {"a": 200.0, "b": 300.0}})
    first = real_voices.build(archive, tmp_path / "first", seed=3, per_count=2)
    again = real_voices.build(archive, tmp_path / "again", seed=3, per_count=2)
    other = real_voices.build(archive, tmp_path / "other", seed=4, per_count=2)
    assert [c.turns for c in first] == [c.turns for c in again]
    assert [c.turns for c in first] != [c.turns for c in other]
    assert [c.speakers for c in first] == list(real_voices.SPEAKER_COUNTS) * 2
    for item in first:
        audio = decode_audio(item.path, 16000)
        assert len({t.speaker for t in item.turns}) == item.speakers
        assert max(t.end for t in item.turns) <= len(audio) / 16000
        if item.speakers > 1:
            assert all(a.speaker != b.speaker for a, b in itertools.pairwise(item.turns))
        for index, turn in enumerate(item.turns):
            # the turn's own stretch (no other turn over it): its speaker's tone
            start = max([turn.start] + [t.end for t in item.turns[:index]])
            end = min([turn.end] + [t.start for t in item.turns[index + 1:]])
            piece = audio[int(start * 16000) + 80:int(end * 16000) - 80]
            if len(piece) < 1600:
                continue
            peak = np.argmax(np.abs(np.fft.rfft(piece))) * 16000 / len(piece)
            assert abs(peak - tones[turn.speaker]) < 5, (item.index, turn)


@pytest.mark.parametrize("index", [0, 1, 2, 3])
def test_the_count_is_estimated_on_unseen_voices(tmp_path: Path, diarizer_handle: tuple,
                                                  index: int) -> None:
    """Conversations of 2, 3, 4 and 5 speakers the estimate was never tuned on (the bench
    measures the whole set: bench/diarization.py)."""
    diarizer, handle = diarizer_handle
    item = diarization_set.build(tmp_path, [index])[0]
    audio = decode_audio(item.path)
    found = diarizer.diarize(handle, audio, DiarizationOptions())
    assert len(found.speakers) == item.speakers, found.speakers
    assert der(reference(item), found.turns) <= 0.10
    told = diarizer.diarize(handle, audio, DiarizationOptions(num_speakers=item.speakers))
    assert der(reference(item), told.turns) <= 0.05


@pytest.mark.parametrize("index", [1, 2, 12])
def test_a_monologue_is_one_speaker(tmp_path: Path, diarizer_handle: tuple, index: int) -> None:
    """One espeak voice reading a few lines: its windows spread as widely as some
    conversations' do (a threshold on the spread alone split these three in two)."""
    diarizer, handle = diarizer_handle
    item = diarization_set.build_monologues(tmp_path, [index])[0]
    found = diarizer.diarize(handle, decode_audio(item.path), DiarizationOptions())
    assert found.speakers == ["SPEAKER_00"]
    assert der(reference(item), found.turns) <= 0.10


def test_long_recordings_keep_their_count(tmp_path: Path, diarizer_handle: tuple) -> None:
    """A voice heard for minutes is still one: the timbre check once split one voice of a long
    recording into several (its statistic grew with the frames), the longer the more."""
    diarizer, handle = diarizer_handle
    talk = diarization_set.build_long(tmp_path, [4], lines=60)[0]  # two voices, ~4.5 minutes
    lecture = diarization_set.build_monologues(tmp_path, [5], lines=30)[0]  # ~2 minutes
    for item in (talk, lecture):
        found = diarizer.diarize(handle, decode_audio(item.path), DiarizationOptions())
        assert len(found.speakers) == item.speakers, (item.path.name, found.speakers)
        assert der(reference(item), found.turns) <= 0.10


def test_known_speakers_with_close_voices(tmp_path: Path, diarizer_handle: tuple) -> None:
    """Two voices of one espeak variant, apart only in accent, pitch and rate: each name still
    goes to its own voice (names and speakers are paired as a whole, not greedily)."""
    diarizer, handle = diarizer_handle
    voices = (diarization_set.Voice("en-us", "m3", 45, 165),
              diarization_set.Voice("en-gb", "m3", 58, 150))
    lines = tuple(diarization_set.Line(i % 2, text, 0.5)
                  for i, text in enumerate(diarization_set.SENTENCES[:8]))
    item = diarization_set.render(diarization_set.Spec(-1, voices, lines),
                                  tmp_path / "close.wav")
    names = {"S0": "ann", "S1": "bea"}
    references = {names[f"S{i}"]: voice.say(" ".join(diarization_set.SENTENCES[10 + i * 2:
                                                                               12 + i * 2]))
                  for i, voice in enumerate(voices)}
    found = diarizer.diarize(handle, decode_audio(item.path), DiarizationOptions(num_speakers=2),
                             references)
    assert sorted(found.speakers) == ["ann", "bea"], found.speakers
    for turn in item.turns:
        said = max(found.turns, key=lambda t: min(t.end, turn.end) - max(t.start, turn.start))
        assert said.speaker == names[turn.speaker], (turn, found.turns)


def test_a_reference_is_its_speech_and_one_without_speech_is_refused(
        diarizer_handle: tuple) -> None:
    """A known speaker's reference is compared by its speech only, and a clip that holds no
    voice (noise, a tone, a hum: each loud enough to pass the silence check) is refused with
    the reason, where it used to be paired with whichever speaker came closest."""
    diarizer, handle = diarizer_handle
    rng = np.random.default_rng(25)
    second = np.arange(3 * 16000) / 16000
    for clip in ((rng.standard_normal(4 * 16000) * 0.2).astype(np.float32),
                 (0.3 * np.sin(2 * np.pi * 440 * second)).astype(np.float32),
                 (0.3 * np.sin(2 * np.pi * 100 * second)).astype(np.float32)):
        with pytest.raises(ValueError, match=r"0\.0 s of speech"):
            diarizer.reference(handle, "nobody", clip)
    voice = diarization_set.Voice("en-us", "m3", 45, 165).say(diarization_set.SENTENCES[10])
    hiss = (rng.standard_normal(3 * 16000) * 0.01).astype(np.float32)
    padded = diarizer.reference(handle, "ann", np.concatenate([hiss, voice, hiss]))
    assert 1.0 <= len(padded) / 16000 <= len(voice) / 16000 + 0.5, len(padded) / 16000
    real = decode_audio(TEST_AUDIO / "jfk.flac")[:8 * 16000]  # a real, noisy recording
    assert len(diarizer.reference(handle, "jfk", real)) >= 16000 * 4


# --- the service ------------------------------------------------------------------------------

def test_api_config_says_which_backends_diarize(service: dict) -> None:
    backends = http.get(f"{service['gateway']}/api/config", timeout=10).json()["backends"]
    assert backends["faster-whisper"]["diarization"] is True
    assert backends["xtts"]["diarization"] is False
    for backend in service["others"]:
        assert backends[backend]["diarization"] is True


def test_two_voices_with_and_without_the_count(service: dict, clips: dict) -> None:
    base, turns = service["gateway"], clips["turns"]
    counted = diarized(base, clips["talk"], num_speakers=2, word_timestamps="true")
    assert_matches_turns(counted, turns)
    assert list(counted["speakers"]) == ["SPEAKER_00", "SPEAKER_01"]  # first appearance
    assert counted["segments"][0]["speaker"] == "SPEAKER_00"
    assert sum(s["segments"] for s in counted["speakers"].values()) == len(counted["segments"])
    for segment in counted["segments"]:
        assert {w["speaker"] for w in segment["words"]} == {segment["speaker"]}
    estimated = diarized(base, clips["talk"])
    assert len(estimated["speakers"]) == 2
    assert_matches_turns(estimated, turns)
    assert "words" not in estimated["segments"][0]  # words only when asked for
    again = diarized(base, clips["talk"])
    assert [s["speaker"] for s in again["segments"]] == \
        [s["speaker"] for s in estimated["segments"]]


@pytest.mark.parametrize("backend", list(OTHER_BACKENDS))
def test_the_other_asr_backends_diarize_in_their_environments(service: dict, clips: dict,
                                                              backend: str) -> None:
    """On tiny checkpoints (qwen3 taught JFK's clip only, parakeet random), so the words are
    nonsense; what is checked is the diarizer in the backend's environment: both voices
    found and timed (`speakers`, from its turns), and every segment and word labelled with
    one of them. Qwen3 gives no timestamps: its one segment takes the speaker of most of it."""
    if backend not in service["others"]:
        pytest.skip(f"the {OTHER_BACKENDS[backend]} environment is not installed")
    speech = sum(t.end - t.start for t in clips["turns"])
    for params in ({"num_speakers": 2}, {}):
        result = diarized(service["gateway"], clips["talk"], backend=backend,
                          word_timestamps=str(BACKENDS[backend].word_timestamps).lower(),
                          **params)
        assert list(result["speakers"]) == ["SPEAKER_00", "SPEAKER_01"], result
        found = sum(s["seconds"] for s in result["speakers"].values())
        assert abs(found - speech) < 2.0, (found, speech)
        for segment in result["segments"]:
            assert segment["speaker"] in result["speakers"]
            assert {w["speaker"] for w in segment.get("words", [])} <= {segment["speaker"]}


def test_a_single_voice_is_one_speaker(service: dict, clips: dict) -> None:
    result = diarized(service["gateway"], clips["single"], min_speakers=1, max_speakers=4)
    assert list(result["speakers"]) == ["SPEAKER_00"]
    assert {s["speaker"] for s in result["segments"]} == {"SPEAKER_00"}
    real = diarized(service["gateway"], TEST_AUDIO / "jfk.flac")  # a real, noisy recording
    assert list(real["speakers"]) == ["SPEAKER_00"], real["speakers"]


def test_openai_sdk_diarized_json_with_known_speakers(service: dict, clips: dict) -> None:
    client = openai.OpenAI(base_url=f"{service['gateway']}/v1", api_key="unused",
                           max_retries=0, timeout=240)
    names = list(conversation.VOICES)
    urls = ["data:audio/wav;base64," + base64.b64encode(
        clips["references"][name].read_bytes()).decode() for name in names]
    with clips["talk"].open("rb") as handle:
        body = client.audio.transcriptions.create(
            model="whisper-1", file=handle, response_format="diarized_json",
            known_speaker_names=names, known_speaker_references=urls,
            extra_body={"num_speakers": 2})
    segments = [segment.model_dump() for segment in body.segments]
    assert segments and body.text and body.usage.seconds == pytest.approx(body.duration, abs=0.01)
    assert 24 < body.duration < 26  # (the usage is the audio as charged: not rounded up)
    for segment in segments:
        assert segment["type"] == "transcript.text.segment"
        assert segment["speaker"] == voice_of(clips["turns"], segment["start"], segment["end"])
    # the same with paths under an allowed root, through REST; and cue voices in VTT and SRT
    paths = [str(clips["references"][name]) for name in names]
    url = f"{service['gateway']}/v1/audio/transcriptions"
    with clips["talk"].open("rb") as handle:
        vtt = http.post(url, files={"file": handle}, timeout=240, data={
            "diarize": "true", "response_format": "vtt", "known_speaker_names[]": names,
            "known_speaker_references[]": paths})
    assert vtt.status_code == 200, vtt.text
    assert "<v alice>" in vtt.text and "<v bob>" in vtt.text
    with clips["talk"].open("rb") as handle:
        srt = client.audio.transcriptions.create(model="whisper-1", file=handle,
                                                 response_format="srt",
                                                 extra_body={"diarize": True})
    assert "[SPEAKER_00] " in srt and "[SPEAKER_01] " in srt
    # a silent reference clip is refused before the transcription runs
    silence = "data:audio/wav;base64," + base64.b64encode(
        encode_wav(np.zeros(3 * 16000, np.float32), 16000)).decode()
    with clips["talk"].open("rb") as handle, pytest.raises(openai.BadRequestError) as bad:
        client.audio.transcriptions.create(
            model="whisper-1", file=handle, response_format="diarized_json",
            known_speaker_names=["alice"], known_speaker_references=[silence])
    assert "silent" in str(bad.value)
    hiss = "data:audio/wav;base64," + base64.b64encode(encode_wav(
        (np.random.default_rng(7).standard_normal(3 * 16000) * 0.2).astype(np.float32),
        16000)).decode()
    with clips["talk"].open("rb") as handle, pytest.raises(openai.BadRequestError) as bad:
        client.audio.transcriptions.create(
            model="whisper-1", file=handle, response_format="diarized_json",
            known_speaker_names=["alice"], known_speaker_references=[hiss])
    assert "0.0 s of speech" in str(bad.value)


def test_bad_diarization_input_is_refused_before_queueing(service: dict, clips: dict) -> None:
    base, redis = service["gateway"], service["redis"]
    before = queue_counts(redis)
    talk = clips["talk"]
    ref = str(clips["references"]["alice"])

    def refused(param: str, backend: str = "faster-whisper", files: dict | None = None,
                **params: object) -> None:
        with talk.open("rb") as handle:
            reply = http.post(f"{base}/api/{backend}-submit", timeout=60,
                               files={"file": handle, **(files or {})}, data=params)
        assert reply.status_code in (400, 200) and reply.json()["status"] == "FAILED", reply.text
        assert param in reply.json()["error"], reply.json()

    refused("num_speakers", diarize="true", num_speakers="0")
    refused("num_speakers", diarize="true", num_speakers="33")
    refused("min_speakers", diarize="true", min_speakers="3", max_speakers="2")
    refused("known_speaker_references", diarize="true", known_speaker_names="alice",
            known_speaker_references=str(clips["short"]))
    refused("known_speaker_references", diarize="true", known_speaker_names="alice",
            files={"known_speaker_references": clips["garbage"].open("rb")})
    refused("known_speaker_references", diarize="true",
            **{"known_speaker_names[]": ["alice", "bob"], "known_speaker_references[]": ref})
    refused("cannot look like the labels", diarize="true", known_speaker_names="SPEAKER_01",
            known_speaker_references=ref)  # it would merge with an unknown speaker
    refused("diarize", backend="xtts", diarize="true", text="Hello there.")
    refused("num_speakers", num_speakers="2")  # without diarize
    reply = http.post(f"{base}/v1/audio/transcriptions", timeout=60,
                       files={"file": talk.open("rb")},
                       data={"response_format": "diarized_json", "max_speakers": "40"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "max_speakers"
    assert queue_counts(redis) == before


def test_the_diarizers_memory_goes_back_on_unload(clips: dict) -> None:
    """In this process, where RSS is steady: after the first run (imports, torch's one-time
    set-up), each load and run adds the diarizer's weights and buffers, and each unload (the
    worker's: the diarizer's, then collect and malloc_trim) gives them back."""
    from workers import memory

    rss = psutil.Process().memory_info
    audio = decode_audio(clips["talk"])
    diarizer = Diarizer()
    cycles = []
    for _ in range(4):
        handle = diarizer.load()
        diarizer.diarize(handle, audio, DiarizationOptions())
        loaded = rss().rss / 2**20
        diarizer.unload(handle)
        del handle
        memory.release_all(uses_torch=True)
        cycles.append((loaded, rss().rss / 2**20))
    for loaded, unloaded in cycles[1:]:
        assert loaded - unloaded > 8, cycles  # its weights (~20 MB) and buffers went back
    assert cycles[-1][1] - cycles[1][1] < 5, cycles  # and nothing grows from run to run


def test_the_worker_unloads_the_diarizer_with_the_model(service: dict, clips: dict) -> None:
    """Two loads and unloads of model and diarizer: each time both go, and the worker's RSS
    comes back within SPEECH_REEXEC_RSS_RATIO of its fresh image's (by its own trim, or by the
    re-exec that ratio asks for), so nothing accumulates from cycle to cycle. The exact measure
    of the diarizer's own memory is test_the_diarizers_memory_goes_back_on_unload's."""
    base, health = service["gateway"], f"{service['worker']}/health"
    for _ in range(2):
        reply = submit_file(base, clips["single"], diarize="true")
        final, loaded = wait_sampling_loaded(base, health, reply.json()["taskid"], timeout=240)
        assert final["status"] == "SUCCEEDED", final
        idle = settled_idle(health, Settings().reexec_rss_ratio)
        assert max(loaded) > idle["memory"]["rss_mib"], (loaded, idle["memory"])


def test_a_failure_inside_the_diarizer_is_the_engines_not_the_clients() -> None:
    """The diarizer runs after the transcript (which may have been streamed): a failure of
    its own (numpy's LinAlgError is a ValueError) FAILS the task engine_error, not
    invalid_request, a 400 a client would take for its own fault and never retry."""
    from workers.engines.base import ModelRef
    from workers.engines.faster_whisper import FasterWhisperEngine
    from workers.execute import TaskError, run_engine

    class Breaking(Diarizer):
        def diarize(self, *args: object, **kwargs: object) -> Diarization:
            raise np.linalg.LinAlgError("Singular matrix")

    engine = FasterWhisperEngine(Settings(cpu_threads=2))
    handle = engine.load(ModelRef("tiny.en", "bundled"), "cpu")
    try:
        with pytest.raises(TaskError) as failed:
            run_engine(engine, handle, backend="faster-whisper", model="tiny.en",
                       params={"language": "en", "diarization": {}},
                       source=(TEST_AUDIO / "jfk.flac").read_bytes(),
                       on_segment=lambda segment: None, diarizer=(Breaking(), None))
    finally:
        engine.unload(handle)
    assert failed.value.code == "engine_error" and "LinAlgError" in str(failed.value)
