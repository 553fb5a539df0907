"""The standing soak's 3-minute form (bench/soak.py, issue 11): 32 clients on the default model with
random disconnects (RST, FIN, half-close, never-reading), random sampling, slot erases and prompt-cache
hits. No 5xx, no hang, every slot free after, SIGTERM exits 0, and RSS growth bounded.

About 4 minutes (start, warm-up, 3 minutes of load, checks); deselect locally with -m "not soak".
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
MINUTES = 3
# RSS growth from the end of the first window (a tenth of the run, after the warm-up that writes every
# slot's KV) to the end of the load. Measured on the default model (2 busy cores, ~450-500 requests in
# 3 minutes): +10.6 and +14.6 MiB, rising ~4-6 MiB/min; over 30 minutes the rise stopped after ~9 minutes
# at +57 MiB and RSS stayed flat for the 21 minutes after. So 3 minutes cannot tell a bounded rise from
# a leak of ~25 kB a request (issue 11's); this bound (~65 kB a request) catches a gross per-request
# leak, and the 30-minute soak (bench/soak.py) gives the figures.
MAX_RSS_GROWTH_MIB = 32.0


@pytest.mark.soak
@pytest.mark.model
def test_soak_3_minutes(default_model_file, tmp_path):
    out, png = tmp_path / "soak.json", tmp_path / "soak.png"
    # -t 1: make test runs the soak beside the other test files (two at a time); the soak's checks are
    # about what the load leaves behind, which a thread more does not change
    cmd = [sys.executable, str(REPO_ROOT / "bench" / "soak.py"), "--minutes", str(MINUTES), "-m", default_model_file,
           "-t", "1", "--json", str(out), "--plot", str(png)]
    p = subprocess.run(cmd, cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=MINUTES * 60 + 300)
    report = p.stdout + p.stderr[-3000:]
    print(report)                                      # the figures, with -s
    assert out.is_file(), f"the soak wrote no figures:\n{report}"
    r = json.loads(out.read_text())
    assert r["errors_5xx"] == 0 and r["server_5xx"] == 0, report
    assert not r["errors"], report                     # hangs, early ends, lost connections, 4xx
    assert r["completed"] >= 50, report                # the load really ran
    assert r["outcomes"].get("erase", 0) > 0 and r["outcomes"].get("never_read dropped", 0) > 0, report
    assert r["slots_busy_after"] == 0 and r["health_after"] == 200, report
    assert r["health"]["non_200"] == 0, report
    assert r["exit_code"] == 0, report
    growth = r["rss_summary"]["growth_mib"]
    assert growth <= MAX_RSS_GROWTH_MIB, (f"RSS grew {growth:.1f} MiB over {r['requests']} requests "
                                          f"(> {MAX_RSS_GROWTH_MIB} MiB):\n{report}")
    assert p.returncode == 0, report
    assert png.stat().st_size > 0
