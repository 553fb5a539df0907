"""A grammar or JSON schema is compiled off the event loop: a slow compile delays only its own request.

The compile is made slow on purpose (a hook around the compiler that sleeps, as llguidance's compiler
does its work: without the GIL), so the bound does not depend on how fast this machine compiles a big
schema. On the loop, the sleep would hold /health and every other stream for its whole length.
"""
from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

import fastserve.engine
from .killed_streams import InProcessServer, request_bytes
from .test_misbehaving_clients import _metric

SLOW_S = 1.5          # how long the hook makes every compile take
BOUND_S = 0.5         # the most /health or another stream may wait meanwhile (the loop is shared by all)
GRAMMAR = 'root ::= "<" [a-z]{2,5} ">"'


@pytest.fixture(scope="module")
def srv(tiny_model):
    with InProcessServer(tiny_model, n_parallel=2, n_ctx=16384, timeout=20, metrics=True) as s:
        yield s


def _hook(monkeypatch, delay: float) -> list:
    """Every compile of a grammar or schema takes `delay` s longer; returns the names of the threads they ran in."""
    real = fastserve.engine.compile_grammar
    threads = []

    def slow(**kw):
        if any(v is not None for v in kw.values()):         # a constraint to compile, not "none given"
            threads.append(threading.current_thread().name)
            time.sleep(delay)
        return real(**kw)

    monkeypatch.setattr(fastserve.engine, "compile_grammar", slow)
    return threads


@pytest.fixture
def slow_compile(monkeypatch):
    return _hook(monkeypatch, SLOW_S)


@pytest.fixture
def compiles(monkeypatch):
    return _hook(monkeypatch, 0.0)


def _stream(url: str, arrivals: list, stop: threading.Event) -> None:
    """A long unconstrained stream; each event's arrival time into arrivals, until stop is set."""
    body = {"prompt": "a", "n_predict": 8000, "ignore_eos": True, "temperature": 1.0, "stream": True}
    with httpx.Client(base_url=url, timeout=30) as c, c.stream("POST", "/completion", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                arrivals.append(time.monotonic())
            if stop.is_set():
                return


def test_a_slow_compile_stalls_neither_health_nor_other_streams(srv, slow_compile):
    url = f"http://{srv.host}:{srv.port}"
    arrivals, stop = [], threading.Event()
    streamer = threading.Thread(target=_stream, args=(url, arrivals, stop), daemon=True)
    streamer.start()
    deadline = time.monotonic() + 10
    while len(arrivals) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(arrivals) >= 3, "the unconstrained stream did not start"

    answer = {}

    def constrained():
        t0 = time.monotonic()
        with httpx.Client(base_url=url, timeout=30) as c:
            answer["r"] = c.post("/completion", json={"prompt": "x", "grammar": GRAMMAR, "n_predict": 16,
                                                      "temperature": 1.0, "seed": 3})
        answer["t"] = (t0, time.monotonic())

    health = []
    with httpx.Client(base_url=url, timeout=30) as probe:
        worker = threading.Thread(target=constrained, daemon=True)
        worker.start()
        while worker.is_alive():
            t = time.monotonic()
            assert probe.get("/health").status_code == 200
            health.append(time.monotonic() - t)
            time.sleep(0.05)
    stop.set()
    streamer.join(30)

    r = answer["r"]
    assert r.status_code == 200, r.text
    content = r.json()["content"]
    assert content.startswith("<") and content.endswith(">") and 2 <= len(content) - 2 <= 5, content
    t0, t1 = answer["t"]
    assert t1 - t0 >= SLOW_S, "the slow hook did not run"
    window = [t0] + [t for t in arrivals if t0 <= t <= t1]       # the other stream's events meanwhile
    assert window[-1] - t0 >= SLOW_S, "the other stream did not run through the compile"
    gaps = [b - a for a, b in zip(window, window[1:])]
    assert max(gaps) < BOUND_S, f"the other stream waited {max(gaps):.2f} s during the compile"
    assert len(health) >= 3 and max(health) < BOUND_S, f"/health took up to {max(health):.2f} s during the compile"
    assert slow_compile and all(name.startswith("fastserve-grammar") for name in slow_compile), slow_compile


def test_a_bad_grammar_is_still_a_400_with_the_compilers_message(srv, compiles):
    with httpx.Client(base_url=f"http://{srv.host}:{srv.port}", timeout=30) as c:
        for path, body in (("/completion", {"prompt": "x", "grammar": "root ::= [a-"}),
                           ("/completion", {"prompt": "x", "json_schema": {"type": "object", "properties": 3}}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                     "response_format": {"type": "json_schema", "json_schema": {
                                                         "name": "n", "schema": {"type": "nope"}}}})):
            r = c.post(path, json=body)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["message"].startswith("invalid "), err
    assert len(compiles) == 3 and all(t.startswith("fastserve-grammar") for t in compiles), compiles   # the worker


def test_n_choices_share_one_compile(srv, compiles):
    """n > 1 choices of one constrained request: one compile, a matcher copy per choice, each output valid."""
    with httpx.Client(base_url=f"http://{srv.host}:{srv.port}", timeout=30) as c:
        r = c.post("/v1/completions", json={"prompt": "x", "grammar": GRAMMAR, "n": 3, "max_tokens": 16,
                                            "temperature": 1.0, "seed": 5})
    assert r.status_code == 200, r.text
    texts = [ch["text"] for ch in r.json()["choices"]]
    assert len(texts) == 3 and all(t.startswith("<") and t.endswith(">") for t in texts), texts
    assert len(compiles) == 1


def test_a_client_gone_while_its_grammar_compiles_leaves_nothing(srv, slow_compile):
    """The request never reaches the engine: its compile's result is dropped, no prompt token is computed."""
    assert srv.idle(10)
    before = srv.engine.snapshot
    s = socket.create_connection((srv.host, srv.port), timeout=10)
    s.sendall(request_bytes("/completion", {"prompt": "x", "grammar": GRAMMAR, "n_predict": 64}))
    time.sleep(SLOW_S / 3)              # the compile is under way
    assert slow_compile
    s.close()
    time.sleep(SLOW_S)                  # the compile has ended: nobody is there to take its result
    assert srv.idle(10), (srv.engine.snapshot, srv.app.inflight)
    after = srv.engine.snapshot
    assert (after.tokens_prompt, after.tokens_generated) == (before.tokens_prompt, before.tokens_generated)
    with httpx.Client(base_url=f"http://{srv.host}:{srv.port}", timeout=30) as c:
        assert not any(slot["is_processing"] for slot in json.loads(c.get("/slots").text))


def test_shutdown_during_a_compile_answers_at_once(tiny_model, slow_compile):
    """SIGTERM's path (Server.stop) while a grammar compiles: the request ends with 503 (or its connection is
    dropped) at once, not after the compile, and the server's loop is gone well before the compile ends."""
    answer = {}
    with InProcessServer(tiny_model, n_parallel=1, n_ctx=1024) as s:
        def constrained():
            try:
                with httpx.Client(base_url=f"http://{s.host}:{s.port}", timeout=30) as c:
                    answer["status"] = c.post("/completion", json={"prompt": "x", "grammar": GRAMMAR}).status_code
            except httpx.TransportError as exc:
                answer["status"] = type(exc).__name__
            answer["t"] = time.monotonic()

        worker = threading.Thread(target=constrained, daemon=True)
        worker.start()
        deadline = time.monotonic() + 10
        while not slow_compile and time.monotonic() < deadline:
            time.sleep(0.01)
        assert slow_compile, "the compile did not start"
        t_stop = time.monotonic()
        s.loop.call_soon_threadsafe(s.server.stop)
        s._thread.join(SLOW_S)
        t_loop_gone = time.monotonic()
        assert not s._thread.is_alive(), "the server's loop waited for the compile"
        s.loop = None                   # stopped already: the context's exit has no loop to tell
        worker.join(10)
    assert answer["status"] in (503, "RemoteProtocolError", "ReadError"), answer
    assert answer["t"] - t_stop < SLOW_S / 2 and t_loop_gone - t_stop < SLOW_S / 2, (answer, t_loop_gone - t_stop)


@pytest.mark.parametrize("limit, status, words", [("queue_timeout", 503, "queue limit"),
                                                  ("request_timeout", 504, "time limit")])
def test_a_compile_counts_against_the_requests_limits(srv, slow_compile, limit, status, words):
    """The wait for a compile is the request's time too: a compile longer than its queue or total limit
    ends the request with that limit's error when the limit runs out, not after the compile."""
    assert srv.idle(10)
    with httpx.Client(base_url=f"http://{srv.host}:{srv.port}", timeout=30) as c:
        kind = {"queue_timeout": "queue", "request_timeout": "total"}[limit]
        before = _metric(c, "fastserve_deadlines_expired_total", kind=kind)
        t0 = time.monotonic()
        r = c.post("/completion", json={"prompt": "x", "grammar": GRAMMAR, "n_predict": 8, limit: 0.3})
        dt = time.monotonic() - t0
        assert r.status_code == status and words in r.json()["error"]["message"] and "grammar" in r.text, r.text
        assert 0.3 <= dt < SLOW_S, dt
        assert _metric(c, "fastserve_deadlines_expired_total", kind=kind) == before + 1



def test_the_total_limit_runs_from_arrival_through_the_compile(srv, monkeypatch):
    """A 0.5 s compile, then a generation far longer than the rest of a 0.6 s total limit: the 504 comes
    at 0.6 s from arrival, not 0.6 s after the compile (1.1 s: the bound leaves a busy 2-core box 0.35 s)."""
    _hook(monkeypatch, 0.5)
    assert srv.idle(10)
    with httpx.Client(base_url=f"http://{srv.host}:{srv.port}", timeout=30) as c:
        t0 = time.monotonic()
        r = c.post("/completion", json={"prompt": "x", "grammar": 'root ::= [a-z]+', "n_predict": 8000,
                                        "ignore_eos": True, "request_timeout": 0.6})
        dt = time.monotonic() - t0
    assert r.status_code == 504 and "time limit" in r.json()["error"]["message"], r.text
    assert 0.6 <= dt < 0.95, dt
