"""What a route returns: a whole Response, or a StreamResponse whose body is produced as it goes."""
from __future__ import annotations

import orjson

JSON = "application/json; charset=utf-8"
TEXT = "text/plain; charset=utf-8"
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
EVENT_STREAM = "text/event-stream"


class Response:
    __slots__ = ("status", "body", "content_type", "headers")

    def __init__(self, status: int, body: bytes, content_type: str = JSON, headers: list | None = None):
        self.status, self.body, self.content_type, self.headers = status, body, content_type, headers or []


def json_response(obj, status: int = 200, headers: list | None = None) -> Response:
    return Response(status, orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY), JSON, headers)


class StreamResponse:
    """body: an async iterator of bytes (already framed, e.g. SSE events).
    on_error(HttpError) -> bytes: the last bytes to send when the stream is cut short
    (deadline, stall, shutdown); None sends nothing."""

    __slots__ = ("status", "body", "content_type", "headers", "on_error")

    def __init__(self, body, on_error=None, status: int = 200, content_type: str = EVENT_STREAM,
                 headers: list | None = None):
        self.status, self.body, self.content_type = status, body, content_type
        self.on_error = on_error
        self.headers = headers or [("cache-control", "no-cache"), ("x-accel-buffering", "no")]
