"""Random JSON schemas for the structured-output property tests (tests/e2e/test_structured.py and
bench/bench_json_schemas.py): nesting, enums, arrays with bounds, required and optional properties,
numbers with ranges, string patterns. Every string is bounded and every array small, so that a valid
instance fits in about a hundred tokens of a small model's output. Numbers carry a multipleOf: with
unbounded decimals a 135M model sampled at temperature 1.0 wrote digits until n_predict cut it (seen:
160 tokens of "20.0214236..." for {"type": "number", "minimum": 10, "maximum": 110})."""
from __future__ import annotations

import random

WORDS = ["alpha", "beta", "red", "blue", "north", "south", "cat", "dog", "one", "two", "yes", "no"]
PATTERNS = [r"^[a-z]{1,8}$", r"^[A-Z][a-z]{0,6}$", r"^[0-9]{3}-[0-9]{2}$", r"^(on|off)$", r"^#[0-9a-f]{6}$"]


def random_schema(rng: random.Random, depth: int = 0) -> dict:
    """One schema; objects and arrays nest up to depth 2."""
    kinds = ["integer", "number", "string", "pattern", "enum", "boolean", "null"]
    if depth < 2:
        kinds += ["object", "object", "array"]
    kind = rng.choice(kinds)
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "number":
        lo = rng.choice([-1.0, 0.0, 0.5, 10.0])
        return {"type": "number", "minimum": lo, "maximum": lo + rng.choice([1.0, 5.0, 100.0]),
                "multipleOf": rng.choice([0.5, 0.25, 0.125])}   # exact in binary: jsonschema checks with floats
    if kind == "string":
        return {"type": "string", "minLength": rng.randint(0, 2), "maxLength": rng.randint(3, 12)}
    if kind == "pattern":
        return {"type": "string", "pattern": rng.choice(PATTERNS)}
    if kind == "enum":
        return {"enum": rng.sample(WORDS, rng.randint(1, 4))}
    if kind in ("boolean", "null"):
        return {"type": kind}
    if kind == "array":
        lo = rng.randint(0, 2)
        return {"type": "array", "items": random_schema(rng, depth + 1), "minItems": lo,
                "maxItems": lo + rng.randint(0, 2)}
    names = rng.sample(["id", "name", "age", "tags", "color", "size", "ok", "when", "kind", "score"],
                       rng.randint(1, 4))
    props = {n: random_schema(rng, depth + 1) for n in names}
    required = [n for n in names if rng.random() < 0.6]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


def schemas(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(n)]
