"""Bad input gets a clear 4xx in the route family's error format, never a 5xx, a hang or a crash;
HTTP/1.1 details (keep-alive, pipelining, chunked bodies, 100-continue) over raw sockets."""
from __future__ import annotations

import json
import socket

import httpx
import pytest

LLAMA = "/completion"
CHAT = "/v1/chat/completions"


def _llama_error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == status and err["message"] and err["type"]
    return err["message"]


def _openai_error(r, status):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "param", "code"} and err["message"]
    return err["message"]


@pytest.mark.parametrize("body, needle", [
    (b"{not json", "malformed JSON"),
    (b"", "empty"),
    (b"[1, 2]", "JSON object"),
    (b'{"prompt": 5}', "prompt"),
    (b'{"prompt": ""}', "empty"),
    (b'{"prompt": []}', "empty"),
    (b'{"prompt": [1, -4]}', "token ids"),
    (b'{"prompt": [' + b",".join([b'"a"'] * 17) + b']}', "at most 16"),     # a list of prompts: 16 at most
    (b'{"prompt": [[1], [2, "x", {}]]}', "prompt[1]"),
    (b'{"prompt": "a", "n_predict": "many"}', "n_predict"),
    (b'{"prompt": "a", "n_predict": -5}', "n_predict"),
    (b'{"prompt": "a", "temperature": "hot"}', "temperature"),
    (b'{"prompt": "a", "top_p": 7}', "top_p"),
    (b'{"prompt": "a", "n_probs": 1000}', "n_probs"),
    (b'{"prompt": "a", "stop": [1]}', "stop"),
    (b'{"prompt": "a", "stream": "yes"}', "stream"),
    (b'{"prompt": "a", "seed": 1.5}', "seed"),
    (b'{"prompt": "a", "id_slot": 99}', "id_slot"),
    (b'{"prompt": "a", "logit_bias": [[99999, 1]]}', "logit_bias"),
    (b'{"prompt": "a", "repeat_last_n": 1000000}', "repeat_last_n"),
    (b'{"prompt": "a", "grammar": "root ::= nothing"}', "Rule 'nothing' not found"),
    (b'{"prompt": "a", "grammar": 5}', "grammar"),
    (b'{"prompt": "a", "json_schema": {"type": "strin"}}', "Invalid type"),
    (b'{"prompt": "a", "json_schema": {"type": "array", "uniqueItems": true}}', "Unimplemented keys"),
    (b'{"prompt": "a", "json_schema": [1]}', "json_schema"),
])
def test_completion_bad_input(http, body, needle):
    msg = _llama_error(http.post(LLAMA, content=body), 400)
    assert needle.lower() in msg.lower(), msg


def test_prompt_longer_than_a_slot(http):
    ids = list(range(10, 10 + 300))           # the shared server's slots hold 256 tokens
    assert "slot" in _llama_error(http.post(LLAMA, json={"prompt": ids}), 400)
    assert "slot" in _llama_error(http.post(LLAMA, json={"prompt": "word " * 300}), 400)
    assert "(about " in _llama_error(http.post(LLAMA, json={"prompt": "x" * 100_000}), 400)    # not tokenized whole


@pytest.mark.parametrize("body, needle", [
    ({}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "role"),
    ({"messages": [{"role": "user", "content": 3}]}, "content"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "content"),
    ({"messages": [{"role": "user", "content": "a"}], "n": 99}, "'n'"),
    ({"messages": [{"role": "user", "content": "a"}], "max_tokens": "x"}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "a"}], "top_logprobs": 3}, "logprobs"),
    ({"messages": [{"role": "user", "content": "a"}], "logprobs": True, "top_logprobs": 50}, "top_logprobs"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", "function": {}}]},
     "function.name is required"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": {"a": 1}}, "tools"),
    ({"messages": [{"role": "user", "content": "a"}], "tool_choice": "required"}, "needs 'tools'"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, "not among the tools"),
    ({"messages": [{"role": "user", "content": "a"}], "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "properties": {"x": {"type": "nope"}}}}}]}, "Invalid type"),
    ({"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "xml"}}, "response_format"),
    ({"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "not": {}}}}}, "Unimplemented keys"),
    ({"messages": [{"role": "user", "content": "a"}], "response_format": {"type": "json_object"},
      "grammar": "root ::= \"a\""}, "one constraint"),
    ({"messages": [{"role": "user", "content": "a"}], "stream_options": 5}, "stream_options"),
    ({"messages": [{"role": "user", "content": "a"}], "ignore_eos": "yes"}, "ignore_eos"),
    ({"messages": [{"role": "user", "content": "a"}], "grammar": "root ::= [a-"}, "invalid grammar"),
])
def test_chat_bad_input(http, body, needle):
    msg = _openai_error(http.post(CHAT, json=body), 400)
    assert needle.lower() in msg.lower(), msg


def test_unknown_path_and_wrong_method(http):
    _llama_error(http.get("/nope"), 404)
    _openai_error(http.get("/v1/nope"), 404)
    r = http.get(LLAMA)
    _llama_error(r, 405)
    assert r.headers["allow"] == "POST"
    _openai_error(http.delete(CHAT), 405)
    _llama_error(http.post("/health"), 405)


def test_body_limit_413(http, server):
    r = http.post(LLAMA, content=b'{"prompt": "' + b"a" * (3 << 20) + b'"}')
    _llama_error(r, 413)
    assert http.get("/health").status_code == 200


def test_tokenize_detokenize_bad_input(http):
    _llama_error(http.post("/tokenize", json={}), 400)
    _llama_error(http.post("/tokenize", json={"content": 5}), 400)
    _llama_error(http.post("/detokenize", json={"tokens": ["a"]}), 400)
    _llama_error(http.post("/detokenize", json={"tokens": [10 ** 9]}), 400)


# -- HTTP/1.1 over raw sockets -----------------------------------------------------------------------

def _connect(server) -> socket.socket:
    s = socket.create_connection((server.host, server.port), timeout=10)
    return s


def _read_responses(s: socket.socket, n: int) -> list[tuple[int, bytes]]:
    """Read n Content-Length framed responses."""
    buf = b""
    out = []
    while len(out) < n:
        while b"\r\n\r\n" not in buf:
            chunk = s.recv(65536)
            assert chunk, f"connection closed after {len(out)} responses"
            buf += chunk
        head, _, buf = buf.partition(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = int([h.split(b":", 1)[1] for h in head.split(b"\r\n")[1:] if h.lower().startswith(b"content-length")][0])
        while len(buf) < length:
            buf += s.recv(65536)
        out.append((status, buf[:length]))
        buf = buf[length:]
    return out


def test_keep_alive_and_pipelining(server):
    body = json.dumps({"prompt": "pipe", "n_predict": 4, "temperature": 0}).encode()
    req = (b"POST /completion HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
           b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    with _connect(server) as s:
        s.sendall(req + health + req + health)       # four pipelined requests in one write
        got = _read_responses(s, 4)
        assert [st for st, _ in got] == [200, 200, 200, 200]
        assert json.loads(got[0][1])["content"] == json.loads(got[2][1])["content"]
        s.sendall(health)                            # the connection is still usable
        assert _read_responses(s, 1)[0][0] == 200


def test_chunked_request_body_and_100_continue(server):
    body = json.dumps({"content": "chunky"}).encode()
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + 5]), body[i:i + 5]) for i in range(0, len(body), 5))
    with _connect(server) as s:
        s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunks + b"0\r\n\r\n")
        st, data = _read_responses(s, 1)[0]
        assert st == 200 and json.loads(data)["tokens"]
        s.sendall(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: "
                  + str(len(body)).encode() + b"\r\n\r\n")
        interim = s.recv(1024)
        assert interim.startswith(b"HTTP/1.1 100")
        s.sendall(body)
        assert _read_responses(s, 1)[0][0] == 200


def test_garbage_gets_400_and_close(server):
    with _connect(server) as s:
        s.sendall(b"THIS IS NOT HTTP\r\n\r\n")
        data = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
    assert data.startswith(b"HTTP/1.1 400")


def test_api_key(make_server):
    srv = make_server("-c", "512", "-np", "2", "--api-key", "s3cret", "-n", "4")
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        assert c.get("/health").status_code == 200                  # public
        _llama_error(c.post(LLAMA, json={"prompt": "a"}), 401)
        _llama_error(c.post(LLAMA, json={"prompt": "a"}, headers={"Authorization": "Bearer nope"}), 401)
        _openai_error(c.post("/v1/chat/completions", json={}, headers={"Authorization": "Bearer s3cret0"}), 401)
        _llama_error(c.get("/slots", headers={"X-Api-Key": "s3cre"}), 401)
        assert c.post(LLAMA, json={"prompt": "a"}, headers={"Authorization": "Bearer s3cret"}).status_code == 200
        assert c.get("/metrics", headers={"X-Api-Key": "s3cret"}).status_code == 200
    rc, dt = srv.stop()
    assert rc == 0 and dt < 3


def test_cors(make_server, server):
    """--cors-origins (llama-server's flag; --cors-origin too): those origins and the server's own are reflected,
    others refused (403, preflight or not); without it, pages on this machine and the server's own."""
    preflight = {"Access-Control-Request-Method": "POST"}
    srv = make_server("-c", "512", "-np", "2", "--cors-origins", "http://app.example,http://b.example:81", "-n", "4")
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        for origin in ("http://app.example", "http://b.example:81", srv.url):
            r = c.options(LLAMA, headers={"Origin": origin, **preflight})
            assert r.status_code == 204 and r.headers["access-control-allow-origin"] == origin, origin
            assert "POST" in r.headers["access-control-allow-methods"]
            assert "x-api-key" in r.headers["access-control-allow-headers"]
        r = c.post(LLAMA, json={"prompt": "a"}, headers={"Origin": "http://app.example"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://app.example"
        for origin in ("http://evil.example", "http://localhost:3000", "null"):
            r = c.options(LLAMA, headers={"Origin": origin, **preflight})
            assert r.status_code == 403 and "access-control-allow-origin" not in r.headers, origin
            r = c.post(LLAMA, json={"prompt": "a"}, headers={"Origin": origin})
            assert r.status_code == 403 and "--cors-origins" in r.json()["error"]["message"]
        assert c.get("/health").status_code == 200                  # no Origin: no browser, never refused
    srv.kill()
    with httpx.Client(base_url=server.url, timeout=10) as c:        # the default
        for origin in ("http://localhost:3000", "http://127.0.0.1:5173", "https://[::1]:8443", server.url):
            r = c.options("/v1/chat/completions", headers={"Origin": origin, **preflight})
            assert r.status_code == 204 and r.headers["access-control-allow-origin"] == origin, origin
        r = c.post("/v1/chat/completions", headers={"Origin": "http://evil.example"},
                   json={"messages": [{"role": "user", "content": "a"}], "max_tokens": 1})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error"
        r = c.get("/health", headers={"Origin": "http://localhost:3000"})
        assert r.status_code == 200 and r.headers["vary"] == "origin"
        # the chat page reached by another name (a server on the LAN): its own origin, whatever the name
        lan = {"Origin": "http://box.lan:8080", **preflight}
        r = c.options("/v1/chat/completions", headers={**lan, "Host": "box.lan:8080"})
        assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "http://box.lan:8080"
        assert c.options("/v1/chat/completions", headers=lan).status_code == 403        # another server's page
        r = c.post("/v1/messages", headers={"Origin": "http://evil.example"},           # in the route's own shape
                   json={"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "a"}]})
        assert r.status_code == 403 and r.json()["error"]["type"] == "permission_error" and r.json()["type"] == "error"
    star = make_server("-c", "512", "-np", "2", "--cors-origins", "*")
    r = httpx.options(star.url + LLAMA, headers={"Origin": "http://anywhere.example", **preflight})
    assert r.status_code == 204 and r.headers["access-control-allow-origin"] == "*"
    star.kill()
