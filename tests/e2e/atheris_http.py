"""Coverage-guided fuzzing of the sans-I/O HTTP layer with atheris (libFuzzer): bytes, cut at points the
fuzzer picks, into ServerConnection as protocol.py feeds it; the checks are test_http_fuzz_sansio's drive().

    python -m tests.e2e.atheris_http -atheris_runs=20000 -max_total_time=20 [corpus dir]
test_http_fuzz_sansio.py runs it for a few seconds in CI (where atheris installs). A failed check
makes libFuzzer print the input and exit non-zero.
"""
from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports(include=["h11", "fastserve.server.http"]):
    import h11  # noqa: F401  (instrumented for coverage)
    from fastserve.server import http  # noqa: F401

from tests.e2e.test_http_fuzz_sansio import drive  # noqa: E402

SEEDS = [b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n",
         b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 11\r\n\r\n{\"a\": \"b\"}\n",
         b"POST /completion HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n0\r\n\r\n",
         b"HEAD / HTTP/1.0\r\n\r\nGET /a HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 1\r\n\r\nx"]


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    eof = fdp.ConsumeBool()
    n_cuts = fdp.ConsumeIntInRange(0, 6)
    cuts = [fdp.ConsumeIntInRange(0, 255) for _ in range(n_cuts)]
    stream = fdp.ConsumeBytes(fdp.remaining_bytes())
    points = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    pieces = [stream[a:b] for a, b in zip(points, points[1:])]
    assert drive(pieces, eof) == drive([stream], eof)


def write_seeds(folder: str) -> None:
    import os
    for i, s in enumerate(SEEDS):
        with open(os.path.join(folder, f"seed{i}"), "wb") as f:
            f.write(b"\x00\x00" + s)        # no EOF, no cuts, then the stream


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
