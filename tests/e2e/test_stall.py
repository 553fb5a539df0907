"""A decode thread stuck inside forward (tests/e2e/stall_server.py): monitoring still answers
in < 50 ms from the snapshot, /health turns 503 after --stall-limit, running requests end with a clear
error, and the server serves again as soon as the loop moves."""
from __future__ import annotations

import json
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .conftest import wait_until

STALL_LIMIT = 1.0


def _metrics(c) -> dict:
    return {s.name: s.value for fam in text_string_to_metric_families(c.get("/metrics").text)
            for s in fam.samples if not s.labels}


def test_stuck_forward(make_server, tmp_path):
    stall = tmp_path / "stall"
    srv = make_server("-c", "1024", "-np", "4", "--stall-limit", str(STALL_LIMIT), stall_file=str(stall))
    body = {"prompt": "stuck", "n_predict": 50, "temperature": 0}
    outcome: dict = {}
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        assert c.post("/completion", json=body).status_code == 200
        assert c.get("/health").status_code == 200

        def streaming():
            t0 = time.monotonic()
            with httpx.Client(base_url=srv.url, timeout=30) as cc:
                with cc.stream("POST", "/completion", json={**body, "stream": True}) as r:
                    outcome["stream_status"] = r.status_code
                    outcome["stream_events"] = [json.loads(x[6:]) for x in r.iter_lines() if x.startswith("data: ")]
            outcome["stream_s"] = time.monotonic() - t0

        def blocking():
            t0 = time.monotonic()
            with httpx.Client(base_url=srv.url, timeout=30) as cc:
                r = cc.post("/v1/completions", json={"prompt": "stuck", "max_tokens": 50})
            outcome["plain"] = (r.status_code, r.json())
            outcome["plain_s"] = time.monotonic() - t0

        stall.touch()
        threads = [threading.Thread(target=f) for f in (streaming, blocking)]
        for t in threads:
            t.start()
        t_stall = time.monotonic()
        # the decode thread is now stuck in forward; monitoring answers from the snapshot at once
        worst = 0.0
        while time.monotonic() - t_stall < STALL_LIMIT * 0.6:
            for path in ("/health", "/slots", "/metrics"):
                t0 = time.monotonic()
                r = c.get(path)
                worst = max(worst, time.monotonic() - t0)
                assert r.status_code == 200, (path, r.text)
            time.sleep(0.05)
        assert worst < 0.05, worst
        # past the stall limit: 503 with the reason, the stall in /metrics, requests ended with an error
        r = wait_until(lambda: (lambda r: r if r.status_code == 503 else None)(c.get("/health")), 3)
        assert r and "stalled" in r.json()["error"]["message"]
        assert time.monotonic() - t_stall > STALL_LIMIT - 0.2      # the heartbeat stopped just before t_stall
        for path in ("/slots", "/metrics"):
            t0 = time.monotonic()
            assert c.get(path).status_code == 200 and time.monotonic() - t0 < 0.05
        m = _metrics(c)
        assert m["fastserve_decode_stalled"] == 1 and m["fastserve_seconds_since_last_step"] > STALL_LIMIT
        assert m["fastserve_decode_stalls_total"] >= 1
        for t in threads:
            t.join(10)
        assert outcome["stream_status"] == 200
        assert "stalled" in outcome["stream_events"][-1]["error"]["message"]
        assert outcome["plain"][0] == 503 and "stalled" in outcome["plain"][1]["error"]["message"]
        assert outcome["stream_s"] < STALL_LIMIT + 1.5 and outcome["plain_s"] < STALL_LIMIT + 1.5
        t0 = time.monotonic()
        r = c.post("/completion", json=body)                     # refused at once while stalled
        assert r.status_code == 503 and time.monotonic() - t0 < 0.5
        # the loop moves again: healthy, and serving
        stall.unlink()
        assert wait_until(lambda: c.get("/health").status_code == 200, 3)
        r = c.post("/completion", json=body)
        assert r.status_code == 200 and r.json()["tokens_predicted"] == 50
        assert wait_until(lambda: "decode loop moves again" in srv.log(), 3)
        # stuck again, with a request running: SIGTERM still exits 0 within 3 s
        stall.touch()
        runner = threading.Thread(target=lambda: httpx.post(srv.url + "/completion", json=body, timeout=30))
        runner.start()
        assert wait_until(lambda: c.get("/metrics").status_code == 200 and
                          _metrics(c)["fastserve_requests_running"] + _metrics(c)["fastserve_requests_waiting"] >= 1, 3)
    rc, dt = srv.stop()
    runner.join(10)
    assert rc == 0 and dt < 3.0, (rc, dt)
