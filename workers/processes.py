"""A process's identity on its host, so that a device reservation outlives a lapsed lease while
the process that holds the memory still exists.

A lease lapses when its holder stops renewing it: dead (its memory is free again), or alive
but not running (SIGSTOPped, swapped out, stalled in a driver call), which still holds every
byte it had. Only its host can tell the two apart, and a card's reservations all come from
one host (the device id carries the host's name). The identity is the pid with the process's
start time (`/proc/PID/stat` field 22, clock ticks since boot), so a pid the kernel hands to a
new process later is not mistaken for the old holder.
"""

from __future__ import annotations

import os


def identity(pid: int | None = None) -> str:
    """"PID:START" of `pid` (default: this process); "" where /proc cannot tell."""
    pid = os.getpid() if pid is None else pid
    fields = _stat(pid)
    return f"{pid}:{fields[19]}" if fields else ""


def alive(process: str) -> bool:
    """Whether the process `identity` named still exists on this host (stopped or not; a
    zombie has let go of its memory)."""
    pid, _, start = process.partition(":")
    if not pid.isdigit() or not start:
        return False
    fields = _stat(int(pid))
    return bool(fields) and fields[19] == start and fields[0] not in ("Z", "X")


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields after the command name (state first), [] if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            line = stat.read()
    except OSError:
        return []
    return line[line.rfind(")") + 2:].split()
