#!/usr/bin/env python3
"""Post-deploy smoke test: every enabled backend, through its worker and through the gateway.

Standard library only, so it runs from any python3 (inside the container or outside).
Prints one `OK name: detail` or `FAIL name: reason` line per check and exits 1 on any FAIL.
What it sends a backend follows its kind in /api/config (CHECKS: one function per kind of
the backend table); an analysis backend gets the clip for every input it declares.
See scripts/smoke_test.sh for the options.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
import wave
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SPEECH_TEXT = "Hello world. This is a smoke test."


class Check:
    def __init__(self) -> None:
        self.failures = 0

    def report(self, name: str, ok: bool, detail: str) -> None:
        self.failures += not ok
        print(f"{'OK' if ok else 'FAIL'} {name}: {' '.join(str(detail).split())[:300]}",
              flush=True)


class Client:
    def __init__(self, key: str | None, timeout: float) -> None:
        self.key, self.timeout = key, timeout

    def request(self, method: str, url: str, body: bytes | None = None,
                content_type: str | None = None) -> tuple[int, bytes, dict[str, str]]:
        request = urllib.request.Request(url, data=body, method=method)
        if content_type:
            request.add_header("Content-Type", content_type)
        if self.key:
            request.add_header("Authorization", f"Bearer {self.key}")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as reply:
                return reply.status, reply.read(), dict(reply.headers)
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read(), dict(exc.headers)

    def json(self, method: str, url: str, body: bytes | None = None,
             content_type: str | None = None) -> tuple[int, Any]:
        status, data, _ = self.request(method, url, body, content_type)
        try:
            return status, json.loads(data)
        except ValueError:
            return status, {"error": data[:200].decode(errors="replace")}


@dataclass
class Run:
    """What every check of one smoke run shares."""

    check: Check
    client: Client
    worker_client: Client
    base: str
    clip: bytes
    voice: str
    deadline: float


def multipart(fields: dict[str, str], files: dict[str, tuple[str, bytes]]) -> tuple[bytes, str]:
    boundary = uuid.uuid4().hex
    parts = []
    for name, value in fields.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"\r\n\r\n'
                     f"{value}\r\n".encode())
    for name, (filename, data) in files.items():
        parts.append(f'--{boundary}\r\nContent-Disposition: form-data; name="{name}"; '
                     f'filename="{filename}"\r\nContent-Type: application/octet-stream\r\n\r\n'
                     .encode() + data + b"\r\n")
    parts.append(f"--{boundary}--\r\n".encode())
    return b"".join(parts), f"multipart/form-data; boundary={boundary}"


def make_clip(workdir: Path) -> tuple[bytes, str]:
    """Real speech from espeak-ng when present, else a one-second tone."""
    path = workdir / "smoke.wav"
    if shutil.which("espeak-ng"):
        subprocess.run(["espeak-ng", "-v", "en-us", "-w", str(path), SPEECH_TEXT], check=True,
                       capture_output=True)
        return path.read_bytes(), "espeak-ng speech"
    with wave.open(str(path), "wb") as out:
        out.setnchannels(1)
        out.setsampwidth(2)
        out.setframerate(16000)
        out.writeframes(b"".join(struct.pack("<h", int(8000 * math.sin(i * 0.1)))
                                 for i in range(16000)))
    return path.read_bytes(), "a tone (espeak-ng not found)"


def wav_seconds(data: bytes) -> float:
    with tempfile.NamedTemporaryFile(suffix=".wav") as handle:
        handle.write(data)
        handle.flush()
        with wave.open(handle.name) as wav:
            return wav.getnframes() / wav.getframerate()


def poll(client: Client, base: str, task_id: str, deadline: float) -> dict[str, Any]:
    while time.monotonic() < deadline:
        status, reply = client.json("GET", f"{base}/api/status?taskid={task_id}")
        if status != 200 or "status" not in reply:
            return {"status": "FAILED", "error": f"status HTTP {status}: {reply}"}
        if reply["status"] in ("SUCCEEDED", "FAILED"):
            return reply
        time.sleep(0.25)
    return {"status": "FAILED", "error": f"still not finished after the timeout ({task_id})"}


def check_asr(run: Run, backend: str, info: dict[str, Any], workers: list[dict]) -> None:
    check, client, worker_client, base = run.check, run.client, run.worker_client, run.base
    clip, deadline, model = run.clip, run.deadline, info["default_model"]
    for worker in workers:
        body, ctype = multipart({"model": model}, {"file": ("smoke.wav", clip)})
        status, reply = worker_client.json("POST", f"{worker['url']}/transcribe", body, ctype)
        ok = status == 200 and isinstance(reply.get("text"), str)
        check.report(f"{backend} worker {worker['consumer']}", ok,
                     f"text={reply.get('text', '')!r}" if ok else f"HTTP {status}: {reply}")
    body, ctype = multipart({"model": model}, {"file": ("smoke.wav", clip)})
    status, reply = client.json("POST", f"{base}/api/{backend}-submit", body, ctype)
    if status != 200:
        check.report(f"{backend} sage", False, f"submit HTTP {status}: {reply}")
    else:
        final = poll(client, base, reply["taskid"], deadline)
        ok = final["status"] == "SUCCEEDED" and final.get("usage", {}).get("audio_seconds", 0) > 0
        check.report(f"{backend} sage", ok, f"text={final['result']['text']!r}" if ok
                     else final.get("error", final))
    body, ctype = multipart({"model": f"{backend}/{model}", "response_format": "json"},
                            {"file": ("smoke.wav", clip)})
    status, reply = client.json("POST", f"{base}/v1/audio/transcriptions", body, ctype)
    ok = status == 200 and isinstance(reply.get("text"), str)
    check.report(f"{backend} openai", ok, f"text={reply.get('text')!r}" if ok
                 else f"HTTP {status}: {reply}")


def check_tts(run: Run, backend: str, info: dict[str, Any], workers: list[dict]) -> None:
    check, client, worker_client, base = run.check, run.client, run.worker_client, run.base
    voice, deadline, model = run.voice, run.deadline, info["default_model"]
    for worker in workers:
        body, ctype = multipart({"text": SPEECH_TEXT, "model": model, "voice": voice}, {})
        status, data, _ = worker_client.request("POST", f"{worker['url']}/synthesize", body,
                                                ctype)
        ok = status == 200 and data[:4] == b"RIFF"
        detail = f"{wav_seconds(data):.2f} s of audio" if ok else f"HTTP {status}: {data[:200]!r}"
        check.report(f"{backend} worker {worker['consumer']}", ok, detail)
    payload = json.dumps({"text": SPEECH_TEXT, "model": model, "voice": voice}).encode()
    status, reply = client.json("POST", f"{base}/api/{backend}-submit", payload,
                                "application/json")
    if status != 200:
        check.report(f"{backend} sage", False, f"submit HTTP {status}: {reply}")
    else:
        final = poll(client, base, reply["taskid"], deadline)
        ok = final["status"] == "SUCCEEDED" and bool(final.get("output_url"))
        detail = final.get("error", final)
        if ok:
            status, data, _ = client.request("GET", final["output_url"])
            ok = status == 200 and data[:4] == b"RIFF"
            detail = f"{wav_seconds(data):.2f} s at output_url" if ok else f"HTTP {status}"
        check.report(f"{backend} sage", ok, detail)
    payload = json.dumps({"model": f"{backend}/{model}", "input": SPEECH_TEXT, "voice": voice,
                          "response_format": "wav"}).encode()
    status, data, _ = client.request("POST", f"{base}/v1/audio/speech", payload,
                                     "application/json")
    ok = status == 200 and data[:4] == b"RIFF"
    check.report(f"{backend} openai", ok, f"{wav_seconds(data):.2f} s of audio" if ok
                 else f"HTTP {status}: {data[:200]!r}")


def check_analysis(run: Run, backend: str, info: dict[str, Any], workers: list[dict]) -> None:
    """Any analysis backend: the smoke clip for each audio input /api/config declares, the
    params left at their defaults; a SUCCEEDED task with a JSON result and usage."""
    model = info["default_model"]
    files = {clip["name"]: ("smoke.wav", run.clip) for clip in info.get("inputs", [])}
    for worker in workers:
        body, ctype = multipart({"model": model}, files)
        status, reply = run.worker_client.json("POST", f"{worker['url']}/analyze", body, ctype)
        ok = status == 200 and "error" not in reply
        run.check.report(f"{backend} worker {worker['consumer']}", ok,
                         summary(reply) if ok else f"HTTP {status}: {reply}")
    body, ctype = multipart({"model": model}, files)
    status, reply = run.client.json("POST", f"{run.base}/api/{backend}-submit", body, ctype)
    if status != 200:
        run.check.report(f"{backend} sage", False, f"submit HTTP {status}: {reply}")
        return
    final = poll(run.client, run.base, reply["taskid"], run.deadline)
    ok = (final["status"] == "SUCCEEDED" and isinstance(final.get("result"), dict)
          and final.get("usage", {}).get("audio_seconds", 0) > 0)
    run.check.report(f"{backend} sage", ok, summary(final["result"]) if ok
                     else final.get("error", final))


def summary(result: dict[str, Any]) -> str:
    """A result's plain values (`score=0.93 same_speaker=True`), for the report line."""
    shown = [f"{key}={value!r}" for key, value in result.items()
             if isinstance(value, str | int | float | bool) and key not in ("backend", "model")]
    return " ".join(shown[:6]) or f"{len(result)} fields"


#: kind (common/backends.py KINDS) -> the checks of one backend of that kind
CHECKS: dict[str, Callable[[Run, str, dict[str, Any], list[dict]], None]] = {
    "asr": check_asr, "tts": check_tts, "analysis": check_analysis,
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default=os.environ.get("SMOKE_URL", "http://127.0.0.1:8000"),
                        help="gateway base URL (env SMOKE_URL)")
    parser.add_argument("--key", default=os.environ.get("SMOKE_API_KEY"),
                        help="API key (env SMOKE_API_KEY)")
    parser.add_argument("--worker-secret",
                        default=os.environ.get("SMOKE_WORKER_SECRET",
                                               os.environ.get("SPEECH_WORKER_SECRET")),
                        help="the workers' SPEECH_WORKER_SECRET, for their direct endpoints "
                             "(env SMOKE_WORKER_SECRET or SPEECH_WORKER_SECRET)")
    parser.add_argument("--backends", default=os.environ.get("SMOKE_BACKENDS", ""),
                        help="comma-separated subset (default: every enabled backend)")
    parser.add_argument("--voice", default=os.environ.get("SMOKE_VOICE", "alloy"))
    parser.add_argument("--cold", action="store_true",
                        default=os.environ.get("SMOKE_COLD", "") not in ("", "0", "false"),
                        help="workers may be scaled to zero (KEDA): a backend with no live "
                             "worker is checked through the gateway, whose first submit wakes "
                             "one, and workers' direct endpoints (pod IPs) are skipped")
    parser.add_argument("--timeout", type=float,
                        default=float(os.environ.get("SMOKE_TIMEOUT", "300")),
                        help="seconds for the whole run")
    args = parser.parse_args()
    base = args.url.rstrip("/")
    deadline = time.monotonic() + args.timeout
    client = Client(args.key, timeout=max(30.0, args.timeout))
    worker_client = Client(args.worker_secret, timeout=max(30.0, args.timeout))
    check = Check()

    status, ready = client.json("GET", f"{base}/ready")
    check.report("gateway ready", status == 200 and ready.get("ready") is True,
                 f"redis={ready.get('redis')}" if status == 200 else f"HTTP {status}: {ready}")
    status, config = client.json("GET", f"{base}/api/config")
    if status != 200:
        check.report("gateway config", False, f"HTTP {status}: {config}")
        return 1
    wanted = [b for b in args.backends.split(",") if b] or list(config["backends"])
    with tempfile.TemporaryDirectory() as tmp:
        clip, clip_kind = make_clip(Path(tmp))
        run = Run(check, client, worker_client, base, clip, args.voice, deadline)
        print(f"# clip: {clip_kind}; backends: {', '.join(wanted)}", flush=True)
        for backend in wanted:
            info = config["backends"].get(backend)
            if info is None:
                check.report(backend, False, "not enabled on this gateway")
                continue
            workers = ready.get("backends", {}).get(backend, {}).get("live", [])
            if args.cold:  # through the gateway alone: it wakes a backend at zero
                print(f"# {backend}: {len(workers)} live worker(s); direct endpoints skipped",
                      flush=True)
                workers = []
            elif not workers:
                check.report(backend, False, "no live worker (see /ready and its log)")
                continue
            kind_check = CHECKS.get(info["kind"])
            if kind_check is None:
                check.report(backend, False, f"no smoke check for its kind {info['kind']!r}")
                continue
            kind_check(run, backend, info, workers)
    print(f"# {check.failures} failure(s)", flush=True)
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main())
