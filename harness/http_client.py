"""The one HTTP client of the tests and the harness: keep-alive connections, thread-safe.

`httpx.get()` and its siblings build a client per call, and with it a TLS context (the CA
bundle parsed: ~30 ms of CPU) even for plain http://, so a loop polling a status 20 times a
second spent over half a core on that alone. Idle connections are dropped after 1 s, well
before uvicorn's 5 s keep-alive timeout closes them from the server's side (a request sent
just as the server closes its connection would fail).
"""

from __future__ import annotations

import httpx

http = httpx.Client(timeout=5, limits=httpx.Limits(max_connections=None,
                                                   max_keepalive_connections=64,
                                                   keepalive_expiry=1.0))
