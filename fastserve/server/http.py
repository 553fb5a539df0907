"""HTTP/1.1 over h11, sans-I/O: bytes in → HttpRequest out; responses → bytes out.

No socket, no event loop: protocol.py moves the bytes, tests feed byte strings.
One ServerConnection per TCP connection. Requests are handled one at a time in
arrival order (HTTP/1.1 pipelining: later requests wait, buffered, in h11).

Invariants:
- A request body never grows past `body_limit`: a Content-Length over it, or a
  chunked body that crosses it, becomes a 413 failure at once (the connection
  then closes, since the rest of the body was never read).
- After a failure (400, 413, ...; always a 4xx) or a response that h11 says must
  close, the connection takes no further request: `next_cycle()` returns False.
"""
from __future__ import annotations

from http import HTTPStatus
from urllib.parse import parse_qsl, unquote

import h11

from ..config import DEFAULT_BODY_LIMIT

DEFAULT_HEADER_LIMIT = 16 << 10     # bytes of request line + headers


class HttpRequest:
    """One complete request. headers: lower-case name → value (the last one wins)."""

    __slots__ = ("method", "target", "path", "query", "headers", "body", "http_version")

    def __init__(self, method: str, target: str, headers: dict, body: bytes = b"", http_version: str = "1.1"):
        self.method = method
        self.target = target
        path, _, qs = target.partition("?")
        self.path = unquote(path) or "/"
        self.query = dict(parse_qsl(qs, keep_blank_values=True)) if qs else {}
        self.headers = headers
        self.body = body
        self.http_version = http_version

    def header(self, name: str, default: str | None = None) -> str | None:
        return self.headers.get(name, default)

    def __repr__(self):
        return f"<HttpRequest {self.method} {self.target} {len(self.body)} bytes>"


class ProtocolFailure:
    """The peer broke HTTP (or a limit): answer `status` with `message`, then close."""

    __slots__ = ("status", "message", "method", "path")

    def __init__(self, status: int, message: str, method: str = "-", path: str = "-"):
        self.status, self.message, self.method, self.path = status, message, method, path

    def __repr__(self):
        return f"<ProtocolFailure {self.status} {self.message}>"


class ServerConnection:
    """The server side of one HTTP/1.1 connection (h11 plus body limits and framing helpers)."""

    def __init__(self, body_limit: int = DEFAULT_BODY_LIMIT, header_limit: int = DEFAULT_HEADER_LIMIT):
        self.body_limit = body_limit
        self._h = h11.Connection(h11.SERVER, max_incomplete_event_size=header_limit)
        self._head: h11.Request | None = None
        self._body = bytearray()
        self._failed = False
        self._head_only = False             # the request is a HEAD: its response carries no body
        self.peer_closed = False            # the peer sent EOF

    # -- input -------------------------------------------------------------------------------

    def receive(self, data: bytes) -> None:
        """Bytes from the peer; b"" means the peer closed its side (EOF)."""
        if not data:
            self.peer_closed = True
        try:
            self._h.receive_data(data)
        except RuntimeError:                # data after EOF, or after an error: nothing more to read
            pass

    @property
    def buffered(self) -> int:
        """Bytes received and not yet parsed (pipelined requests waiting their turn)."""
        return len(self._h.trailing_data[0])

    @property
    def in_request(self) -> bool:
        """Part of a request was received (headers or body) but not all of it."""
        return self._head is not None or self.buffered > 0

    def next_request(self) -> HttpRequest | ProtocolFailure | None:
        """The next complete request, a failure to answer, or None (need more data, or busy)."""
        if self._failed:
            return None
        h = self._h
        while True:
            try:
                ev = h.next_event()
            except h11.RemoteProtocolError as exc:
                # h11 hints 501/505 for a transfer coding or version it lacks: the client's request
                # is what cannot be served, so it is a 400 here (a 5xx says the server is at fault).
                hint = exc.error_status_hint or 400
                return self._fail(hint if hint < 500 else 400, f"bad HTTP request: {exc}")
            if ev is h11.NEED_DATA or ev is h11.PAUSED:
                return None
            t = type(ev)
            if t is h11.Request:
                self._head = ev
                self._head_only = ev.method == b"HEAD"
                self._body.clear()
                if ev.method == b"CONNECT":     # h11 takes a 2xx answer to it as a switch to a tunnel
                    return self._fail(405, "CONNECT is not served here: fastserve is not a proxy")
                length = _content_length(ev.headers)
                if length is not None and length > self.body_limit:
                    return self._fail(413, f"request body of {length} bytes is over the limit of "
                                           f"{self.body_limit} bytes")
            elif t is h11.Data:
                self._body += ev.data
                if len(self._body) > self.body_limit:
                    return self._fail(413, f"request body is over the limit of {self.body_limit} bytes")
            elif t is h11.EndOfMessage:
                head, self._head = self._head, None
                headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head.headers}
                body = bytes(self._body)
                self._body.clear()
                return HttpRequest(head.method.decode("ascii", "replace"),
                                   head.target.decode("latin-1"), headers, body,
                                   head.http_version.decode("ascii", "replace"))
            elif t is h11.ConnectionClosed:
                self.peer_closed = True
                return None

    def _fail(self, status: int, message: str) -> ProtocolFailure:
        self._failed = True
        head = self._head
        self._head = None
        if head is None:                    # a head that never parsed: not a HEAD request's answer
            self._head_only = False
            return ProtocolFailure(status, message)
        return ProtocolFailure(status, message, head.method.decode("ascii", "replace"),
                               head.target.decode("latin-1"))

    def continue_100(self) -> bytes:
        """`100 Continue` when the client waits for it before sending its body (else b"")."""
        h = self._h
        if h.they_are_waiting_for_100_continue and h.our_state is h11.SEND_RESPONSE:
            return h.send(h11.InformationalResponse(status_code=100, headers=[]))
        return b""

    # -- output ------------------------------------------------------------------------------

    def respond(self, status: int, headers: list, body: bytes) -> bytes:
        """A whole response: head, body, end (HEAD: the head alone, with the body's length)."""
        headers = headers + [("content-length", str(len(body)))]
        if self._failed:
            headers.append(("connection", "close"))
        h = self._h
        try:
            out = h.send(h11.Response(status_code=status, headers=headers, reason=_reason(status)))
            if body and not self._head_only:
                out += h.send(h11.Data(data=body))
            return out + h.send(h11.EndOfMessage())
        except h11.LocalProtocolError:      # e.g. the peer's side failed before a request line
            self._failed = True
            return b""

    def start(self, status: int, headers: list) -> bytes:
        """Head of a streamed response (chunked on HTTP/1.1, close-delimited on 1.0)."""
        return self._h.send(h11.Response(status_code=status, headers=headers, reason=_reason(status)))

    def chunk(self, data: bytes) -> bytes:
        return self._h.send(h11.Data(data=data)) if data and not self._head_only else b""

    def end(self) -> bytes:
        return self._h.send(h11.EndOfMessage())

    @property
    def response_started(self) -> bool:
        return self._h.our_state is h11.SEND_BODY

    def next_cycle(self) -> bool:
        """After a response: True when the connection may carry another request (keep-alive)."""
        h = self._h
        if self._failed or h.our_state is not h11.DONE or h.their_state is not h11.DONE:
            return False
        h.start_next_cycle()
        self._head_only = False
        return True


def _content_length(headers) -> int | None:
    for k, v in headers:
        if k == b"content-length":
            try:
                return int(v)
            except ValueError:
                return None
    return None


_REASONS = {s.value: s.phrase.encode() for s in HTTPStatus}


def _reason(status: int) -> bytes:
    return _REASONS.get(status, b"")
