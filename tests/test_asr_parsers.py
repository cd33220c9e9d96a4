"""Output parsing of the transformers ASR engines, on realistic answers written out as strings."""

from __future__ import annotations

import pytest

from workers.engines.qwen3_text import collapse_repeats, language_code, model_language, parse_output
from workers.engines.vibevoice_parse import ParseError, parse_segments

TWO_SPEAKERS = (
    'assistant\n[{"Start":0.0,"End":7.56,"Speaker":0,"Content":"Hello everyone, welcome back."},'
    '{"Start":7.56,"End":12.3,"Speaker":1,"Content":"Thanks for having me."}]\n'
)


def spans(raw: str, duration: float = 60.0) -> list[tuple[float, float, str | None, str]]:
    return [(s.start, s.end, s.speaker, s.text) for s in parse_segments(raw, duration)]


# --- VibeVoice ------------------------------------------------------------------------------


def test_well_formed_answer_gives_segments_with_speakers() -> None:
    segments = parse_segments(TWO_SPEAKERS, 12.5)
    assert [s.id for s in segments] == [0, 1]
    assert spans(TWO_SPEAKERS) == [(0.0, 7.56, "0", "Hello everyone, welcome back."),
                                   (7.56, 12.3, "1", "Thanks for having me.")]
    assert all(s.words is None for s in segments)


@pytest.mark.parametrize("cut", [
    '{"Start":7.56,"End":12.3,"Speaker":1,"Content":"Thanks for hav',  # inside a string
    '{"Start":7.56,"End":12.',  # inside a number
    '{"Start"',  # inside a key
    "",  # right after the comma
])
def test_truncated_answer_keeps_the_complete_segments(cut: str) -> None:
    raw = ('assistant\n[{"Start":0.0,"End":7.56,"Speaker":0,'
           '"Content":"Hello everyone, welcome back."},' + cut)
    assert spans(raw) == [(0.0, 7.56, "0", "Hello everyone, welcome back.")]


def test_truncated_before_any_complete_segment_gives_none() -> None:
    assert spans('assistant\n[{"Start":0.0,"End":3.2,"Speaker":0,"Content":"Hel') == []


def test_non_speech_tags_are_dropped_or_stripped() -> None:
    raw = ('assistant\n[{"Start":0.0,"End":4.0,"Content":"[Music]"},'
           '{"Start":4.0,"End":9.5,"Speaker":0,"Content":"[Lyric] Stay with me tonight"},'
           '{"Start":9.5,"End":12.0,"Content":"[Silence]"},'
           '{"Start":12.0,"End":15.0,"Speaker":1,"Content":"Back to the news."}]')
    segments = parse_segments(raw, 20.0)
    assert [(s.id, s.start, s.end, s.speaker, s.text) for s in segments] == [
        (0, 4.0, 9.5, "0", "Stay with me tonight"),
        (1, 12.0, 15.0, "1", "Back to the news."),
    ]


@pytest.mark.parametrize("raw", [
    '[Music] [{"Start":0,"End":2.5,"Speaker":0,"Content":"Hi there."}]',
    'Sure, here is the transcript:\n[{"Start":0,"End":2.5,"Speaker":0,"Content":"Hi there."}]',
    '```json\n[{"Start":0,"End":2.5,"Speaker":0,"Content":"Hi there."}]\n```',
])
def test_content_before_the_array_is_skipped(raw: str) -> None:
    assert spans(raw) == [(0.0, 2.5, "0", "Hi there.")]


@pytest.mark.parametrize("raw", ["", "  \n", "assistant\n", "assistant\n[]", "[Silence]",
                                 "assistant\n[Music]\n"])
def test_empty_or_tag_only_answers_give_no_segments(raw: str) -> None:
    assert parse_segments(raw, 5.0) == []


@pytest.mark.parametrize("raw", [
    'E\ufffd wordsov":"\x13 spokengl do\ufffdanese^YE',  # a random model's ramble
    "Hello there, this is plain text.",
    "[1, 2, 3]",
    '[{"Start":0,"End":1}]',  # objects, but no content anywhere
    '{"Start":0,"End":1,"Content":"not in an array"}',
])
def test_garbage_is_a_clear_error(raw: str) -> None:
    with pytest.raises(ParseError, match=r"no JSON array|no segment objects"):
        parse_segments(raw, 5.0)


def test_times_are_repaired_and_clamped() -> None:
    raw = ('[{"Start":"0.5","End":"2.0","Speaker":"0","Content":"a"},'
           '{"End":4.0,"Speaker":0,"Content":"b"},'  # no start: the previous end
           '{"Start":5.0,"End":4.0,"Speaker":0,"Content":"c"},'  # end before start
           '{"Start":6.0,"End":99.0,"Speaker":1.0,"Content":"d"},'  # past the end of the audio
           '{"Start":"soon","End":null,"Speaker":null,"Content":"e"}]')
    assert spans(raw, duration=10.0) == [(0.5, 2.0, "0", "a"), (2.0, 4.0, "0", "b"),
                                         (5.0, 5.0, "0", "c"), (6.0, 10.0, "1", "d"),
                                         (10.0, 10.0, None, "e")]


def test_key_spellings_are_accepted() -> None:
    raw = '[{"start time":1,"end time":2,"speaker id":3,"content":"x"},{"text":"y","END":3}]'
    assert spans(raw) == [(1.0, 2.0, "3", "x"), (2.0, 3.0, None, "y")]


# --- Qwen3 ----------------------------------------------------------------------------------


def test_detected_language_and_text() -> None:
    assert parse_output("language English<asr_text>Ship it.", None) == ("en", "Ship it.")
    assert parse_output("language Cantonese<asr_text>你好", None) == ("yue", "你好")
    assert parse_output("language None<asr_text>", None) == (None, "")
    assert parse_output("  ", None) == (None, "")
    assert parse_output("Just text, no tag.", None) == (None, "Just text, no tag.")
    assert parse_output("language Klingon<asr_text>Qapla'", None) == ("klingon", "Qapla'")


def test_forced_language_answer_is_the_text() -> None:
    assert parse_output("안녕하세요", "Korean") == ("ko", "안녕하세요")
    assert parse_output("language Korean<asr_text>안녕하세요", "Korean") == ("ko", "안녕하세요")


def test_language_codes_map_to_the_model_names() -> None:
    assert model_language("ko") == "Korean"
    assert model_language("KO") == "Korean"
    assert model_language("korean") == "Korean"
    assert model_language("yue") == "Cantonese"
    assert model_language("zh-CN") == "Chinese"
    assert model_language(None) is None
    assert model_language("auto") is None
    with pytest.raises(ValueError, match="'xx' is not supported by qwen3"):
        model_language("xx")
    assert language_code("Korean") == "ko"
    assert language_code("None") is None


def test_runaway_repetitions_collapse() -> None:
    assert collapse_repeats("ha" * 50) == "ha"
    assert collapse_repeats("Okay. " + "I think " * 30 + "so.") == "Okay. I think so."
    assert collapse_repeats("a" * 30 + "b") == "ab"
    normal = "That that is, is; that that is not, is not. " * 3
    assert collapse_repeats(normal) == normal
    looping = "language English<asr_text>" + "Thank you. " * 40 + "Bye."
    assert parse_output(looping, None) == ("en", "Thank you. Bye.")
