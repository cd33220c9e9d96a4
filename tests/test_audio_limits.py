"""Duration limits that hold whatever the container claims (issue 13).

Files whose packet timestamps claim a few seconds but hold two hours of silence or ten minutes
of speech pass the gateway's quick probe; the worker counts decoded samples, stops at
SPEECH_MAX_AUDIO_SECONDS and fails the task with `audio_too_long`, its RSS (sampled all
along) far under a memory cap that keeping the whole decode would have broken.
"""

from __future__ import annotations

import io
import threading
import time
from collections.abc import Iterator
from fractions import Fraction
from pathlib import Path

import av
import psutil
import pytest

from common.audio import AudioTooLong, decode_audio, probe_audio
from harness import procs
from harness.http_client import http
from tests.audio_fakes import decoded_seconds, growing_pcm, lying_matroska, silence_opus
from tests.helpers import JFK, submit_file, wait_done

LIMIT_SECONDS = 60
MEMORY_CAP_MIB = 450  # a tiny.en worker works at ~220-350 MiB RSS on CPU
SILENCE_SECONDS, SILENCE_CLAIMS = 7200, 5.0
SPEECH_LOOPS, SPEECH_CLAIMS = 10, 8.0  # multilingual.mp3 (60 s) ten times: 600 s


@pytest.fixture(scope="module")
def fakes(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    workdir = tmp_path_factory.mktemp("fakes")
    files = {
        "silence": lying_matroska(silence_opus(10.0), SILENCE_SECONDS // 10, SILENCE_CLAIMS),
        "speech": lying_matroska(procs.TEST_AUDIO / "multilingual.mp3", SPEECH_LOOPS,
                                 SPEECH_CLAIMS),
        "short": lying_matroska(JFK, 3, 2.0),  # 33 s claiming 2 s: under the limit
    }
    paths = {}
    for name, data in files.items():
        paths[name] = workdir / f"{name}.mkv"
        paths[name].write_bytes(data)
    return paths


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """Its own Redis, gateway and worker: a 60 s limit and a worker memory cap."""
    workdir = tmp_path_factory.mktemp("limits")
    redis = procs.RedisServer(workdir / "redis").start()
    gateway = procs.gateway(redis.url, workdir, max_audio_seconds=str(LIMIT_SECONDS))
    worker = procs.worker(redis.url, workdir, max_audio_seconds=str(LIMIT_SECONDS),
                          memory_cap_mib=str(MEMORY_CAP_MIB), idle_unload_seconds="-1",
                          device="cpu")
    try:
        gateway.start()
        worker.start()
        # a first task loads the model, so the RSS sampled later is the worker's working size
        warm = wait_done(gateway.url, submit_file(gateway.url, JFK).json()["taskid"])
        assert warm["status"] == "SUCCEEDED", warm
        yield {"gateway": gateway.url, "worker": worker}
    finally:
        worker.stop()
        gateway.stop()
        redis.stop()


class PeakRss:
    """Samples a process's RSS every few milliseconds while in use."""

    def __init__(self, pid: int) -> None:
        self.process = psutil.Process(pid)
        self.peak = self.first = self.process.memory_info().rss
        self.samples = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.process.memory_info().rss)
            self.samples += 1
            time.sleep(0.005)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def test_fake_timestamps_fool_neither_the_probe_nor_the_decoder(fakes: dict[str, Path]
                                                                ) -> None:
    for name in ("silence", "speech"):
        data = fakes[name].read_bytes()
        probed = probe_audio(data).duration
        real = decoded_seconds(data)
        # the probe's floor (packets x samples per packet; issue 30), not the timestamps
        assert probed == pytest.approx(real, rel=0.05), (name, probed, real)
        assert real > 9 * LIMIT_SECONDS, (name, real)
        started = time.monotonic()
        with pytest.raises(AudioTooLong, match=f"limit of {LIMIT_SECONDS} s"):
            decode_audio(data, 16000, max_seconds=LIMIT_SECONDS)
        assert time.monotonic() - started < 5, "the decode went on past the limit"
    # under the limit, the decode is whole and its length is the samples', not the claim's
    short = decode_audio(fakes["short"].read_bytes(), 16000, max_seconds=LIMIT_SECONDS)
    assert 32 < probe_audio(fakes["short"]).duration < 34 and 32 < len(short) / 16000 < 34


def test_pcm_packets_that_grow_do_not_fool_the_probe() -> None:
    """Past the first packets the probe decodes, PCM packets are measured by their bytes."""
    data = growing_pcm(9, 240)
    real = decoded_seconds(data)
    assert real > 1000
    assert probe_audio(data).duration == pytest.approx(real, rel=0.01)


def test_timestamps_that_overstate_are_bounded_by_what_the_packets_can_hold() -> None:
    """A container whose timestamps claim hours while its packets hold seconds was probed as
    hours: charged so at submit and counted so in every backlog (every other key's predicted
    wait, and a queue that read as full), refunded at the end. Now the packets bound it: each
    holds at most its codec's frame (FLAC: a 64 Ki-sample block; PCM: a byte a sample)."""
    flac = lying_matroska(JFK, 1, 14000.0)
    assert decoded_seconds(flac) == pytest.approx(11.0, abs=0.1)
    assert 11.0 <= probe_audio(flac).duration <= 200
    pcm = growing_pcm(0, 1)  # one packet of 80,000 samples (5 s), its timestamps rewritten
    with av.open(io.BytesIO(pcm)) as source:
        template = source.streams.audio[0]
        packets = [bytes(packet) for packet in source.demux(template) if packet.size]
        out_buffer = io.BytesIO()
        with av.open(out_buffer, "w", format="matroska") as out:
            stream = out.add_stream_from_template(template)
            for index, payload in enumerate(packets + packets):
                packet = av.Packet(payload)
                packet.stream, packet.time_base = stream, Fraction(1, 1000)
                packet.pts = packet.dts = index * 7_000_000  # 7000 s apart
                out.mux(packet)
    claimed = out_buffer.getvalue()
    assert decoded_seconds(claimed) == pytest.approx(10.0, abs=0.1)
    assert 10.0 <= probe_audio(claimed).duration <= 20.0  # the bytes: 2 per sample, 1 at least


@pytest.mark.parametrize("name", ["silence", "speech"])
def test_lying_file_fails_audio_too_long_under_the_memory_cap(
        limited: dict, fakes: dict[str, Path], name: str) -> None:
    gateway, worker = limited["gateway"], limited["worker"]
    with PeakRss(worker.pid) as rss:
        reply = submit_file(gateway, fakes[name])
        if reply.status_code == 413:  # refused at submit: the probe's floor saw through it
            assert reply.json()["error"]  # (the decoder's own limit: the test above)
            return
        assert reply.status_code == 200, reply.text
        task_id = reply.json()["taskid"]
        final = wait_done(gateway, task_id, timeout=120)
    assert final["status"] == "FAILED", final
    assert "longer than the limit of 60 s" in final["error"]
    view = http.get(f"{gateway}/v1/tasks/{task_id}", timeout=10).json()
    assert view["error_code"] == "audio_too_long"
    mib = 1024 * 1024
    full_decode_mib = decoded_seconds(fakes[name].read_bytes()) * 16000 * 4 / mib
    print(f"{name}: worker RSS {rss.first / mib:.0f} MiB before, peak {rss.peak / mib:.0f} MiB "
          f"({rss.samples} samples); cap {MEMORY_CAP_MIB} MiB; the whole decode would hold "
          f"{full_decode_mib:.0f} MiB more")
    assert rss.samples > 3 and rss.peak < MEMORY_CAP_MIB * mib
    if name == "silence":  # keeping every sample would have broken the cap
        assert rss.first + full_decode_mib * mib > MEMORY_CAP_MIB * mib
    health = http.get(f"{worker.url}/health", timeout=10).json()
    assert health["loaded_models"] == ["tiny.en"], "the worker went over its cap and unloaded"


def test_sync_caller_gets_413_audio_too_long(limited: dict, fakes: dict[str, Path]) -> None:
    with fakes["speech"].open("rb") as handle:
        reply = http.post(f"{limited['gateway']}/v1/audio/transcriptions",
                           files={"file": ("speech.mkv", handle)}, data={"model": "whisper-1"},
                           timeout=120)
    assert reply.status_code == 413, reply.text
    assert reply.json()["error"]["code"] == "audio_too_long"


def test_duration_is_counted_samples_not_timestamps(limited: dict,
                                                    fakes: dict[str, Path]) -> None:
    final = wait_done(limited["gateway"],
                      submit_file(limited["gateway"], fakes["short"]).json()["taskid"])
    assert final["status"] == "SUCCEEDED", final
    assert 32 < final["result"]["duration"] < 34


def test_a_reference_clips_start_is_decoded_not_the_rest() -> None:
    """A speech task's reference clip is read from its start (XTTS: its first 30 s), and a
    clip allowed up to SPEECH_MAX_AUDIO_SECONDS was decoded whole, for a task charged by its
    text: 14,000 s of lying FLAC took 1.1 GB. Only the start is decoded now."""
    from tests.audio_fakes import variable_flac

    whole = decode_audio(JFK, 16000)
    start = decode_audio(JFK, 16000, first_seconds=5.0)
    assert len(start) == 5 * 16000 and (start == whole[:5 * 16000]).all()
    assert len(decode_audio(JFK, 16000, first_seconds=60.0)) == len(whole)  # shorter: whole
    hours = variable_flac(4, 3500)  # its frames hold ~14,000 s of silence
    before = psutil.Process().memory_info().rss
    assert len(decode_audio(hours, 16000, first_seconds=60.0)) == 60 * 16000
    assert psutil.Process().memory_info().rss - before < 200 * 2**20
