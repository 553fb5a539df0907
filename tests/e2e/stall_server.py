"""`fastserve serve` whose forward pass hangs while a file exists: a stuck device on demand (tests only).

    python -m tests.e2e.stall_server STALL_FILE serve -m MODEL ...     ({pid} in STALL_FILE: this process's id)

The normal build's command line knows nothing of it: this launcher hands serve() a backend factory.
The wait is bounded (MAX_STALL_S) so a forgotten file cannot hold a test machine forever.
"""
from __future__ import annotations

import os
import sys
import time

MAX_STALL_S = 120.0


class StallFileBackend:
    """The CPU backend's forward pass, hanging while `path` exists (the engine samples its logits on the host)."""

    def __init__(self, inner, path: str):
        self._inner = inner
        self._path = path

    def forward(self, tokens, positions, slots, out_rows):
        deadline = time.monotonic() + MAX_STALL_S
        while os.path.exists(self._path) and time.monotonic() < deadline:
            time.sleep(0.01)
        return self._inner.forward(tokens, positions, slots, out_rows)

    def __getattr__(self, name):
        return getattr(self._inner, name)


def main(argv: list[str]) -> int:
    from fastserve import cli
    from fastserve.server import app as server_app

    stall_file, rest = argv[0].replace("{pid}", str(os.getpid())), argv[1:]     # one file per server of a cluster

    def factory(cfg, weights, n_slots, n_ctx_slot):
        from fastserve.backends.cpu.backend import CpuBackend
        return StallFileBackend(CpuBackend(cfg, weights, n_slots, n_ctx_slot), stall_file)

    serve = server_app.serve
    server_app.serve = lambda args: serve(args, backend=factory)
    return cli.main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
