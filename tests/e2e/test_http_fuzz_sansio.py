"""Fuzzing the sans-I/O HTTP layer (fastserve/server/http.py): bytes in, requests and failures out.

Driven as protocol.py drives it: feed what arrived, take requests one at a time, answer each,
start the next cycle. Whatever the bytes and however they are split:
- nothing raises; a failure is a 4xx, and after it the connection takes nothing more;
- every request and every failure gets a response's bytes (never a silent close);
- a body never passes the limit;
- the outcome does not depend on where the bytes were split (TCP may cut them anywhere).
"""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastserve.server.http import HttpRequest, ProtocolFailure, ServerConnection

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
