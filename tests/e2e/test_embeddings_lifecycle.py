"""An embedding request's life in a real server on the default model (slow enough to catch it mid-way): a client that
goes away cancels its job (a later request does not wait for it), generations stream while a long job runs, and
SIGTERM in the middle of one exits 0 within 3 s (DESIGN.md contracts 7 and 8)."""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from .conftest import ServerProc

# 16 inputs of ~125 tokens: ~2000 tokens, ~9 s of passes at -b 128 -t 1 on the default model (2-core Zen 2)
BIG = {"input": [f"passage {i}: " + "the quick brown fox jumps over the lazy dog " * 12 for i in range(16)]}


@pytest.fixture
def srv(default_model_file, tmp_path):
    with ServerProc(default_model_file, tmp_path / "server.log", "-c", "2048", "-np", "2", "-b", "128") as p:
        yield p


def _send_raw(srv, path: str, body: dict) -> socket.socket:
    data = json.dumps(body).encode()
    s = socket.create_connection((srv.host, srv.port), timeout=10)
    s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return s


def _timed_small(c: httpx.Client) -> float:
    t0 = time.monotonic()
    r = c.post("/v1/embeddings", json={"input": "a short one"})
    assert r.status_code == 200
    return time.monotonic() - t0


def test_a_client_that_leaves_cancels_its_job(srv):
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        alone = _timed_small(c)
        t0 = time.monotonic()
        c.post("/v1/embeddings", json=BIG)
        whole = time.monotonic() - t0                       # what the big job costs when it runs to the end
        s = _send_raw(srv, "/v1/embeddings", BIG)
        time.sleep(0.5)
        s.close()                                          # gone mid-job
        after = _timed_small(c)
    assert after < alone + whole / 3, (alone, whole, after)


def test_streams_go_on_while_a_long_job_runs(srv):
    with httpx.Client(base_url=srv.url, timeout=120) as c:
        job = threading.Thread(target=lambda: c.post("/v1/embeddings", json=BIG))
        job.start()
        time.sleep(0.3)
        gaps, last = [], time.monotonic()
        with c.stream("POST", "/completion", json={"prompt": "Once upon a time", "n_predict": 24, "stream": True,
                                                   "temperature": 0}) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    now = time.monotonic()
                    gaps.append(now - last)
                    last = now
        running = job.is_alive()
        job.join()
    assert running, "the embedding job ended before the stream: the test shows nothing"
    # one step carries the stream's token and one embedding pass of at most the step's prompt budget
    assert len(gaps) >= 24 and max(gaps[1:]) < 2.0, gaps


def test_sigterm_mid_job_exits_promptly(srv):
    s = _send_raw(srv, "/v1/embeddings", BIG)
    time.sleep(0.5)
    rc, dt = srv.stop()
    s.close()
    assert rc == 0 and dt < 3.0, (rc, dt)
