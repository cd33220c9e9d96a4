"""The kinds of the backend table and what each needs everywhere: a gateway reader, a smoke
check, Sage templates; the analysis kind's clip bundle, params and table rules."""

from __future__ import annotations

import importlib.util
import json
import sys
from dataclasses import replace

import jinja2
import pytest

from common import clips
from common.backends import BACKENDS, KINDS, Clip, Param, check_row
from gateway.submit.kinds import READERS
from harness.procs import ROOT

SAGE = ROOT / "deploy" / "sage"


def load_script(name: str) -> object:
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_every_kind_has_a_reader_a_smoke_check_and_its_templates() -> None:
    assert set(READERS) == set(KINDS)
    assert set(load_script("smoke_test").CHECKS) == set(KINDS)  # type: ignore[attr-defined]
    for kind in KINDS.values():
        assert (SAGE / kind.sage_request).is_file() and (SAGE / kind.sage_response).is_file()
        assert kind.worker_path.startswith("/")


def test_clips_travel_in_one_blob_and_garbage_is_refused() -> None:
    given = {"file": b"RIFF first clip", "reference": b"", "third": bytes(range(256)) * 3}
    assert clips.unpack(clips.pack(given)) == given
    assert list(clips.unpack(clips.pack(given))) == ["file", "reference", "third"]
    blob = clips.pack(given)
    for broken in (b"RIFF....WAVE", blob[:-1], blob + b"x", blob[:30],
                   clips.MAGIC + (10**9).to_bytes(4, "big")):
        with pytest.raises(ValueError):
            clips.unpack(broken)


def test_params_are_checked_and_defaulted() -> None:
    threshold = Param("threshold", "number", default=0.75, low=0.0, high=1.0)
    assert threshold.value(None) == threshold.value("") == 0.75
    assert threshold.value("0.5") == 0.5 and threshold.value(1) == 1.0
    for bad in ("x", "1.5", "-0.1", "nan", "inf", True):
        with pytest.raises(ValueError, match="threshold must be a number from 0 to 1"):
            threshold.value(bad)
    count = Param("count", "integer", low=1, high=3)
    assert count.value("2") == 2 and isinstance(count.value(3.0), int)
    with pytest.raises(ValueError, match="count must be an integer from 1 to 3"):
        count.value("2.5")
    flag = Param("flag", "boolean", default=False)
    assert flag.value("Yes") is True and flag.value("off") is False and flag.value(True) is True
    with pytest.raises(ValueError, match="flag must be true or false"):
        flag.value("maybe")


def test_a_row_with_a_mistake_is_refused() -> None:
    base = replace(BACKENDS["faster-whisper"], kind="analysis", inputs=(Clip("file"),))
    check_row(base)  # the well-formed one
    wrong = {
        "no inputs": replace(base, inputs=()),
        "inputs on an ASR row": replace(base, kind="asr"),
        "main clip not 'file'": replace(base, inputs=(Clip("audio"),)),
        "optional main clip": replace(base, inputs=(Clip("file", required=False),)),
        "reserved name": replace(base, inputs=(Clip("file"), Clip("model"))),
        "a name twice": replace(base, inputs=(Clip("file"), Clip("x")), params=(Param("x"),)),
        "unknown param type": replace(base, params=(Param("x", "text"),)),
        "default out of range": replace(base, params=(Param("x", default=2, low=0, high=1),)),
        "unknown kind": replace(base, kind="video"),
        "engine path": replace(base, engine="workers.engines.faster_whisper"),
        "prefix": replace(base, prefix="fw"),
        "no fixture": replace(base, fixture=replace(base.fixture, source="")),
        "ASR without languages": replace(base, kind="asr", inputs=(), languages=()),
    }
    for why, row in wrong.items():
        try:
            check_row(row)
        except ValueError:
            continue
        pytest.fail(f"accepted a row with this mistake: {why}")


ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(SAGE), autoescape=False)


def render(template: str, **context: object) -> dict:
    return json.loads(ENV.get_template(template).render(**context))


def test_analysis_templates_render_valid_json() -> None:
    request = render("analysis_submit_request.json.j2", audio_path='/data/a "b".wav',
                     params={"reference": "/data/b.wav", "threshold": 0.6})
    assert request == {"audio_path": '/data/a "b".wav', "model": None,
                       "reference": "/data/b.wav", "threshold": 0.6}
    assert render("analysis_submit_request.json.j2", audio_path="/a.wav",
                  model="m") == {"audio_path": "/a.wav", "model": "m"}
    replies = {
        "PENDING": {"taskid": "t", "task_id": "t", "status": "PENDING", "queue_position": 2},
        "SUCCEEDED": {"taskid": "t", "status": "SUCCEEDED", "usage": {"audio_seconds": 2.5},
                      "result": {"score": 0.9, "embedding": [0.1, 0.2], "usage": {}}},
        "FAILED": {"taskid": "t", "status": "FAILED", "error": 'bad "clip" </script>'},
        "UNKNOWN": {"status": "FAILED", "error": "unknown or expired task"},
    }
    for state, reply in replies.items():
        rendered = render("analysis_status_response.json.j2", **reply)
        assert rendered["status"] == reply["status"], state
        assert rendered["result"] == reply.get("result"), state
        assert rendered["error"] == reply.get("error"), state
        assert rendered["usage"] == reply.get("usage"), state
