"""Constrained generation (grammars, JSON schemas, response formats): the one place that decides what
a request may ask for. Nothing constrains tokens yet, so every constraint is refused with a 400 that
says so, rather than answered with unconstrained text (the structured-output issue replaces this)."""
from __future__ import annotations

from .errors import HttpError
from .fields import Body

_NOT_YET = "is not supported yet: fastserve does not constrain generation, and would return unconstrained text"


def check_completion(body: Body) -> None:
    """/completion and /v1/completions: llama-server's `grammar` and `json_schema`."""
    for name in ("grammar", "json_schema"):
        if body.raw(name) not in (None, ""):        # llama-server reads "" as no grammar
            raise HttpError(400, f"'{name}' {_NOT_YET}")


def check_chat(body: Body) -> None:
    """/v1/chat/completions: OpenAI's `response_format` (anything but text), and llama-server's fields."""
    check_completion(body)
    fmt = body.raw("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type", "text") != "text"):
        raise HttpError(400, f"'response_format' other than {{\"type\": \"text\"}} {_NOT_YET}")
