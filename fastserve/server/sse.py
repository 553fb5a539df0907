"""Server-sent events framing: `data: <json>\\n\\n`, OpenAI's terminator `data: [DONE]`, and the named events
(`event: <name>\\ndata: <json>\\n\\n`) of Anthropic's and OpenAI's Responses streams."""
from __future__ import annotations

import orjson

DONE = b"data: [DONE]\n\n"


def event(obj) -> bytes:
    return b"data: " + orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY) + b"\n\n"


def named(name: str, obj) -> bytes:
    """An event with its name, the object's `type` by these APIs' convention."""
    return b"event: " + name.encode() + b"\n" + event(obj)


def error_event(payload: dict) -> bytes:
    """An error inside a stream, as llama-server sends it: a data event holding {"error": {...}}."""
    return event(payload)
