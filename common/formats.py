"""Renderings of an ASR result: Sage's legacy faster-whisper shape, SRT and WebVTT."""

from __future__ import annotations

from typing import Any


def fastwhisper_legacy(result: dict[str, Any]) -> dict[str, Any]:
    """`{"language", "content", "segments": [[start, end, text, [words]]]}` for old templates."""
    segments = []
    for segment in result.get("segments", []):
        words = [[w["start"], w["end"], w["word"], w.get("probability")]
                 for w in segment.get("words") or []]
        segments.append([segment["start"], segment["end"], segment["text"], words])
    return {"language": result.get("language"), "content": result.get("text", ""),
            "segments": segments}


def _timestamp(seconds: float, decimal: str) -> str:
    millis = max(0, round(seconds * 1000))
    hours, millis = divmod(millis, 3_600_000)
    minutes, millis = divmod(millis, 60_000)
    secs, millis = divmod(millis, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal}{millis:03d}"


def _cue_text(text: str) -> str:
    # A blank line ends a cue in both formats, so collapse line breaks inside one.
    return " ".join(text.split())


def srt(segments: list[dict[str, Any]]) -> str:
    """A diarized segment's cue starts with its speaker: `[SPEAKER_00] text`."""
    cues = []
    for index, segment in enumerate(segments, start=1):
        text = _cue_text(segment["text"])
        if speaker := segment.get("speaker"):
            text = f"[{speaker}] {text}"
        cues.append(f"{index}\n{_timestamp(segment['start'], ',')} --> "
                    f"{_timestamp(segment['end'], ',')}\n{text}\n")
    return "\n".join(cues)


def _vtt_escaped(text: str) -> str:
    """Cue text as WebVTT reads it: `&`, `<` and `>` are markup there ("I <3 AT&T")."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def vtt(segments: list[dict[str, Any]]) -> str:
    """A diarized segment's cue carries its speaker in a voice tag: `<v SPEAKER_00>text`."""
    cues = ["WEBVTT\n"]
    for segment in segments:
        text = _vtt_escaped(_cue_text(segment["text"]))
        if speaker := segment.get("speaker"):
            text = f"<v {_vtt_escaped(_cue_text(speaker))}>{text}"
        cues.append(f"{_timestamp(segment['start'], '.')} --> "
                    f"{_timestamp(segment['end'], '.')}\n{text}\n")
    return "\n".join(cues)
