"""A path checked at submit is checked again when the worker opens it (issue 13): a file or a
directory swapped for a symlink out of the allowed roots while the task waits is never read."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.paths import PathNotAllowed, open_allowed
from harness import procs
from harness.conversation import speak_to
from harness.http_client import http
from tests.helpers import JFK, JFK_TEXT, wait_done, wer

SECRET_WORDS = "purple elephants guard the secret vault"


@pytest.fixture()
def dirs(tmp_path: Path) -> dict[str, Path]:
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    (allowed / "sub").mkdir(parents=True)
    (outside / "sub").mkdir(parents=True)
    secret = outside / "secret.wav"
    speak_to(secret, SECRET_WORDS)
    shutil.copy(secret, outside / "sub" / "input.wav")
    return {"allowed": allowed, "outside": outside, "secret": secret, "work": tmp_path}


@pytest.fixture()
def stopped_worker(dirs: dict[str, Path]) -> Iterator[dict]:
    """Redis and a gateway; the worker (same roots) is made but started by the test."""
    roots = [str(dirs["allowed"])]
    redis = procs.RedisServer(dirs["work"] / "redis").start()
    gateway = procs.gateway(redis.url, dirs["work"], allowed_roots=roots)
    worker = procs.worker(redis.url, dirs["work"], allowed_roots=roots)
    try:
        gateway.start()
        yield {"gateway": gateway.url, "worker": worker}
    finally:
        worker.stop()
        gateway.stop()
        redis.stop()


def submit_path(gateway: str, path: Path) -> str:
    reply = http.post(f"{gateway}/api/faster-whisper-submit", json={"audio_path": str(path)},
                       timeout=30)
    assert reply.status_code == 200, reply.text
    return reply.json()["taskid"]


def swap_for_symlink(path: Path, target: Path) -> None:
    """Atomically replace `path` (file or directory) with a symlink to `target`."""
    link = path.with_name(path.name + ".swap")
    link.symlink_to(target)
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    os.replace(link, path)


def test_swapped_symlinks_fail_and_the_outside_file_is_never_read(
        dirs: dict[str, Path], stopped_worker: dict) -> None:
    allowed, outside = dirs["allowed"], dirs["outside"]
    gateway = stopped_worker["gateway"]
    for name in ("file.flac", "kept.flac", "inside-target.flac"):
        shutil.copy(JFK, allowed / name)
    shutil.copy(JFK, allowed / "sub" / "input.wav")
    tasks = {
        "file": submit_path(gateway, allowed / "file.flac"),  # the file becomes a symlink out
        "directory": submit_path(gateway, allowed / "sub" / "input.wav"),  # its directory does
        "inside": submit_path(gateway, allowed / "kept.flac"),  # a symlink that stays inside
        "untouched": submit_path(gateway, allowed / "inside-target.flac"),
    }
    # no worker yet: every task is PENDING while its file changes under it
    swap_for_symlink(allowed / "file.flac", dirs["secret"])
    swap_for_symlink(allowed / "sub", outside / "sub")
    swap_for_symlink(allowed / "kept.flac", allowed / "inside-target.flac")

    stopped_worker["worker"].start()
    finals = {name: wait_done(gateway, task_id, timeout=120) for name, task_id in tasks.items()}
    for name in ("file", "directory"):
        final = finals[name]
        assert final["status"] == "FAILED", (name, final)
        assert final["error"] == "the path is outside the allowed roots", (name, final)
        view = http.get(f"{gateway}/v1/tasks/{tasks[name]}", timeout=10).json()
        assert view["error_code"] == "invalid_request" and "result" not in view
    for name in ("inside", "untouched"):
        assert finals[name]["status"] == "SUCCEEDED", (name, finals[name])
        assert wer(JFK_TEXT, finals[name]["result"]["text"]) <= 0.10
    everything = repr(finals).lower()
    assert "elephant" not in everything and "vault" not in everything


def test_open_allowed_checks_what_it_opened(dirs: dict[str, Path]) -> None:
    allowed, roots = dirs["allowed"], (dirs["allowed"],)
    (allowed / "real.wav").write_bytes(b"data")
    (allowed / "link.wav").symlink_to(allowed / "real.wav")
    with open_allowed(str(allowed / "link.wav"), roots) as handle:
        assert handle.read() == b"data"
    with open_allowed("real.wav", roots) as handle:  # relative to a root
        assert handle.read() == b"data"
    (allowed / "out.wav").symlink_to(dirs["secret"])
    os.mkfifo(allowed / "pipe.wav")  # opening must not block on it
    for raw, message in ((str(allowed / "out.wav"), "outside the allowed roots"),
                         (str(allowed / "pipe.wav"), "not a regular file"),
                         (str(allowed / "sub"), "not a regular file"),
                         (str(allowed / "gone.wav"), "no such file"),
                         (f"{allowed}/../outside/secret.wav", "may not contain '..'")):
        with pytest.raises(PathNotAllowed, match=message), open_allowed(raw, roots):
            pass
    with pytest.raises(PathNotAllowed, match="disabled"), open_allowed(str(allowed), ()):
        pass


def test_a_path_outside_the_roots_tells_nothing_and_no_path_raises_more(
        dirs: dict[str, Path]) -> None:
    """Outside the roots, a file that exists and one that does not get one answer (no caller
    learns which files the host has); a name too long for the file system, in the roots or
    out, or a loop of symlinks is a missing file, not an error of the server."""
    allowed, roots = dirs["allowed"], (dirs["allowed"],)
    (allowed / "loop.wav").symlink_to(allowed / "loop.wav")
    for raw, message in ((str(dirs["secret"]), "outside the allowed roots"),
                         (str(dirs["outside"] / "missing.wav"), "outside the allowed roots"),
                         (str(allowed / ("a" * 300)), "no such file"),
                         ("a" * 300, "no such file"),
                         ("/" + "a/" * 3000 + "x", "outside the allowed roots"),
                         (str(allowed / "loop.wav"), "no such file")):
        with pytest.raises(PathNotAllowed, match=message), open_allowed(raw, roots):
            pass
