"""The HTTP layer without sockets: byte strings into ServerConnection, requests into App routes."""
from __future__ import annotations

import asyncio

import orjson
import pytest

from fastserve.server.app import App
from fastserve.server.config import ServerConfig
from fastserve.server.errors import HttpError
from fastserve.server.http import HttpRequest, ProtocolFailure, ServerConnection
from fastserve.server.protocol import Exchange
from fastserve.server.response import Response, StreamResponse


def _parse_response(data: bytes):
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ")[1])
    headers = dict(line.decode().lower().split(": ", 1) for line in lines[1:])
    return status, headers, body


def test_request_then_keep_alive():
    c = ServerConnection()
    c.receive(b"POST /tokenize?x=1&y= HTTP/1.1\r\nHost: h\r\nContent-Length: 7\r\nX-Api-Key: k\r\n\r\n{\"a\":1}")
    req = c.next_request()
    assert isinstance(req, HttpRequest)
    assert (req.method, req.path, req.query, req.body) == ("POST", "/tokenize", {"x": "1", "y": ""}, b'{"a":1}')
    assert req.header("x-api-key") == "k"
    assert c.next_request() is None
    status, headers, body = _parse_response(c.respond(200, [("content-type", "application/json")], b"{}"))
    assert status == 200 and headers["content-length"] == "2" and body == b"{}"
    assert c.next_cycle()
    c.receive(b"GET /health HTTP/1.1\r\nHost: h\r\n\r\n")
    assert c.next_request().path == "/health"


def test_pipelined_requests_come_one_at_a_time():
    c = ServerConnection()
    c.receive(b"GET /a HTTP/1.1\r\nHost: h\r\n\r\nGET /b HTTP/1.1\r\nHost: h\r\n\r\n")
    assert c.next_request().path == "/a"
    assert c.next_request() is None and c.buffered > 0       # /b waits for /a's response
    c.respond(200, [], b"")
    assert c.next_cycle()
    assert c.next_request().path == "/b"


def test_chunked_body_byte_by_byte():
    c = ServerConnection()
    raw = b"POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
    got = None
    for i in range(len(raw)):
        c.receive(raw[i:i + 1])
        got = got or c.next_request()
    assert got.body == b"abcde"


def test_body_limits():
    c = ServerConnection(body_limit=1024)
    c.receive(b"POST /x HTTP/1.1\r\nHost: h\r\nContent-Length: 5000\r\n\r\n")
    f = c.next_request()
    assert isinstance(f, ProtocolFailure) and f.status == 413 and f.path == "/x"
    status, headers, _ = _parse_response(c.respond(413, [], b"too big"))
    assert status == 413 and headers["connection"] == "close"
    assert not c.next_cycle()
    c = ServerConnection(body_limit=1024)
    c.receive(b"POST /x HTTP/1.1\r\nHost: h\r\nTransfer-Encoding: chunked\r\n\r\n")
    assert c.next_request() is None
    c.receive(b"400\r\n" + b"a" * 1024 + b"\r\n")
    assert c.next_request() is None
    c.receive(b"1\r\nb\r\n")
    assert c.next_request().status == 413


@pytest.mark.parametrize("raw", [b"NOT HTTP\r\n\r\n", b"GET / HTTP/1.1\r\n\r\n",   # no Host
                                 b"GET / HTTP/1.1\r\nHost: h\r\nContent-Length: x\r\n\r\n"])
def test_malformed_requests_fail_with_400(raw):
    c = ServerConnection()
    c.receive(raw)
    f = c.next_request()
    assert isinstance(f, ProtocolFailure) and f.status == 400
    assert _parse_response(c.respond(400, [], b"bad"))[0] == 400 and not c.next_cycle()


def test_streamed_response_is_chunked():
    c = ServerConnection()
    c.receive(b"GET /s HTTP/1.1\r\nHost: h\r\n\r\n")
    c.next_request()
    out = c.start(200, [("content-type", "text/event-stream")]) + c.chunk(b"data: 1\n\n") + c.end()
    assert b"transfer-encoding: chunked" in out.lower() and out.endswith(b"0\r\n\r\n")
    assert c.next_cycle()


def test_100_continue():
    c = ServerConnection()
    c.receive(b"POST /x HTTP/1.1\r\nHost: h\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
    assert c.next_request() is None
    assert c.continue_100().startswith(b"HTTP/1.1 100")
    c.receive(b"{}")
    assert c.next_request().body == b"{}"


# -- routes as plain functions -----------------------------------------------------------------------

class _Conn:
    peer = "test"


@pytest.fixture(scope="module")
def app(tiny_model):
    import fastserve
    engine = fastserve.Engine(tiny_model, n_parallel=2, n_ctx=512, n_batch=64)
    a = App(engine, ServerConfig(log_requests=False, metrics=True))
    yield a
    engine.close()


def _call(app, method, target, body=b""):
    req = HttpRequest(method, target, {"host": "h"}, body)
    ex = Exchange(_Conn(), req)
    out = app.handle(req, ex)
    if not isinstance(out, Response):
        async def run():
            try:
                res = await out
                if isinstance(res, StreamResponse):
                    chunks = [c async for c in res.body]
                    return Response(res.status, b"".join(chunks), res.content_type)
                return res
            except HttpError as err:            # what protocol.py does with a route's HttpError
                return app.error_response(ex.family, err)
            finally:
                if ex.generation is not None:
                    ex.generation.close()
        out = asyncio.run(run())
    return out


def test_routes_without_a_socket(app):
    r = _call(app, "GET", "/health")
    assert r.status == 200 and orjson.loads(r.body) == {"status": "ok"}
    slots = orjson.loads(_call(app, "GET", "/slots").body)
    assert len(slots) == 2 and all((s["n_swa"], s["swa_ring"], s["swa_reusable"]) == (0, 0, [0, s["n_tokens"]])
                                   for s in slots)          # no sliding window: any prefix is reusable
    assert b"fastserve_requests_running 0" in _call(app, "GET", "/metrics").body
    toks = orjson.loads(_call(app, "POST", "/tokenize", b'{"content": "hi"}').body)["tokens"]
    assert orjson.loads(_call(app, "POST", "/detokenize", orjson.dumps({"tokens": toks})).body)["content"] == "hi"
    assert _call(app, "GET", "/nope").status == 404
    assert _call(app, "PUT", "/health").status == 405
    r = _call(app, "POST", "/completion", b'{"prompt": "hi", "n_predict": 3, "temperature": 0}')
    assert r.status == 200 and orjson.loads(r.body)["tokens_predicted"] == 3
    r = _call(app, "POST", "/completion", b'{"prompt": "hi", "n_predict": 3, "temperature": 0, "stream": true}')
    assert r.status == 200 and 2 <= r.body.count(b"data: ") <= 4       # tokens may arrive batched
    assert orjson.loads(r.body.split(b"data: ")[-1])["tokens_predicted"] == 3
    r = _call(app, "POST", "/v1/chat/completions", b'{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}')
    assert r.status == 200 and orjson.loads(r.body)["usage"]["completion_tokens"] <= 2
    assert _call(app, "POST", "/v1/chat/completions", b'{"messages": 1}').status == 400


def test_an_exchange_of_several_generations_closes_them_all(app):
    """n > 1 (and /completion's list of prompts): a stream that never started to be read, ended by a
    disconnect or a deadline, leaves no generation running nor in app.inflight."""
    for body in (b'{"messages": [{"role": "user", "content": "x"}], "n": 2, "max_tokens": 200, "stream": true}',
                 b'{"prompt": ["a", "b"], "n_predict": 200, "stream": true}'):
        path = "/v1/chat/completions" if b"messages" in body else "/completion"
        req = HttpRequest("POST", path, {"host": "h"}, body)
        ex = Exchange(_Conn(), req)

        async def start():
            return await app.handle(req, ex)

        resp = asyncio.run(start())
        assert isinstance(resp, StreamResponse) and len(app.inflight) == 2
        app.fail(ex, HttpError(499, "the client went away"))
        assert not app.inflight
