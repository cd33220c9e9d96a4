"""SRT/WebVTT rendering and the legacy faster-whisper view: pure functions."""

from __future__ import annotations

from common.formats import fastwhisper_legacy, srt, vtt

SEGMENTS = [
    {"id": 0, "start": 0.0, "end": 1.5, "text": " Hello, world."},
    {"id": 1, "start": 3599.999, "end": 3723.4567, "text": "Line one,\nline two\n\nthree"},
    {"id": 2, "start": 36000.25, "end": 36001.0, "text": "after --> ten hours"},
]


def test_srt_times_past_one_hour_and_text_stays_in_one_cue() -> None:
    rendered = srt(SEGMENTS)
    cues = rendered.strip().split("\n\n")
    assert len(cues) == 3
    assert cues[0] == "1\n00:00:00,000 --> 00:00:01,500\nHello, world."
    assert cues[1] == "2\n00:59:59,999 --> 01:02:03,457\nLine one, line two three"
    assert cues[2].startswith("3\n10:00:00,250 --> 10:00:01,000\n")


def test_vtt_header_dots_and_no_cue_breaks() -> None:
    rendered = vtt(SEGMENTS)
    assert rendered.startswith("WEBVTT\n\n")
    assert "00:59:59.999 --> 01:02:03.457\nLine one, line two three" in rendered
    assert "after --&gt; ten hours" in rendered  # an arrow inside text would start a new cue
    assert len(rendered.strip().split("\n\n")) == 4


def test_legacy_view() -> None:
    result = {"text": "Hi there", "language": "en",
              "segments": [{"start": 0.0, "end": 1.0, "text": "Hi there",
                            "words": [{"word": "Hi", "start": 0.0, "end": 0.4,
                                       "probability": 0.9}]}]}
    assert fastwhisper_legacy(result) == {
        "language": "en", "content": "Hi there",
        "segments": [[0.0, 1.0, "Hi there", [[0.0, 0.4, "Hi", 0.9]]]]}


def test_diarized_cues_carry_their_speaker() -> None:
    segments = [{"id": 0, "start": 0.0, "end": 1.0, "text": " Hello.", "speaker": "SPEAKER_00"},
                {"id": 1, "start": 1.0, "end": 2.0, "text": " Hi.", "speaker": "bob"},
                {"id": 2, "start": 2.0, "end": 3.0, "text": " Nobody.", "speaker": None}]
    assert srt(segments).split("\n\n")[:2] == [
        "1\n00:00:00,000 --> 00:00:01,000\n[SPEAKER_00] Hello.",
        "2\n00:00:01,000 --> 00:00:02,000\n[bob] Hi."]
    cues = vtt(segments).strip().split("\n\n")
    assert cues[1:] == ["00:00:00.000 --> 00:00:01.000\n<v SPEAKER_00>Hello.",
                        "00:00:01.000 --> 00:00:02.000\n<v bob>Hi.",
                        "00:00:02.000 --> 00:00:03.000\nNobody."]
