"""Per-request deadlines (queue time, total time, inter-token stall), the bounded queue (503), and the
stdlib-asyncio twin of the uvloop server."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx

from .conftest import wait_until
from .test_misbehaving_clients import NO_EOG, _metric, _request


def test_deadlines_and_queue(make_server, tmp_path):
    stall = tmp_path / "stall"
    srv = make_server("-c", "65536", "-np", "1", "--max-queue", "1", "--stall-limit", "30",
                      stall_file=str(stall))
    # the holder reads 64 bytes and then nothing: its stream must outlast the checks whatever the socket
    # buffers take (the tiny model decodes thousands of tokens a second)
    long = {"prompt": "hold the slot", "n_predict": 60000, "temperature": 0, "logit_bias": NO_EOG}
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        holder = socket.create_connection((srv.host, srv.port), timeout=10)
        holder.sendall(_request("/completion", {**long, "stream": True}))
        assert holder.recv(64)
        # queue-time limit (per request, shorter than the server's)
        t0 = time.monotonic()
        r = c.post("/completion", json={"prompt": "q", "n_predict": 4, "queue_timeout": 0.3})
        dt = time.monotonic() - t0
        assert r.status_code == 503 and "queue limit" in r.json()["error"]["message"] and 0.3 <= dt < 1.5
        # (the engine counts the cancel it was just sent against --max-queue until its next step drains it)
        assert wait_until(lambda: _metric(c, "fastserve_requests_waiting") == 0, 5)
        # bounded queue: one waits, the next is refused at once
        waiting = threading.Thread(target=lambda: c.post("/completion", json={"prompt": "w", "n_predict": 2}))
        waiting.start()
        assert wait_until(lambda: _metric(c, "fastserve_requests_waiting") == 1, 5)
        with httpx.Client(base_url=srv.url, timeout=10) as c2:
            r = c2.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and "busy" in r.json()["error"]["message"]
        holder.close()
        waiting.join(10)
        assert wait_until(lambda: _metric(c, "fastserve_requests_running") == 0, 5)
        # total-time limit
        t0 = time.monotonic()
        r = c.post("/completion", json={**long, "request_timeout": 0.3})
        assert r.status_code == 504 and "time limit" in r.json()["error"]["message"]
        assert time.monotonic() - t0 < 1.5
        assert wait_until(lambda: _metric(c, "fastserve_requests_running") == 0, 5)
        # inter-token stall limit, streamed: the stream ends with an error event
        with c.stream("POST", "/completion", json={**long, "stream": True, "token_timeout": 0.4}) as r:
            events = []
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(json.loads(line[6:]))
                    if len(events) == 1:
                        stall.touch()
        stall.unlink(missing_ok=True)
        assert "error" in events[-1] and "no token" in events[-1]["error"]["message"], events[-3:]
        assert _metric(c, "fastserve_deadlines_expired_total", kind="token") == 1
        assert _metric(c, "fastserve_deadlines_expired_total", kind="queue") == 1
        assert wait_until(lambda: c.get("/health").status_code == 200, 3)
        # the expired stream's cancel counts against --max-queue 1 until the engine's next step drains it
        assert wait_until(lambda: _metric(c, "fastserve_requests_running") == 0
                          and _metric(c, "fastserve_requests_waiting") == 0, 5)
        assert c.post("/completion", json={"prompt": "ok", "n_predict": 3}).status_code == 200
    assert srv.stop()[0] == 0


def test_asyncio_loop_twin(make_server):
    """The same server on the stdlib event loop: streaming, disconnect, health, shutdown."""
    srv = make_server("-c", "1024", "-np", "2", "--loop", "asyncio")
    with httpx.Client(base_url=srv.url, timeout=30) as c:
        a = c.post("/completion", json={"prompt": "twin", "n_predict": 12, "temperature": 0}).json()["content"]
        with c.stream("POST", "/completion", json={"prompt": "twin", "n_predict": 12, "temperature": 0,
                                                   "stream": True}) as r:
            b = "".join(json.loads(x[6:])["content"] for x in r.iter_lines() if x.startswith("data: "))
        assert a == b
        s = socket.create_connection((srv.host, srv.port), timeout=10)
        s.sendall(_request("/completion", {"prompt": "gone", "n_predict": 900, "stream": True, "logit_bias": NO_EOG}))
        assert s.recv(64)
        s.close()
        assert wait_until(lambda: not any(x["is_processing"] for x in c.get("/slots").json()), 5)
        assert c.get("/health").status_code == 200
    rc, dt = srv.stop()
    assert rc == 0 and dt < 3
