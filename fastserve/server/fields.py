"""Request bodies: JSON parsing and typed field access that answers 400 naming the field.

Every check a client can fail lives here or in the engine's RequestError; both
become a 400 in the route's error format. Unknown fields are ignored (as
llama-server and OpenAI do).
"""
from __future__ import annotations

import math

import orjson

from .errors import HttpError

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_TIMEOUT_S = 86400.0
MAX_BIAS_ENTRIES = 1024          # logit_bias pairs in one request (the sampler takes at most 256 tokens)
MAX_BIAS_TEXT = 256              # characters of one logit_bias text (tokenized on the event loop)
_MISSING = object()


def parse_object(body: bytes) -> "Body":
    if not body or not body.strip():
        raise HttpError(400, "the request body is empty: send a JSON object")
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise HttpError(400, f"malformed JSON in the request body: {exc}") from None
    if not isinstance(obj, dict):
        raise HttpError(400, f"the request body must be a JSON object, got {_kind(obj)}")
    return Body(obj)


def _kind(v) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "a boolean"
    if isinstance(v, (int, float)):
        return "a number"
    if isinstance(v, str):
        return "a string"
    if isinstance(v, list):
        return "an array"
    return "an object"


class Body:
    """A JSON object with typed getters. A field given as null counts as absent."""

    __slots__ = ("data",)

    def __init__(self, data: dict):
        self.data = data

    def has(self, name: str) -> bool:
        return self.data.get(name) is not None

    def raw(self, name: str, default=None):
        v = self.data.get(name)
        return default if v is None else v

    def int(self, name: str, default=None, lo: int | None = None, hi: int | None = None):
        v = self.data.get(name)
        if v is None:
            return default
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        if isinstance(v, bool) or not isinstance(v, int):
            raise HttpError(400, f"'{name}' must be an integer, got {_kind(v)}")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise HttpError(400, f"'{name}' must be in [{lo if lo is not None else '-inf'}, "
                                 f"{hi if hi is not None else 'inf'}], got {v}")
        return v

    def number(self, name: str, default=None, lo: float | None = None, hi: float | None = None):
        v = self.data.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise HttpError(400, f"'{name}' must be a number, got {_kind(v)}")
        v = float(v)
        if not math.isfinite(v):
            raise HttpError(400, f"'{name}' must be finite")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise HttpError(400, f"'{name}' must be in [{lo if lo is not None else '-inf'}, "
                                 f"{hi if hi is not None else 'inf'}], got {v}")
        return v

    def bool(self, name: str, default=False) -> bool:
        v = self.data.get(name)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise HttpError(400, f"'{name}' must be true or false, got {_kind(v)}")
        return v

    def str(self, name: str, default=None):
        v = self.data.get(name)
        if v is None:
            return default
        if not isinstance(v, str):
            raise HttpError(400, f"'{name}' must be a string, got {_kind(v)}")
        return v

    def stop(self, name: str = "stop") -> list[str]:
        """A stop string or a list of them."""
        v = self.data.get(name)
        if v is None:
            return []
        if isinstance(v, str):
            v = [v]
        if not isinstance(v, list) or not all(isinstance(s, str) for s in v):
            raise HttpError(400, f"'{name}' must be a string or an array of strings")
        if len(v) > MAX_STOP_STRINGS or any(len(s) > MAX_STOP_CHARS for s in v):
            raise HttpError(400, f"'{name}' allows at most {MAX_STOP_STRINGS} strings of at most "
                                 f"{MAX_STOP_CHARS} characters")
        return [s for s in v if s]

    def seed(self, name: str = "seed"):
        v = self.int(name, None)
        if v is None or v == -1:
            return None
        if not 0 <= v < 2 ** 64:
            raise HttpError(400, f"'{name}' must be -1 (random) or in [0, 2**64), got {v}")
        return v

    def logit_bias(self, name: str, tokenizer) -> dict | None:
        """{token_id: bias} from every form llama-server takes: [[id, bias], ...], [["text", bias], ...],
        {"id": bias, ...} and {"text": bias, ...}; a text stands for each of its tokens (tokenized without
        BOS), and a bias of false means "never" (-inf). Unlike llama-server, an entry it would skip (a bad
        pair, an id outside the vocabulary, a bias that is not a number) is a 400 naming it."""
        v = self.data.get(name)
        if v is None:
            return None
        if isinstance(v, dict):
            pairs = [(int(k) if k.lstrip("-").isdigit() else k, b) for k, b in v.items()]
        elif isinstance(v, list):
            if not all(isinstance(item, list) and len(item) == 2 for item in v):
                raise HttpError(400, f"'{name}' as an array must hold [token_id or text, bias] pairs")
            pairs = [tuple(item) for item in v]
        else:
            raise HttpError(400, f"'{name}' must be an object {{token_id or text: bias}} or an array of pairs")
        if len(pairs) > MAX_BIAS_ENTRIES:
            raise HttpError(400, f"'{name}' has {len(pairs)} entries; at most {MAX_BIAS_ENTRIES}")
        n_vocab = tokenizer.n_vocab
        out = {}
        for key, b in pairs:
            if b is False:
                b = -math.inf
            elif isinstance(b, bool) or not isinstance(b, (int, float)) or math.isnan(b):
                raise HttpError(400, f"'{name}' biases must be numbers (or false), got {_kind(b)} for {key!r}")
            if isinstance(key, str):
                if len(key) > MAX_BIAS_TEXT:
                    raise HttpError(400, f"'{name}' texts may have at most {MAX_BIAS_TEXT} characters")
                ids = tokenizer.encode(key, add_special=False) if key else []
                if not ids:
                    raise HttpError(400, f"'{name}' text {key!r} has no tokens")
            elif isinstance(key, bool) or not isinstance(key, int) or not 0 <= key < n_vocab:
                raise HttpError(400, f"'{name}' token ids must be integers in [0, {n_vocab}), got {key!r}")
            else:
                ids = [key]
            for tok in ids:
                out[tok] = float(b)
        return out

    def timeout(self, name: str, server_value: float) -> float:
        """A per-request time limit in seconds; it may only shorten the server's limit."""
        v = self.number(name, None, lo=0.0, hi=MAX_TIMEOUT_S)
        if v is None or v <= 0:
            return server_value
        return min(v, server_value) if server_value > 0 else v

    def choose(self, name: str, allowed: tuple, default=None):
        v = self.data.get(name)
        if v is None:
            return default
        if v not in allowed:
            raise HttpError(400, f"'{name}' must be one of {', '.join(map(repr, allowed))}, got {v!r}")
        return v
