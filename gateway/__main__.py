"""`python -m gateway`: the gateway launcher (gateway/process/launcher.py), which restarts the
gateway without refusing a connection; with `--serve-fd`, one of its server processes; with
`--single`, one such server process on its own, no launcher (the tests' and benches' gateway,
or a container restarted as a whole)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from common import logs
from common.settings import get_settings
from gateway.process.launcher import Launcher, bind, serve


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gateway", description=__doc__.split("\n")[0])
    settings = get_settings()
    parser.add_argument("--host", default=settings.host, help="default: SPEECH_HOST")
    parser.add_argument("--port", type=int, default=settings.port, help="default: SPEECH_PORT")
    parser.add_argument("--processes", type=int, default=1)
    parser.add_argument("--state-file", type=Path)
    parser.add_argument("--log-level", default="warning", help="uvicorn's log level")
    parser.add_argument("--single", action="store_true",
                        help="serve in this process, without the launcher (no reloads)")
    parser.add_argument("--serve-fd", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve_fd is not None:
        serve(args.serve_fd, args.ready_fd, args.log_level)
        return 0
    if args.single:
        sock = bind(args.host, args.port)
        serve(sock.detach(), None, args.log_level)
        return 0
    logs.configure("gateway-launcher", os.environ.get("SPEECH_LOG_LEVEL", "INFO").upper())
    sock = bind(args.host, args.port)
    return Launcher(sock, max(1, args.processes), args.state_file, args.log_level).run()


if __name__ == "__main__":
    sys.exit(main())
