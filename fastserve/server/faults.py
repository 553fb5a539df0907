"""Test-only backend wrapper: a forward pass that hangs while a file exists (a stuck device, on demand).

Reached only through the hidden `fastserve serve --test-stall-file PATH` flag; the
engine knows nothing of it. The wait is bounded (MAX_STALL_S) so a forgotten file
cannot hold a test machine forever.
"""
from __future__ import annotations

import os
import time

MAX_STALL_S = 120.0


class StallFileBackend:
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
