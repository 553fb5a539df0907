"""Issue 17's stall acceptance: a fault-build server stalls its decode loop 300 ms every 50 steps
(FASTSERVE_TEST_STALL_STEP_S + FASTSERVE_TEST_STALL_EVERY_STEPS); `fastserve bench` must show it in the
inter-token figures (max, p99), in the points of its ITL-over-time plot, and in the phase table as time
outside the forward pass (the build phase, where the stall point sits)."""
from __future__ import annotations

import json
import re
import subprocess
import sys
import time

from .conftest import REPO, child_env

STALL_S, EVERY = 0.3, 50


def test_periodic_stall_shows_in_the_bench(fault_build, tiny_model_path, tmp_path):
    log = open(tmp_path / "server.log", "wb")
    server = subprocess.Popen([sys.executable, "-m", "tests.faults.launch", "-m", "fastserve", "serve", "-m",
                               tiny_model_path, "--host", "127.0.0.1", "--port", "0", "-t", "1", "-np", "4",
                               "-c", "1024", "--log-disable"], cwd=REPO, stdout=subprocess.DEVNULL, stderr=log,
                              env=child_env(fault_build, FASTSERVE_TEST_STALL_STEP_S=STALL_S,
                                            FASTSERVE_TEST_STALL_EVERY_STEPS=EVERY))
    try:
        port = None
        deadline = time.monotonic() + 60
        while port is None and time.monotonic() < deadline and server.poll() is None:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", (tmp_path / "server.log").read_text())
            port = int(m.group(1)) if m else time.sleep(0.05)
        assert port, (tmp_path / "server.log").read_text()
        out = tmp_path / "out"
        p = subprocess.run([sys.executable, "-m", "fastserve", "bench", "--url", f"http://127.0.0.1:{port}",
                            "--pid", str(server.pid), "--clients", "4", "--duration", "2", "--warmup", "0.5",
                            "-n", "128", "--prompt-tokens", "8-16", "--probes", "/health", "--plot", str(out),
                            "--json", str(out / "r.json"), "--no-progress"],
                           cwd=REPO, capture_output=True, text=True, timeout=90)
        assert p.returncode == 0, p.stderr + p.stdout
    finally:
        server.terminate()
        server.wait(15)
        log.close()
    f = json.loads((out / "r.json").read_text())["runs"][0]["figures"]
    itl = f["itl_ms"]
    assert itl["max"] >= STALL_S * 1e3 * 0.9 and itl["p99"] >= STALL_S * 1e3 * 0.5, itl
    assert itl["p50"] < STALL_S * 1e3 / 10, itl          # the stall is the tail, not the body
    ph = f["phases"]
    # 300 ms per 50 steps = 6 ms per step in build (host), beside a forward pass of the tiny model
    assert STALL_S * 1e3 / EVERY * 0.7 <= ph["ms_per_step"]["build"] <= STALL_S * 1e3 / EVERY * 2, ph
    assert ph["outside_forward_ms_per_step"] > ph["ms_per_step"]["forward"], ph
    assert "build" in p.stdout and (out / "itl_over_time.png").stat().st_size > 10_000
