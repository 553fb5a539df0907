"""Request bodies as JSON: parsing, and typed field access that answers 400 naming the field.
What the fields mean, and the checks of their values: params.py.
"""
from __future__ import annotations

import math

import orjson

from .errors import HttpError


def parse_object(body: bytes) -> "Body":
    if not body or not body.strip():
        raise HttpError(400, "the request body is empty: send a JSON object")
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise HttpError(400, f"malformed JSON in the request body: {exc}") from None
    if not isinstance(obj, dict):
        raise HttpError(400, f"the request body must be a JSON object, got {kind(obj)}")
    return Body(obj)


def kind(v) -> str:
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
            raise HttpError(400, f"'{name}' must be an integer, got {kind(v)}")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise HttpError(400, f"'{name}' must be in [{lo if lo is not None else '-inf'}, "
                                 f"{hi if hi is not None else 'inf'}], got {v}")
        return v

    def number(self, name: str, default=None, lo: float | None = None, hi: float | None = None):
        v = self.data.get(name)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise HttpError(400, f"'{name}' must be a number, got {kind(v)}")
        v = float(v)
        if not math.isfinite(v):
            raise HttpError(400, f"'{name}' must be finite")
        if (lo is not None and v < lo) or (hi is not None and v > hi):
            raise HttpError(400, f"'{name}' must be in [{lo if lo is not None else '-inf'}, "
                                 f"{hi if hi is not None else 'inf'}], got {v}")
        return v

    def bool(self, name: str, default=False) -> bool:
        return self._typed(name, default, bool, "true or false")

    def str(self, name: str, default=None):
        return self._typed(name, default, str, "a string")

    def _typed(self, name: str, default, typ, what: str):
        v = self.data.get(name)
        if v is None:
            return default
        if not isinstance(v, typ):
            raise HttpError(400, f"'{name}' must be {what}, got {kind(v)}")
        return v
