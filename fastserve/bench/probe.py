"""GET a path every few ms on one kept-alive connection until SIGTERM; write [(t_sent, seconds, status)] as JSON.

Run as a child process (load.Prober starts it), so that the load generator's own busy event loop
adds nothing to the latencies measured. Standard library only (a quick start). t_sent is
time.perf_counter(), CLOCK_MONOTONIC on Linux: the parent's clock too. A failed GET records status 0
and opens a new connection.

Run: python -m fastserve.bench.probe URL PATH EVERY_S OUT.json    (URL: http://host:port)
"""
from __future__ import annotations

import http.client
import json
import signal
import sys
import time
from urllib.parse import urlsplit


def main(url: str, path: str, every: float, out_path: str) -> int:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    u = urlsplit(url if "://" in url else f"http://127.0.0.1:{url}")
    out, conn = [], None
    while not stop:
        t0 = time.perf_counter()
        try:
            conn = conn or http.client.HTTPConnection(u.hostname, u.port or 80, timeout=30)
            conn.request("GET", path)
            r = conn.getresponse()
            r.read()
            out.append((t0, time.perf_counter() - t0, r.status))
        except (OSError, http.client.HTTPException):
            out.append((t0, time.perf_counter() - t0, 0))
            if conn is not None:
                conn.close()
            conn = None
        time.sleep(max(0.0, every - (time.perf_counter() - t0)))
    with open(out_path, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]))
