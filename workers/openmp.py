"""OpenMP's wait policy for the engine's threads, chosen before any engine library loads
(libgomp and Intel's OpenMP read it once, as they load).

PASSIVE puts a thread to sleep as soon as its parallel region ends; the libraries' own default
spins for a while first (libgomp ~300 000 turns, a few ms; Intel's 200 ms). On cores that
several workers, the gateway and Redis share, spinning threads take them from the others;
alone on a host, the spin is what wakes the next region at once. Measured on 2 vCPU (bench/
README.md, "OpenMP's wait policy"): one stream is 1.5-4 % faster with the default, three busy
workers do as many tasks or 1-3 % more with PASSIVE. So `auto` lets a worker that knows it is
the host's only one (SPEECH_HOST_WORKERS=1, which scripts/run_stack.sh counts) keep the
library's default, and makes every other one PASSIVE; an operator's own OMP_WAIT_POLICY stands.
"""

from __future__ import annotations

import os

PASSIVE = "passive"
LIBRARY = "library"  # the library's own default: spin a while, then sleep


def configure(policy: str, host_workers: int) -> str:
    """Set or clear OMP_WAIT_POLICY for `policy` (auto | passive | library) and return what
    the engine runs with: "passive", "library", or the operator's value under auto (in
    lower case: a re-exec'd worker finds its own PASSIVE there and says the same)."""
    if policy == "auto":
        if os.environ.get("OMP_WAIT_POLICY"):
            return os.environ["OMP_WAIT_POLICY"].lower()
        policy = LIBRARY if host_workers == 1 else PASSIVE
    if policy == PASSIVE:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        os.environ.pop("OMP_WAIT_POLICY", None)
    return policy
