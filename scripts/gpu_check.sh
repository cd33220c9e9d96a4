#!/usr/bin/env bash
# Checks that need a CUDA GPU, which CI (CPU only) cannot run. One function per engine;
# each prints PASS/FAIL lines and returns non-zero on a failure.
#
#   scripts/gpu_check.sh              # every section
#   scripts/gpu_check.sh parakeet     # some sections
#
# Each section uses its engine's .venvs/NAME when present (it must hold a CUDA torch there),
# else $PYTHON (default python3) with the engine's packages installed.
set -euo pipefail
cd "$(dirname "$0")/.."

python_for() {
    if [ -x ".venvs/$1/bin/python" ]; then echo ".venvs/$1/bin/python"; else echo "${PYTHON:-python3}"; fi
}

# Parakeet (NeMo): bf16 cast after local attention leaves no fp32 islands, decoding is
# deterministic with and without the CUDA-graph decoder, and a file over the per-process
# memory cap fails with the clear error, after which the worker still decodes.
# PARAKEET_MODEL: a .nemo to check (default: the tiny model, built if missing).
# PARAKEET_DEVICE=cpu: dry run of the non-CUDA parts (forced bf16, no memory cap).
check_parakeet() {
    local py model
    py=$(python_for nemo)
    model=${PARAKEET_MODEL:-models/tiny/parakeet/parakeet-tiny.nemo}
    if [ ! -f "$model" ]; then
        "$py" scripts/tiny_models/parakeet.py --out "$(dirname "$model")" >/dev/null 2>&1
    fi
    echo "== parakeet ($py, $model)"
    PARAKEET_DEVICE=${PARAKEET_DEVICE:-cuda} "$py" - "$model" tests/audio/jfk.flac <<'PY'
import os, sys, time
import numpy as np
import torch
from common.audio import decode_audio
from common.schemas import TranscriptionOptions
from common.settings import get_settings
from workers.engines.base import ModelRef
from workers.engines.parakeet import ParakeetEngine
from workers.memory import is_out_of_memory

model, clip = sys.argv[1], sys.argv[2]
device = os.environ["PARAKEET_DEVICE"]
failed = []

def check(name, ok, detail=""):
    print(("PASS " if ok else "FAIL ") + name + (f" ({detail})" if detail else ""), flush=True)
    if not ok:
        failed.append(name)

if device == "cuda" and not torch.cuda.is_available():
    sys.exit("FAIL parakeet: torch sees no CUDA device")
audio = decode_audio(clip, 16000) if os.path.exists(clip) else \
    np.random.default_rng(0).normal(0, 0.1, 16000 * 11).astype(np.float32)
options = TranscriptionOptions(word_timestamps=True)

def run(engine, handle):
    result = engine.transcribe(handle, audio, options, lambda segment: None)
    return result.to_result("parakeet", "check", with_words=True)

results = {}
for graphs in (True, False):
    engine = ParakeetEngine(get_settings(), cuda_graphs=graphs,
                            dtype=None if device == "cuda" else "bfloat16")
    started = time.perf_counter()
    handle = engine.load(ModelRef("check", model), device)
    engine.warm_up(handle)
    print(f"     load + warm-up {time.perf_counter() - started:.1f} s (cuda graphs {graphs})")
    asr = handle.model
    islands = [f"{part}.{name}" for part in ("encoder", "decoder", "joint")
               for name, t in [*getattr(asr, part).named_parameters(),
                               *getattr(asr, part).named_buffers()]
               if t.is_floating_point() and t.dtype != torch.bfloat16]
    check("bf16 with no fp32 islands", not islands, ", ".join(islands[:5]))
    check("local attention", asr.encoder.self_attention_model == "rel_pos_local_attn"
          and list(asr.encoder.att_context_size) == [128, 128])
    check("eval mode everywhere", not any(m.training for m in asr.modules()))
    started = time.perf_counter()
    first, second = run(engine, handle), run(engine, handle)
    print(f"     transcribe {(time.perf_counter() - started) / 2:.3f} s per call")
    check(f"deterministic (cuda graphs {graphs})", first == second)
    results[graphs] = first
    if graphs:
        kept = (engine, handle)
    else:
        del engine, handle, asr
check("same result with and without cuda graphs", results[True] == results[False])

if device == "cuda":
    engine, handle = kept
    engine.window_seconds = 3 * 3600.0  # one window: the whole file has to fit under the cap
    torch.cuda.empty_cache()
    baseline = torch.cuda.memory_allocated()
    cap = baseline + 256 * 2**20
    torch.cuda.set_per_process_memory_fraction(cap / torch.cuda.get_device_properties(0).total_memory)
    long_audio = np.random.default_rng(1).normal(0, 0.1, 16000 * 3600).astype(np.float32)
    try:
        engine.transcribe(handle, long_audio, options, lambda segment: None)
        check("over-cap file fails clearly", False, "no error under a 256 MiB margin")
    except Exception as exc:  # torch.OutOfMemoryError; the runtime turns it into the clear error
        check("over-cap file raises an out-of-memory error", is_out_of_memory(exc), repr(exc))
    torch.cuda.empty_cache()  # what the runtime does after the error
    leaked = torch.cuda.memory_allocated() - baseline
    check("memory returned after the error", leaked < 16 * 2**20, f"{leaked / 2**20:.1f} MiB")
    check("still decodes under the cap", run(engine, handle) == results[True])
    torch.cuda.set_per_process_memory_fraction(1.0)

sys.exit(1 if failed else 0)
PY
}

# faster-whisper: device auto picks cuda, compute type auto picks float16, the CTranslate2
# allocator bound is set before the model exists, and jfk.flac still transcribes.
check_faster_whisper() {
    local py
    py=$(python_for core)
    echo "== faster-whisper ($py)"
    SPEECH_MEMORY_CAP_MIB=${SPEECH_MEMORY_CAP_MIB:-2048} "$py" - tests/audio/jfk.flac <<'PY'
import os, sys
from common.settings import get_settings
from workers import memory
memory.configure_ctranslate2_allocator(get_settings().memory_cap_mib)
from common.audio import decode_audio
from common.schemas import TranscriptionOptions
from workers.engines.base import ModelRef
from workers.engines.faster_whisper import FasterWhisperEngine
engine = FasterWhisperEngine(get_settings())
ok = engine.cuda_available()
print(("PASS" if ok else "FAIL"), "CTranslate2 sees a CUDA device")
handle = engine.load(ModelRef("tiny.en", "bundled"), "cuda")
ok &= handle.model.compute_type == "float16"
print(("PASS" if handle.model.compute_type == "float16" else "FAIL"), "float16 on cuda")
ok &= os.environ.get("CT2_CUDA_CACHING_ALLOCATOR_CONFIG", "").count(",") == 3
text = engine.transcribe(handle, decode_audio(sys.argv[1]), TranscriptionOptions(), print).text
ok &= "country" in text
print(("PASS" if "country" in text else "FAIL"), "transcribes:", text)
sys.exit(0 if ok else 1)
PY
}

# The runtime's torch cap (qwen3, vibevoice, parakeet, xtts): past the fraction torch raises,
# the runtime classifies it as the memory-limit error, and the cache is handed back.
check_torch_cap() {
    local py
    py=$(python_for hf)
    echo "== torch memory cap ($py)"
    "$py" - <<'PY'
import sys
import torch
from workers import memory
memory.apply_torch_cap(512)
failed = False
try:
    torch.empty(1024 * 2**20, dtype=torch.uint8, device="cuda")  # 1 GiB > the 512 MiB cap
    print("FAIL allocation past the cap succeeded"); failed = True
except Exception as exc:  # torch.OutOfMemoryError
    ok = memory.is_out_of_memory(exc)
    print(("PASS" if ok else "FAIL"), "over-cap allocation refused:", type(exc).__name__)
    failed |= not ok
memory.release(True)
reserved = torch.cuda.memory_reserved() / 2**20
print(("PASS" if reserved < 64 else "FAIL"), f"cache returned ({reserved:.0f} MiB reserved)")
sys.exit(1 if failed or reserved >= 64 else 0)
PY
}

# The device memory broker's CUDA-only parts: with no SPEECH_DEVICE_MEMORY_MIB the budget is
# the card's total from the driver, and a load's peak is torch's max_memory_reserved since
# the reset (what the next reservation of that model is sized by).
check_device_broker() {
    local py
    py=$(python_for hf)
    echo "== device memory broker ($py)"
    "$py" - <<'PY'
import sys
import torch
from workers import memory
total = memory.device_total_mib("cuda", uses_torch=True)
driver = torch.cuda.get_device_properties(0).total_memory // 2**20
ok_total = total == driver and total > 0
print(("PASS" if ok_total else "FAIL"), f"budget default = card total ({total} MiB, driver {driver})")
memory.reset_peak(True, "cuda")
block = torch.empty(512 * 2**20, dtype=torch.uint8, device="cuda")  # 512 MiB
del block
peak = memory.peak_mib(True, "cuda")
ok_peak = 500 <= peak <= 700
print(("PASS" if ok_peak else "FAIL"), f"peak of a 512 MiB load measured as {peak:.0f} MiB")
memory.release(True)
sys.exit(0 if ok_total and ok_peak else 1)
PY
}

# Cross-request batching on the GPU (bench/batching.py --device cuda): throughput and
# p50/p99 against the batch size per backend, every batch size's texts identical to B=1's
# (greedy), and one stream's latency with batching on within 2 % of off. The rows go to
# bench/README.md (*Cross-request batching*). FW_MODEL / QWEN3_MODEL / PARAKEET_MODEL: the
# checkpoints to measure (defaults: bundled tiny.en and the tiny checkpoints).
check_batching() {
    local failed=0 backend py source out
    for backend in faster-whisper parakeet qwen3; do
        case $backend in
            faster-whisper) py=$(python_for core); source=${FW_MODEL:-bundled} ;;
            parakeet) py=$(python_for nemo)
                source=${PARAKEET_MODEL:-models/tiny/parakeet/parakeet-tiny.nemo} ;;
            qwen3) py=$(python_for hf); source=${QWEN3_MODEL:-models/tiny/qwen3} ;;
        esac
        echo "== batching: $backend ($py, $source)"
        out=$("$py" bench/batching.py --backend "$backend" --source "$source" --device cuda \
            --tasks 32 --sizes 1,2,4,8,16 2>&1) || { echo "$out"; echo "FAIL $backend bench"; failed=1; continue; }
        echo "$out"
        "$py" - "bench/results/batching-$backend-cuda.json" <<'PY' || failed=1
import json, sys
found = json.load(open(sys.argv[1]))
ok = True
for row in found["sizes"]:
    same, total = map(int, row["same_text"].split("/"))
    good = same == total and row["succeeded"] == row["tasks"]
    print(("PASS" if good else "FAIL"), f"B<={row['batch_max']}: {row['same_text']} same text")
    ok &= good
ratio = found["one_stream"]["paired_ratio"]
print(("PASS" if ratio <= 1.02 else "FAIL"), f"one stream on/off paired latency ratio {ratio}")
sys.exit(0 if ok and ratio <= 1.02 else 1)
PY
    done
    return $failed
}

known=(faster_whisper torch_cap parakeet device_broker batching)
sections=("$@")
[ ${#sections[@]} -eq 0 ] && sections=("${known[@]}")
status=0
for section in "${sections[@]}"; do
    name="${section//-/_}"
    if ! declare -F "check_$name" >/dev/null; then
        echo "gpu_check: no section '$section'; the sections: ${known[*]}" >&2
        status=2
        continue
    fi
    "check_$name" || status=1
done
exit $status
