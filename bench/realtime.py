"""Live transcription latency: end of a spoken turn -> its `...completed` event, p50/p99.

One faster-whisper worker (tiny.en), one gateway; `--sessions` concurrent WebSocket
sessions (`/v1/realtime?intent=transcription`, a raw `websockets` client), each speaking
`--turns` short espeak-ng sentences as 24 kHz PCM16 in 100 ms chunks, in real time. Two
modes, one after the other:

- `server_vad` (500 ms of silence ends a turn, the protocol's default): after each sentence
  the client keeps streaming silence, as a microphone does, until the turn's completed
  event. The latency counts from the chunk that carried the sentence's last sample: it
  includes the VAD's 500 ms wait, the queue, the worker and the way back.
- `manual` (turn_detection null): the client commits right after the sentence's last chunk;
  the latency counts from the commit.

Also measured in-process: the gateway's cost of the server VAD (silero-vad on onnxruntime,
resampling included) per second of streamed audio, i.e. how many live streams one core's
VAD keeps up with.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import asyncio  # noqa: E402
import base64  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import websockets  # noqa: E402

from bench import common as bc  # noqa: E402
from common.audio import decode_audio  # noqa: E402

NAME = "realtime"
RATE = 24000
CHUNK = RATE // 10  # 100 ms
SENTENCES = ("Please book a table for two at seven.", "The weather is cold and windy today.",
             "Send the report to the whole team.", "Turn left at the next traffic light.",
             "My favourite colour is dark green.")
COMPLETED = "conversation.item.input_audio_transcription.completed"
MODES = {"server_vad": {"type": "server_vad", "silence_duration_ms": 500}, "manual": None}


def sentences(tmp: Path) -> list[np.ndarray]:
    clips = []
    for index, text in enumerate(SENTENCES):
        path = tmp / f"s{index}.wav"
        subprocess.run(["espeak-ng", "-v", "en-us", "-w", str(path), text], check=True,
                       capture_output=True)
        audio = decode_audio(path, RATE)
        clips.append((np.clip(audio, -1, 1) * 32767).astype("<i2"))
    return clips


def b64(samples: np.ndarray) -> str:
    return base64.b64encode(samples.tobytes()).decode()


async def session(url: str, clips: list[np.ndarray], turns: int, mode: str,
                  stagger: float) -> list[dict[str, float]]:
    """One session's turns: per turn, seconds from its end to its completed event, and from
    the server's speech_stopped / committed to it."""
    await asyncio.sleep(stagger)
    measured: list[dict[str, float]] = []
    async with websockets.connect(f"{url}?intent=transcription", max_size=None) as socket:
        await socket.send(json.dumps({"type": "session.update", "session": {
            "type": "transcription", "audio": {"input": {
                "format": {"type": "audio/pcm", "rate": RATE},
                "transcription": {"model": "whisper-1", "language": "en"},
                "turn_detection": MODES[mode]}}}}))
        arrivals: dict[str, float] = {}
        done = asyncio.Event()

        async def read() -> None:
            async for message in socket:
                event = json.loads(message)
                arrivals[event["type"]] = time.monotonic()
                if event["type"] == "error":
                    raise RuntimeError(f"error event: {event}")
                if event["type"] == COMPLETED:
                    done.set()

        reader = asyncio.ensure_future(read())
        clock = time.monotonic()
        silence = np.zeros(CHUNK, "<i2")

        async def send(samples: np.ndarray) -> None:
            nonlocal clock
            clock += len(samples) / RATE  # real time: a chunk goes out when it was "spoken"
            await asyncio.sleep(max(0.0, clock - time.monotonic()))
            await socket.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": b64(samples)}))

        for turn in range(turns):
            clip = clips[turn % len(clips)]
            clock = max(clock, time.monotonic())  # a manual turn's wait sent nothing
            for _ in range(3):  # a pause before the sentence
                await send(silence)
            done.clear()
            arrivals.clear()
            for start in range(0, len(clip), CHUNK):
                await send(clip[start:start + CHUNK])
            ended = time.monotonic()
            if mode == "manual":
                await socket.send(json.dumps({"type": "input_audio_buffer.commit"}))
            while not done.is_set():  # the microphone stays open
                if reader.done():
                    reader.result()
                if time.monotonic() - ended > 60:
                    raise TimeoutError(f"no completed event 60 s after turn {turn}")
                if mode == "server_vad":
                    await send(silence)
                else:
                    await asyncio.sleep(0.01)
            completed = arrivals[COMPLETED]
            marker = arrivals.get("input_audio_buffer.speech_stopped",
                                  arrivals.get("input_audio_buffer.committed", ended))
            measured.append({"end_to_completed": completed - ended,
                             "server_end_to_completed": completed - marker})
        reader.cancel()
    return measured


async def run_mode(url: str, clips: list[np.ndarray], sessions: int, turns: int,
                   mode: str) -> list[dict[str, float]]:
    results = await asyncio.gather(*(session(url, clips, turns, mode, index * 0.7)
                                     for index in range(sessions)))
    return [turn for result in results for turn in result]


def vad_cost() -> dict[str, float]:
    """CPU seconds the gateway spends per second of streamed audio (resample + VAD)."""
    from gateway.realtime.buffer import InputBuffer
    from gateway.realtime.vad import VadConfig

    audio = decode_audio(bc.JFK, RATE)
    buffer = InputBuffer(RATE, VadConfig(), 60 * 16000)
    buffer.append(audio[:CHUNK], None)  # load the model
    start = time.process_time()
    for _ in range(3):
        for index in range(0, len(audio), CHUNK):
            buffer.append(audio[index:index + CHUNK], None)
    per_second = (time.process_time() - start) / (3 * len(audio) / RATE)
    return {"cpu_seconds_per_audio_second": round(per_second, 5),
            "streams_per_core": round(1 / per_second)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=2)
    parser.add_argument("--turns", type=int, default=12, help="turns per session and mode")
    args = parser.parse_args()
    started = bc.machine()
    with tempfile.TemporaryDirectory(prefix="sg-bench-realtime-") as tmp:
        clips = sentences(Path(tmp))
    modes: dict[str, Any] = {}
    with bc.Stack(NAME, worker_settings={"preload": "true"}) as stack:
        url = stack.url.replace("http://", "ws://") + "/v1/realtime"
        asyncio.run(run_mode(url, clips, 1, 1, "manual"))  # warm-up
        for mode in MODES:
            turns = asyncio.run(run_mode(url, clips, args.sessions, args.turns, mode))
            modes[mode] = {name: bc.summary([t[name] for t in turns], 1000)
                           for name in ("end_to_completed", "server_end_to_completed")}
    cost = vad_cost()
    bc.table(f"live turn latency: {args.sessions} sessions x {args.turns} turns, "
             "real-time 24 kHz PCM, one worker (ms)",
             ["mode", "from", "n", "p50", "p90", "p99", "max"],
             [[mode, "end of speech" if name == "end_to_completed" else
               "speech_stopped / commit", s["n"], s["p50"], s["p90"], s["p99"], s["max"]]
              for mode, stats in modes.items() for name, s in stats.items()])
    print(f"server VAD in the gateway: {cost['cpu_seconds_per_audio_second'] * 1000:.2f} ms "
          f"CPU per second of audio, ~{cost['streams_per_core']} live streams per core")
    bc.write_json(NAME, {"sessions": args.sessions, "turns_per_session": args.turns,
                         "modes": modes, "vad": cost}, started)


if __name__ == "__main__":
    bc.run(main)
