"""Start-up of `fastserve serve` on the default model: /health answers 200 soon after the process starts,
and the start line tells the load time (by phase) and the resident memory.

The bound is generous for noisy CI machines (issue 10 asks for 1.0 s; bench/bench_start.py measures it
side by side with llama-server)."""
from __future__ import annotations

import re
import time

import httpx
import pytest

from .conftest import ServerProc

START_BOUND_S = 3.0


@pytest.mark.model
def test_default_model_answers_health_soon_after_start(default_model_file, tmp_path):
    t0 = time.monotonic()
    srv = ServerProc(default_model_file, tmp_path / "server.log", "-c", "16384", "-np", "32")
    try:
        with httpx.Client(base_url=srv.url, timeout=10) as c:
            r = c.get("/health")
        took = time.monotonic() - t0
        assert r.status_code == 200
        line = re.search(r"fastserve: loaded \S+ in ([\d.]+) s \(parse ([\d.]+) s, tokenizer ([\d.]+) s, weights "
                         r"([\d.]+) s\); ready ([\d.]+) s after the process started, RSS (\d+) MiB", srv.log())
        assert line, srv.log()
        load, parse, tokenizer, weights, ready, rss = map(float, line.groups())
        # the phases make up the load, the load is part of the start (figures printed to 10 ms)
        assert abs(parse + tokenizer + weights - load) <= 0.03 and load <= ready + 0.01 <= took + 0.06
        assert 50 < rss < 4096
        if weights > 1.0:
            # The weights are still dequantized at load (until issue 10's item 1, products on the mapped
            # blocks, lands): bound everything else now; this branch goes away by itself after that.
            assert took - weights < START_BOUND_S, f"/health 200 {took:.2f} s after the start: {line.group(0)}"
            pytest.xfail(f"the weights took {weights:.2f} s of the {took:.2f} s start: {line.group(0)}")
        assert took < START_BOUND_S, f"/health 200 {took:.2f} s after the start: {line.group(0)}"
        _kv_comes_in(srv)
    finally:
        srv.kill()


def _kv_comes_in(srv) -> None:
    """The KV cache made resident after the start line (its pages faulted in on a thread): RSS holds it
    whole within seconds, so that it does not creep up later as slots reach new positions."""
    coming = re.search(r"the KV cache's (\d+) MiB being made resident", srv.log())
    if not coming:
        return                              # resident before the start line already
    deadline, rss_mib = time.monotonic() + 20, 0.0
    while time.monotonic() < deadline:
        with open(f"/proc/{srv.proc.pid}/status") as f:
            rss_mib = int(re.search(r"VmRSS:\s+(\d+) kB", f.read()).group(1)) / 1024
        if rss_mib >= int(coming.group(1)):
            return
        time.sleep(0.05)
    raise AssertionError(f"RSS {rss_mib:.0f} MiB 20 s after the start, below the KV cache's {coming.group(1)} MiB")


# Imported only by the first request that needs them (or by another command), never by the start.
NOT_AT_START = ("jinja2", "llguidance", "matplotlib", "fastserve.bench", "fastserve.models.catalog", "zipfile", "tempfile")


def _imported(log: str) -> set[str]:
    """The modules a server run with PYTHONPROFILEIMPORTTIME has imported so far (its log's import lines)."""
    return {m.group(1) for m in re.finditer(r"^import time:\s+\d+ \|\s+\d+ \|\s+(\S+)", log, re.M)}


@pytest.mark.model
def test_serve_imports_what_a_request_needs_only_when_one_needs_it(default_model_file, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")      # -X importtime: every import, on the server's stderr
    srv = ServerProc(default_model_file, tmp_path / "server.log", "-c", "1024", "-np", "2")
    try:
        with httpx.Client(base_url=srv.url, timeout=60) as c:
            assert c.get("/health").status_code == 200
            at_start = _imported(srv.log())
            assert "fastserve.engine" in at_start and "uvloop" in at_start       # the log does show imports
            assert not [m for m in at_start if m.split(".")[0] in NOT_AT_START or m.startswith(NOT_AT_START)]
            chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
            assert c.post("/v1/chat/completions", json=chat).status_code == 200
            after_chat = _imported(srv.log())
            assert "jinja2" in after_chat and "llguidance" not in after_chat     # the chat template, compiled now
            schema = {"prompt": "{", "json_schema": {"type": "object"}, "n_predict": 2}
            assert c.post("/completion", json=schema).status_code == 200
            assert "llguidance" in _imported(srv.log())
    finally:
        srv.kill()
