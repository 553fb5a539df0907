"""HTTP errors and their three wire formats (llama.cpp's, OpenAI's and Anthropic's).

llama.cpp:  {"error": {"code": 400, "message": "...", "type": "invalid_request_error"}}
OpenAI:     {"error": {"message": "...", "type": "invalid_request_error", "param": null, "code": 400}}
Anthropic:  {"type": "error", "error": {"type": "invalid_request_error", "message": "..."}}
Ollama:     {"error": "..."}
The OpenAI format is used for routes under /v1/ (and their unprefixed aliases), Anthropic's for
/v1/messages; an Anthropic error's type is the one its API gives that status (its SDK reads the status).
"""
from __future__ import annotations

import orjson

from ..errors import ContextExceeded, RequestError

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    500: "server_error",
    501: "not_supported_error",
    503: "unavailable_error",
    504: "timeout_error",
}

# Anthropic's error types, by status (docs.anthropic.com "Errors")
ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}

LLAMA, OPENAI, ANTHROPIC, OLLAMA = "llama", "openai", "anthropic", "ollama"


class HttpError(Exception):
    """Raised by a route: answered as `status` with `message` in the route's error format."""

    def __init__(self, status: int, message: str, type: str | None = None, headers: list | None = None,
                 fields: dict | None = None):
        """fields: extra members of the error object (llama-server's n_prompt_tokens and n_ctx)."""
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers or []
        self.fields = fields

    def payload(self, family: str) -> dict:
        return error_payload(family, self.status, self.message, self.type, self.fields)


def refused(exc: RequestError) -> HttpError:
    """The 400 of a request the engine, the tokenizer or the grammar compiler refused: the one mapping of a
    RequestError, for both families, streamed or not. A prompt its slot cannot hold is llama-server's
    exceed_context_size_error, with its message and its fields."""
    if isinstance(exc, ContextExceeded):
        return exceeded(exc.n_prompt, exc.n_ctx)
    return HttpError(400, str(exc))


def exceeded(n_prompt: int, n_ctx: int, about: bool = False) -> HttpError:
    """llama-server's exceed_context_size_error; about: n_prompt is an estimate (a text too long to tokenize whole
    on the event loop: params.Parser.check_length)."""
    count = f"about {n_prompt}" if about else f"{n_prompt}"
    return HttpError(400, f"request ({count} tokens) exceeds the available context size ({n_ctx} tokens) of a slot "
                          f"(n_ctx / n_parallel), try increasing it",
                     type="exceed_context_size_error", fields={"n_prompt_tokens": n_prompt, "n_ctx": n_ctx})


def error_payload(family: str, status: int, message: str, type: str | None = None, fields: dict | None = None) -> dict:
    if family == ANTHROPIC:
        err = {"type": ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error"),
               "message": message, **(fields or {})}
        return {"type": "error", "error": err}
    if family == OLLAMA:
        return {"error": message}
    type = type or ERROR_TYPES.get(status, "server_error")
    if family == OPENAI:
        err = {"message": message, "type": type, "param": None, "code": status}
    else:
        err = {"code": status, "message": message, "type": type}
    if fields:
        err.update(fields)
    return {"error": err}


def error_json(family: str, status: int, message: str, type: str | None = None, fields: dict | None = None) -> bytes:
    return orjson.dumps(error_payload(family, status, message, type, fields))
