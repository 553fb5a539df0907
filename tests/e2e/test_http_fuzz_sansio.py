"""Fuzzing the sans-I/O HTTP layer (fastserve/server/http.py): bytes in, requests and failures out.

Driven as protocol.py drives it: feed what arrived, take requests one at a time, answer each,
start the next cycle. Whatever the bytes and however they are split:
- nothing raises; a failure is a 4xx, and after it the connection takes nothing more;
- every request and every failure gets a response's bytes (never a silent close);
- a body never passes the limit;
- the outcome does not depend on where the bytes were split (TCP may cut them anywhere).
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastserve.server.http import HttpRequest, ProtocolFailure, ServerConnection

from .conftest import REPO_ROOT
from .http_grammar import split, streams

BODY_LIMIT = 1024
FUZZ = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


def drive(pieces: list[bytes], eof: bool) -> list:
    """The outcome of one connection: [("request", method, target, headers, body) | ("failure", status)]."""
    c = ServerConnection(BODY_LIMIT)
    out: list = []
    for piece in pieces + ([b""] if eof else []):
        c.receive(piece)
        while True:
            item = c.next_request()
            if item is None:
                break
            if isinstance(item, ProtocolFailure):
                assert 400 <= item.status < 500, item
                data = c.respond(item.status, [("content-type", "application/json")], b'{"error":"x"}')
                assert data.startswith(b"HTTP/1.1 %d " % item.status), (item, data)
                assert not c.next_cycle() and c.next_request() is None
                out.append(("failure", item.status))
                return out
            assert isinstance(item, HttpRequest)
            assert len(item.body) <= BODY_LIMIT
            out.append(("request", item.method, item.target, item.headers, item.body))
            data = c.respond(200, [("content-type", "text/plain")], b"ok")
            assert data.startswith(b"HTTP/1.") and b" 200 " in data[:16], (item, data)
            if not c.next_cycle():
                return out
    return out


@FUZZ
@given(data=st.data(), stream=streams(), eof=st.booleans())
def test_any_bytes_any_split(data, stream, eof):
    whole = drive([stream], eof)
    assert drive(data.draw(split(stream)), eof) == whole


@FUZZ
@given(stream=streams())
def test_byte_by_byte_is_the_same_as_all_at_once(stream):
    assert drive([stream[i:i + 1] for i in range(len(stream))], False) == drive([stream], False)


def test_head_gets_its_head():
    """HEAD: the status and headers of the GET answer, no body (h11 refuses a body for HEAD)."""
    out = drive([b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\nGET /health HTTP/1.1\r\nHost: x\r\n\r\n"], False)
    assert [o[1] for o in out] == ["HEAD", "GET"]


def test_connect_is_refused_whatever_follows():
    """CONNECT (a proxy's tunnel; h11 would take a 2xx to it as a switch of protocol) is a 405, and the
    connection takes nothing more (the input atheris found: a CONNECT, then another request)."""
    stream = (b"CONNECT x HTTP/1.1\r\nHost: x\r\n\r\nPOST /a HTTP/1.1\r\nHost: x\r\n\r\n")
    assert drive([stream], False) == [("failure", 405)]
    assert drive([stream[:9], stream[9:]], True) == [("failure", 405)]


def test_atheris_coverage_guided(tmp_path):
    """The same checks, inputs found by atheris (libFuzzer's coverage guidance) for a few seconds."""
    import subprocess
    import sys
    from importlib.util import find_spec

    if find_spec("atheris") is None:
        pytest.skip("atheris is not installed here (it installs with the test extras on Linux x86-64): "
                    "the hypothesis fuzz above ran without it")
    from .atheris_http import write_seeds

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    write_seeds(str(corpus))
    # -rss_limit_mb=0: libFuzzer reads the peak RSS, which Linux carries over exec from this (large) process
    r = subprocess.run([sys.executable, "-m", "tests.e2e.atheris_http", "-atheris_runs=30000",
                        "-max_total_time=12", "-rss_limit_mb=0", str(corpus)],
                       cwd=str(REPO_ROOT), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Done" in r.stderr, r.stderr[-3000:]
