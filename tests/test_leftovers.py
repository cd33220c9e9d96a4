"""A test run whose fixtures fail leaves no process it started (issue 12)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from harness.procs import ROOT, wait_until

FAILING_RUN = textwrap.dedent("""
    import subprocess
    import sys
    from pathlib import Path

    from harness import procs

    pids = Path(sys.argv[1])
    redis = procs.RedisServer(pids.parent / "redis").start()
    server = procs.spawn([sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    pids.write_text(f"{redis.proc.pid} {server.pid}")
    raise RuntimeError("a fixture failed half-way")
""")


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = Path(f"/proc/{pid}/stat").read_text().split()[2]
    return status != "Z"


def test_a_failed_run_leaves_no_server_behind(tmp_path: Path) -> None:
    pid_file = tmp_path / "pids"
    run = subprocess.run([sys.executable, "-c", FAILING_RUN, str(pid_file)], cwd=ROOT,
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         timeout=60)
    assert run.returncode != 0 and "a fixture failed half-way" in run.stderr
    pids = [int(pid) for pid in pid_file.read_text().split()]
    assert len(pids) == 2
    try:
        wait_until(lambda: not any(alive(pid) for pid in pids), 10, "leftover processes to end")
    finally:  # if the guard failed, do not leave them running either
        for pid in filter(alive, pids):
            os.kill(pid, signal.SIGKILL)
