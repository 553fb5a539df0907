"""Server-sent events framing: `data: <json>\\n\\n`, and OpenAI's terminator `data: [DONE]`."""
from __future__ import annotations

import orjson

DONE = b"data: [DONE]\n\n"


def event(obj) -> bytes:
    return b"data: " + orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n\n"


def error_event(payload: dict) -> bytes:
    """An error inside a stream, as llama-server sends it: a data event holding {"error": {...}}."""
    return event(payload)
