"""Fuzzing a running server through real sockets: request lines, headers, chunked bodies, pipelined
requests and random bytes (tests/e2e/http_grammar.py), each cut at random points and sent with
small pauses; slowloris-style trickles beside a healthy client.

Bars: no 5xx (the server's own count by status, and its log), no hang (the server answers or
closes; /health answers at once after every example), no growth (open descriptors back to where
they were, RSS within a few MB over the second half of the run).
"""
from __future__ import annotations

import os
import socket
import time

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from .conftest import ServerProc, wait_until
from .http_grammar import split, streams
from .killed_streams import rss_mb, rst_close

IDLE_S = 0.15           # an answer is over once the server has sent nothing for this long
EXAMPLE_LIMIT_S = 5.0   # more than this for one example is a hang
HEALTH_LIMIT_S = 2.0
SERVER_TIMEOUT_S = 2    # --timeout: a half-sent request is dropped after this


@pytest.fixture(scope="module")
def fuzz_server(tiny_model_path, tmp_path_factory):
    p = ServerProc(tiny_model_path, tmp_path_factory.mktemp("httpfuzz") / "server.log",
                   "-c", "512", "-np", "4", "-n", "2", "--timeout", str(SERVER_TIMEOUT_S))
    yield p
    p.kill()


@pytest.fixture(scope="module")
def client(fuzz_server):
    with httpx.Client(base_url=fuzz_server.url, timeout=10) as c:
        c.get("/health")
        RUN["fds"] = _open_fds(fuzz_server.proc.pid)      # the server at rest, this one connection open
        yield c


def _talk(srv, pieces: list[bytes], pause_s: float) -> bytes:
    """Send pieces with pauses between them; read until the server closes or goes quiet. Asserts no hang."""
    t0 = time.monotonic()
    s = socket.create_connection((srv.host, srv.port), timeout=EXAMPLE_LIMIT_S)
    got = b""
    try:
        for p in pieces:
            try:
                s.sendall(p)
            except OSError:         # the server already answered and closed (a 400 at the first bad byte)
                break
            time.sleep(pause_s)
        s.settimeout(IDLE_S)
        while time.monotonic() - t0 < EXAMPLE_LIMIT_S:
            try:
                data = s.recv(65536)
            except socket.timeout:
                break
            except OSError:
                break
            if not data:
                break
            got += data
        else:
            raise AssertionError(f"the server kept sending for {EXAMPLE_LIMIT_S} s: {got[:300]!r}")
    finally:
        rst_close(s)
    return got


def _samples(c: httpx.Client, name: str) -> dict:
    """{labels tuple: value} of one metric."""
    return {tuple(smp.labels.values()): smp.value for fam in text_string_to_metric_families(c.get("/metrics").text)
            for smp in fam.samples if smp.name == name}


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _healthy(c: httpx.Client) -> None:
    t0 = time.monotonic()
    assert c.get("/health").status_code == 200
    assert time.monotonic() - t0 < HEALTH_LIMIT_S


RUN = {"n": 0, "rss": []}
N_EXAMPLES = 160


@settings(max_examples=N_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                         HealthCheck.function_scoped_fixture],
          derandomize=True)
@given(data=st.data(), stream=streams(), pause_ms=st.sampled_from([0, 0, 1, 5]))
def test_random_streams_never_5xx_nor_hang(fuzz_server, client, data, stream, pause_ms):
    pieces = data.draw(split(stream))
    _talk(fuzz_server, pieces, pause_ms / 1e3)
    _healthy(client)
    RUN["n"] += 1
    if RUN["n"] in (N_EXAMPLES // 2, N_EXAMPLES):
        RUN["rss"].append(rss_mb(fuzz_server.proc.pid))


def test_after_the_fuzz_no_5xx_and_nothing_left(fuzz_server, client):
    codes = {k[0]: v for k, v in _samples(client, "fastserve_http_requests_total").items()}
    assert sum(codes.values()) > N_EXAMPLES / 2, codes        # the examples really were answered
    assert not {k: v for k, v in codes.items() if k.startswith("5")}, codes
    log = fuzz_server.log()
    assert "internal error" not in log and "Traceback" not in log
    # every fuzz connection is closed once the server noticed the reset (or --timeout ran out)
    assert wait_until(lambda: _samples(client, "fastserve_connections")[()] == 1, SERVER_TIMEOUT_S + 3)
    assert _open_fds(fuzz_server.proc.pid) <= RUN["fds"]
    if len(RUN["rss"]) == 2:
        assert RUN["rss"][1] - RUN["rss"][0] < 4.0, RUN["rss"]


def test_slowloris_trickles_are_dropped_and_others_served(fuzz_server, client):
    """8 clients each trickle a request's head a byte every 0.3 s; a healthy client is still served at once,
    and every trickler is answered 408 (or closed) within --timeout plus a tick."""
    head = b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Length: 40\r\n\r\n" + b"x" * 40
    socks = [socket.create_connection((fuzz_server.host, fuzz_server.port), timeout=10) for _ in range(8)]
    t0 = time.monotonic()
    i = 0
    answered = set()
    while len(answered) < len(socks) and time.monotonic() - t0 < SERVER_TIMEOUT_S + 4:
        for k, s in enumerate(socks):
            if k in answered:
                continue
            try:
                s.sendall(head[i:i + 1])
            except OSError:
                answered.add(k)
        i += 1
        r = client.post("/tokenize", json={"content": "hi"}, timeout=HEALTH_LIMIT_S)
        assert r.status_code == 200
        time.sleep(0.3)
        for k, s in enumerate(socks):
            s.setblocking(False)
            try:
                if s.recv(4096) is not None:
                    answered.add(k)
            except BlockingIOError:
                pass
            except OSError:
                answered.add(k)
            s.setblocking(True)
    dt = time.monotonic() - t0
    for s in socks:
        s.close()
    assert len(answered) == len(socks), f"{len(socks) - len(answered)} tricklers still held after {dt:.1f} s"
    assert SERVER_TIMEOUT_S - 0.5 <= dt <= SERVER_TIMEOUT_S + 2
