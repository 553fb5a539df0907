"""Hypothesis strategies for HTTP/1.x byte streams as clients (and broken clients) send them.

    streams()      one connection's bytes: 1-4 pipelined requests (request line, headers, a body that is
                   plain, chunked or missing), sometimes mutated (bytes flipped, inserted, cut), or
                   random bytes outright
    split(data)    the same bytes cut at random points (how TCP may deliver them)

Cheap routes only, so that a real server answers each example in milliseconds (the bodies ask for
at most 2 tokens). Heads stay under the server's 16 kB header limit, so that whether a head is
refused does not depend on how it was split.
"""
from __future__ import annotations

import json

from hypothesis import strategies as st

METHODS = [b"GET", b"POST", b"HEAD", b"OPTIONS", b"PUT", b"DELETE", b"PATCH", b"TRACE", b"CONNECT", b"get",
           b"P\x00ST", b"G ET", b""]
TARGETS = [b"/health", b"/completion", b"/tokenize", b"/detokenize", b"/v1/models", b"/props", b"/slots",
           b"/metrics", b"/v1/chat/completions", b"/v1/completions", b"/slots/0?action=erase", b"/slots/99",
           b"*", b"http://x/health", b"/%zz%00", b"/health?a=1&a=2&%ff", b"//..//", b"/\xff\xfe", b""]
VERSIONS = [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/2.0", b"HTTP/0.9", b"HTTP/1.1x", b"http/1.1", b""]
HEADER_NAMES = [b"Host", b"Content-Length", b"Transfer-Encoding", b"Expect", b"Connection", b"Content-Type",
                b"Authorization", b"X-Api-Key", b"Origin", b"X-\xff", b"Bad Name", b""]
HEADER_VALUES = [b"x", b"0", b"5", b"-1", b"18446744073709551616", b"1, 2", b"chunked", b"gzip, chunked",
                 b"identity", b"100-continue", b"close", b"keep-alive", b"application/json", b"Bearer k",
                 b"a\x00b", b"\xff\xfe", b" padded ", b"v\r\n folded"]
JSON_BODIES = [{"prompt": "hi", "n_predict": 2}, {"prompt": "hi", "n_predict": 2, "stream": True},
               {"content": "hello world"}, {"tokens": [1, 2, 3]}, {"messages": [{"role": "user", "content": "hi"}],
                                                                   "max_tokens": 2}, [], {"prompt": 5}]

_json = st.sampled_from([json.dumps(b).encode() for b in JSON_BODIES])
_payload = _json | st.binary(max_size=64)
_header = st.tuples(st.sampled_from(HEADER_NAMES) | st.binary(min_size=1, max_size=12),
                    st.sampled_from(HEADER_VALUES) | st.binary(max_size=24))


@st.composite
def _chunked(draw, payload: bytes, broken: bool) -> bytes:
    """payload in chunked framing; broken: sometimes wrong (a size that lies, a bad size, a bare LF)."""
    cuts = sorted(draw(st.lists(st.integers(0, len(payload)), max_size=4)))
    parts = [payload[a:b] for a, b in zip([0] + cuts, cuts + [len(payload)]) if b > a]
    out = b""
    for p in parts:
        size, end = b"%x" % len(p), b"\r\n"
        if draw(st.sampled_from([False, False, True])):
            size = draw(st.sampled_from([b"%x;ext=1" % len(p), b"%X" % len(p), b"0%x" % len(p)]))
        if broken and draw(st.booleans()):
            size = draw(st.sampled_from([b"%x" % (len(p) + 1), b"zz", b"-1", b"ffffffffffffffffff", b""]))
            end = draw(st.sampled_from([b"\n", b"", b"\r\r\n"]))
        out += size + b"\r\n" + p + end
    return out + b"0\r\n" + draw(st.sampled_from([b"", b"Trailer: x\r\n"])) + b"\r\n"


@st.composite
def valid_requests(draw) -> bytes:
    """A well-formed request to a cheap route (its answer may still be a 4xx: wrong method, bad JSON)."""
    method = draw(st.sampled_from(METHODS[:4]))
    target = draw(st.sampled_from(TARGETS[:12]))
    version = draw(st.sampled_from([b"HTTP/1.1"] * 3 + [b"HTTP/1.0"]))
    headers = [(b"Host", b"x")]
    headers += draw(st.lists(st.sampled_from([(b"Content-Type", b"application/json"), (b"Connection", b"keep-alive"),
                                              (b"Authorization", b"Bearer k"), (b"X-Api-Key", b"k"),
                                              (b"Origin", b"http://o"), (b"Expect", b"100-continue"),
                                              (b"Accept", b"*/*"), (b"X-Custom", b"\xff v")]), max_size=3))
    body = draw(_payload) if method == b"POST" else b""
    if draw(st.integers(0, 3)) == 0:
        headers.append((b"Transfer-Encoding", b"chunked"))
        body = draw(_chunked(body, False))
    elif body or draw(st.booleans()):
        headers.append((b"Content-Length", b"%d" % len(body)))
    head = method + b" " + target + b" " + version + b"\r\n" + b"".join(k + b": " + v + b"\r\n" for k, v in
                                                                         draw(st.permutations(headers)))
    return head + b"\r\n" + body


@st.composite
def broken_requests(draw) -> bytes:
    """A request with something wrong in its line, its headers or its framing."""
    method = draw(st.sampled_from(METHODS))
    target = draw(st.sampled_from(TARGETS))
    version = draw(st.sampled_from(VERSIONS))
    sep = draw(st.sampled_from([b"\r\n"] * 4 + [b"\n", b"\r"]))
    line = draw(st.sampled_from([method + b" " + target + b" " + version, method + b"  " + target,
                                 method + b" " + target + b" " + version + b" extra"]))
    headers = [(b"Host", b"x")] if draw(st.booleans()) else []
    headers += draw(st.lists(_header, max_size=4))
    body = draw(_payload)
    framing = draw(st.sampled_from(["length", "chunked", "none", "lie", "both"]))
    if framing in ("length", "both"):
        headers.append((b"Content-Length", b"%d" % len(body)))
    if framing == "lie":
        headers.append((b"Content-Length", b"%d" % max(0, len(body) + draw(st.integers(-3, 3)))))
    if framing in ("chunked", "both"):
        headers.append((b"Transfer-Encoding", b"chunked"))
        body = draw(_chunked(body, True))
    return line + sep + b"".join(k + b": " + v + sep for k, v in headers) + sep + body


def requests():
    return valid_requests() | valid_requests() | broken_requests()


@st.composite
def _mutated(draw, data: bytes) -> bytes:
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 3))):
        if not data:
            break
        i = draw(st.integers(0, len(data) - 1))
        op = draw(st.sampled_from(["flip", "insert", "delete", "cut"]))
        if op == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=4))
        elif op == "delete":
            del data[i]
        else:
            del data[i:]
    return bytes(data)


def streams():
    """One connection's bytes."""
    pipelined = st.lists(requests(), min_size=1, max_size=4).map(b"".join)
    return pipelined | pipelined.flatmap(_mutated) | st.binary(max_size=200)


@st.composite
def split(draw, data: bytes) -> list[bytes]:
    """data cut at up to 8 random points (the pieces concatenate back to data)."""
    cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(data) - 1)), max_size=8)))) if len(data) > 1 else []
    return [data[a:b] for a, b in zip([0] + cuts, cuts + [len(data)])]
