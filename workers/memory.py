"""Measuring and bounding a worker's own memory, and handing freed memory back.

CUDA-only calls are kept here, small and isolated; everything else runs on any device.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import sys
from typing import Any

import psutil
from redis.exceptions import RedisError

MIB = 1024 * 1024


def configure_ctranslate2_allocator(cap_mib: int) -> None:
    """Bound CTranslate2's CUDA caching allocator; must run before the model is created."""
    os.environ.setdefault("CT2_CUDA_ALLOCATOR", "cub_caching")
    if cap_mib > 0:
        # bin_growth, min_bin, max_bin, max_cached_bytes: never cache more than a quarter of the cap
        os.environ.setdefault("CT2_CUDA_CACHING_ALLOCATOR_CONFIG",
                              f"4,3,12,{cap_mib * MIB // 4}")


def apply_torch_cap(cap_mib: int) -> None:
    """Make torch raise OutOfMemoryError past `cap_mib` instead of eating a shared GPU."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_mib * MIB / total), 0)


def release(uses_torch: bool) -> None:
    """After each task: collect the task's garbage and hand torch's cache back to the GPU.

    Cheap, because `keep_resident` took the long-lived objects out of the collector's scans.
    """
    gc.collect()
    _empty_torch_cache(uses_torch)


def keep_resident() -> None:
    """After a load: the imports and the model stay, so stop scanning them on every collect
    (a full collect over ~80 k objects costs ~45 ms a task; over the rest, microseconds)."""
    gc.freeze()


def release_all(uses_torch: bool) -> None:
    """After an unload: everything the model held goes back to the OS / driver."""
    gc.unfreeze()
    gc.collect()
    _empty_torch_cache(uses_torch)
    # glibc keeps freed arenas; without this RSS does not fall after an unload
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _empty_torch_cache(uses_torch: bool) -> None:
    torch = sys.modules.get("torch") if uses_torch else None
    if torch is not None and torch.cuda.is_available():
        torch.cuda.empty_cache()


def rss_mib() -> float:
    """This process's resident set, MiB."""
    return round(psutil.Process().memory_info().rss / MIB, 1)


def snapshot(uses_torch: bool, device: str) -> dict[str, Any]:
    memory: dict[str, Any] = {"rss_mib": rss_mib()}
    torch = sys.modules.get("torch") if uses_torch else None
    if device == "cuda" and torch is not None and torch.cuda.is_available():
        memory["gpu_allocated_mib"] = round(torch.cuda.memory_allocated() / MIB, 1)
        memory["gpu_reserved_mib"] = round(torch.cuda.memory_reserved() / MIB, 1)
    elif device == "cuda":
        memory.update(_nvml_process_memory())
    return memory


def used_mib(memory: dict[str, Any], device: str) -> float:
    """The number the cap is compared with: GPU memory on cuda, RSS on cpu."""
    if device == "cuda":
        return float(memory.get("gpu_reserved_mib", memory.get("gpu_used_mib", 0.0)))
    return float(memory["rss_mib"])


def _nvml_process_memory() -> dict[str, Any]:
    try:
        import pynvml
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        pid = os.getpid()
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == pid and proc.usedGpuMemory is not None:
                return {"gpu_used_mib": round(proc.usedGpuMemory / MIB, 1)}
    except pynvml.NVMLError:
        pass
    return {}


def is_out_of_memory(exc: BaseException) -> bool:
    """The process or its device ran out of memory (torch's OutOfMemoryError, CUDA's "out
    of memory"); not Redis's own, which is named alike."""
    if isinstance(exc, RedisError):
        return False
    return isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError" or (
        "out of memory" in str(exc).lower())


def device_total_mib(device: str, uses_torch: bool) -> int:
    """The card's total memory from the driver (0 on cpu, or when no driver answers)."""
    if device != "cuda":
        return 0
    torch = sys.modules.get("torch") if uses_torch else None
    if torch is not None and torch.cuda.is_available():
        return int(torch.cuda.get_device_properties(0).total_memory // MIB)
    try:
        import pynvml

        pynvml.nvmlInit()
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total
                   // MIB)
    except Exception:  # no pynvml, no driver
        return 0


def reset_peak(uses_torch: bool, device: str) -> float:
    """Start measuring a peak (before a load): the MiB in use now, its baseline."""
    torch = sys.modules.get("torch") if uses_torch else None
    if device == "cuda" and torch is not None and torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    elif device != "cuda":
        # Linux: writing 5 resets the process's peak RSS (VmHWM) to its current RSS
        with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    return used_mib(snapshot(uses_torch, device), device)


def peak_mib(uses_torch: bool, device: str) -> float:
    """The most MiB in use since `reset_peak` (GPU on cuda, RSS on cpu)."""
    torch = sys.modules.get("torch") if uses_torch else None
    if device == "cuda" and torch is not None and torch.cuda.is_available():
        return torch.cuda.max_memory_reserved() / MIB
    if device != "cuda":
        with contextlib.suppress(OSError), open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    return used_mib(snapshot(uses_torch, device), device)
