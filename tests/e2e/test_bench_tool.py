"""Issue 17's acceptance: `fastserve bench --url A --vs B` against fastserve and llama.cpp's llama-server on
the default model, and its tokens/s for fastserve checked against an independent closed-loop client
(bench/httpload.py's raw asyncio sockets, no httpx) on the same load right after.

llama-server: $LLAMA_SERVER, else `llama-server` on PATH, else ../llama-peer/build/bin/llama-server
beside the checkout; without one the test skips, saying why.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

from httpload import HttpTokenizer, ServerProcess, closed_loop, fastserve_command, free_port  # noqa: E402

from fastserve.bench import make_prompts  # noqa: E402

N_PREDICT, SECONDS, WARMUP = 32, 3.0, 1.0


def llama_server() -> str | None:
    for cand in (os.environ.get("LLAMA_SERVER"), shutil.which("llama-server"),
                 str(REPO.parent / "llama-peer" / "build" / "bin" / "llama-server")):
        if cand and os.access(cand, os.X_OK):
            return cand
    return None


@pytest.mark.model
def test_bench_vs_llama_server_agrees_with_an_independent_client(default_model_file, tmp_path):
    binary = llama_server()
    if binary is None:
        pytest.skip("no llama-server: set LLAMA_SERVER=PATH to a llama-server built from llama.cpp's source "
                    "(never committed), or put one on PATH")
    fs_port, ll_port = free_port(), free_port()
    fs = ServerProcess(fastserve_command(default_model_file, fs_port, 8, 4096, 1, "--log-disable"), fs_port,
                       tmp_path / "fastserve.log")
    try:
        ll = ServerProcess([binary, "-m", default_model_file, "--host", "127.0.0.1", "--port", str(ll_port),
                            "-np", "8", "-c", "4096", "-t", "1", "--metrics"], ll_port, tmp_path / "llama.log")
    except BaseException:
        fs.kill()
        raise
    out = tmp_path / "out"
    try:
        p = subprocess.run([sys.executable, "-m", "fastserve", "bench", "--url", f"http://127.0.0.1:{fs_port}",
                            "--vs", f"http://127.0.0.1:{ll_port}", "--pid", str(fs.pid), "--vs-pid", str(ll.pid),
                            "--clients", "1,8", "--duration", str(SECONDS), "--warmup", str(WARMUP),
                            "-n", str(N_PREDICT), "--plot", str(out), "--json", str(out / "r.json"), "--no-progress"],
                           cwd=REPO, capture_output=True, text=True, timeout=120)
        assert p.returncode == 0, p.stderr + p.stdout
        import uvloop
        prompts = make_prompts(HttpTokenizer(fs_port), 64, lo=60, hi=120)
        independent = uvloop.run(closed_loop(fs_port, prompts, 8, SECONDS, WARMUP, N_PREDICT)).result.row()
    finally:
        fs.stop()
        ll.stop()
    r = json.loads((out / "r.json").read_text())
    assert [t["name"] for t in r["targets"]] == ["fastserve", "llama-server"]
    by = {(x["target"], x["level"]["value"]): x["figures"] for x in r["runs"]}
    assert set(by) == {(n, c) for n in ("fastserve", "llama-server") for c in (1, 8)}
    for (name, _), f in by.items():
        assert f["tok_s"] > 0 and not f["errors"] and f["itl_ms"]["p99"] is not None, (name, f)
        assert f["probes"]["/health"]["n"] > 5 and f["rss_mib"]["peak"] > 50, (name, f)
    assert by[("fastserve", 8)]["phases"]["steps"] > 0 and by[("llama-server", 8)]["phases"] is None
    assert r["ab"][1]["figures"]["tok/s"]["ratio"] > 0
    assert all((out / n).stat().st_size > 10_000 for n in ("itl_over_time.png", "concurrency.png", "phases.png"))
    tool = by[("fastserve", 8)]["tok_s"]
    print(f"fastserve at 8 clients: fastserve bench {tool:.1f} tok/s, the independent client {independent['tok_s']:.1f}")
    assert abs(tool / independent["tok_s"] - 1) <= 0.10, (tool, independent)
