"""A free loopback port for a server a test or a smoke script starts (standard library only:
`python3 -m harness.ports` prints one, for scripts/image.sh and scripts/kube_smoke.sh)."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range: nothing started later takes it
    meanwhile by binding port 0 (a worker's HTTP server) or connecting out (supervisord
    starts the workers before the gateway, and a worker once held the gateway's port)."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    chooser = random.SystemRandom()  # (each test process its own draw, whatever is seeded)
    for _ in range(200):
        port = chooser.randrange(max(1024, low - 12000), max(1025, low))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:  # (a range that is all taken: the kernel's choice)
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


if __name__ == "__main__":
    print(free_port())
