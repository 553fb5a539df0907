"""Requests that end early leave nothing behind (issue 11): after a warm-up, N streams killed with a
reset, half-closed by the client, cancelled while queued, or ended by a stop string leave no object of
the request path alive, and the server's own memory does not grow round after round.

The census tests run the server in this process (tests/e2e/killed_streams.py: the real Engine, App
and Server on a uvloop thread), so that gc sees its objects. The memory test runs `fastserve serve`
on the default model, as the issue measured it; bench/bench_killed_streams.py is its full form
(3 x 1,200 killed streams, and the 32-client bursts).
"""
from __future__ import annotations

import time

import httpx
import pytest

from .conftest import ServerProc
from .killed_streams import InProcessServer, census, kill_streams, rss_mb

ROUNDS, PER_ROUND = 5, 160
ROUND_BAR_MB = 1.0      # a leak grows every round: the median round is judged, so that a one-off
                        # allocator step (an arena or a page of pytest's own, seen once in CI) is not
SETTLE_S = 10.0         # a late-accepted connection's time to end (_left_behind)
NO_EOG = [[0, False], [2, False]]        # the tiny model's end-of-generation tokens banned: runs to n_predict
LONG = {"prompt": "once upon a time", "n_predict": 200, "temperature": 0.8, "stream": True, "logit_bias": NO_EOG}


@pytest.fixture(scope="module")
def srv(tiny_model):
    # 2 slots for 8 clients: most killed requests are still queued when their client goes
    with InProcessServer(tiny_model, n_parallel=2, n_ctx=1024, timeout=20) as s:
        yield s


def _stop_string(srv) -> str:
    """A piece of what the model says at temperature 0, as a stop string that ends the request early."""
    r = httpx.post(f"http://{srv.host}:{srv.port}/completion",
                   json={"prompt": "once upon a time", "n_predict": 24, "temperature": 0, "logit_bias": NO_EOG},
                   timeout=30).json()
    text = r["content"]
    assert len(text) >= 8, r
    return text[4:6]


def _left_behind(srv, base, settle_s: float = SETTLE_S):
    """The request path's objects alive beyond base. A connection the kernel had queued while idle() looked
    (the loop, starved on a busy machine, accepts it later: seen in make test as 2 connections with their
    request) is served and closed within settle_s; a leak is still there after it."""
    deadline = time.monotonic() + settle_s
    while True:
        left = srv.census() - base
        if not left or time.monotonic() > deadline:
            return left
        srv.idle(settle_s)
        time.sleep(0.2)


def _rounds(srv, body: dict, how: str, after_s: float) -> list:
    """RssAnon after a warm-up and after each round, each round's census of the request path."""
    kill_streams(srv.host, srv.port, 16, body=body, how=how, after_s=after_s)
    assert srv.idle(20)
    base = srv.census()
    rows = [rss_mb(field="RssAnon")]
    for _ in range(ROUNDS):
        kill_streams(srv.host, srv.port, PER_ROUND, body=body, how=how, after_s=after_s)
        assert srv.idle(20), (srv.engine.snapshot, len(srv.app.inflight), len(srv.app.connections))
        left = _left_behind(srv, base)
        assert not left, f"after {PER_ROUND} {how} requests, still alive: {dict(left)}"
        rows.append(rss_mb(field="RssAnon"))
    return rows


def _median_growth(rows: list) -> float:
    """The median RssAnon growth of a round after the first (the first settles the allocator)."""
    growth = sorted(b - a for a, b in zip(rows[1:], rows[2:]))
    return growth[len(growth) // 2]


@pytest.mark.parametrize("how", ["rst", "fin"])
def test_killed_streams_leave_nothing(srv, how):
    rows = _rounds(srv, LONG, how, after_s=0.05)
    assert _median_growth(rows) <= ROUND_BAR_MB, f"RssAnon per round {rows} MB"


def test_requests_cancelled_while_queued_leave_nothing(srv):
    # killed at once: with 2 slots and 8 in flight, 6 of every 8 are still waiting for a slot
    rows = _rounds(srv, LONG, "rst", after_s=0.0)
    assert _median_growth(rows) <= ROUND_BAR_MB, rows


def test_requests_ended_by_a_stop_string_leave_nothing(srv):
    body = dict(LONG, stop=[_stop_string(srv)], temperature=0)
    rows = _rounds(srv, body, "read", after_s=0.0)
    assert _median_growth(rows) <= ROUND_BAR_MB, rows
    assert srv.app.metrics.requests_done.values.get(("word",), 0) >= ROUNDS * PER_ROUND


def test_the_census_sees_a_request_left_behind(srv):
    """The census is not blind: an exchange held by someone is found."""
    from fastserve.server.protocol import Exchange
    base = census()
    held = Exchange(None)
    assert (census() - base)["Exchange"] == 1
    del held


def _heap_mappings(pid: int) -> list[dict]:
    """The [heap] (brk) mappings of a process: {"Rss", "AnonHugePages" (kB), "huge_advised"}."""
    out, cur = [], None
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and not parts[0].endswith(":"):
                cur = {} if parts[-1] == "[heap]" else None
                if cur is not None:
                    out.append(cur)
            elif cur is not None and parts[0] in ("Rss:", "AnonHugePages:"):
                cur[parts[0][:-1]] = int(parts[1])
            elif cur is not None and parts[0] == "VmFlags:":
                cur["huge_advised"] = "hg" in parts[1:]
    return out


DEFAULT_BODY = {"prompt": "Write a long story about a dragon who lives in a castle by the sea.", "n_predict": 256,
                "stream": True, "temperature": 0.8}


@pytest.mark.model
def test_killed_streams_do_not_grow_the_server(default_model_file, tmp_path):
    """The default model, -np 8 -c 8192, streams reset 400 ms after they were sent, 8 at a time: the heap
    holds no huge-page advice (the cause of the growth: fastserve/models/hugepages.py), and RssAnon grows
    <= 1 MB a round after the first."""
    srv = ServerProc(default_model_file, tmp_path / "server.log", "-c", "8192", "-np", "8", "--log-disable")
    try:
        kill_streams(srv.host, srv.port, 64, body=DEFAULT_BODY)    # warm-up: slots reach their usual positions
        rows = []
        for _ in range(4):
            kill_streams(srv.host, srv.port, 64, body=DEFAULT_BODY)
            time.sleep(1.0)
            rows.append(rss_mb(srv.proc.pid, "RssAnon"))
        heap = _heap_mappings(srv.proc.pid)
        assert not any(m["huge_advised"] for m in heap), f"huge pages advised on the heap: {heap}"
        assert sum(m.get("AnonHugePages", 0) for m in heap) == 0, heap
        growth = [b - a for a, b in zip(rows, rows[1:])]
        assert max(growth) <= ROUND_BAR_MB, f"RssAnon after each round {rows} MB"
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
        rc, _ = srv.stop()
        assert rc == 0
    finally:
        srv.kill()
