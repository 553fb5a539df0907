"""Constrained generation with llguidance: grammars and JSON schemas -> a per-request token matcher.

    GBNF / Lark / JSON schema ──compile_grammar()──▶ grammar (llguidance's JSON form, validated, or RequestError)
    grammar + the model's vocabulary ──Constraint──▶ LLMatcher: fill_mask(slot) / commit(token)

- The vocabulary description (LLTokenizer) is built once per Tokenizer from the GGUF vocabulary, byte
  level BPE and SentencePiece alike: each token's bytes as llama.cpp's token_to_piece gives them, special
  (control / unknown) tokens behind llguidance's 0xFF marker so no text ever matches them, the ids that
  end generation as its EOS set. It is kept on the Tokenizer (`vocabulary()`), ~0.1 s for 49k tokens.
- compile_grammar() runs in the caller's thread, before any slot is taken: an invalid grammar or schema, or a
  schema keyword llguidance does not implement, is a RequestError carrying the compiler's message. The HTTP
  server calls it (through Engine.constraint) in a worker thread, never on the event loop: a large schema
  compiles for tens of ms or more, and llguidance drops the GIL meanwhile.
- A Constraint is the request's matcher. Masks are bit arrays: uint32 words, bit (t % 32) of word
  t // 32 set when token t is allowed (llguidance's layout, the one the sampler reads).

Threads: a Constraint is used by one thread at a time (the engine's mask worker between steps, the
decode thread at commit); llguidance drops the GIL while it computes a mask.
"""
from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np

from .errors import RequestError

_SPECIAL_MARKER = b"\xff"      # llguidance: a token whose bytes start with 0xFF is special, never text
_lock = threading.Lock()
# Whitespace between JSON tokens as llama.cpp's schema converter allows it (space ::= | " " | "\n"{1,2} [ \t]{0,20}:
# nothing, a space, or one or two newlines and an indent of at most 20): enough for pretty-printed output, never an
# endless run of blanks.
_JSON_OPTIONS = {"whitespace_pattern": r"(?: |\n{1,2}[ \t]{0,20})?"}


# JSON schema keywords whose value is a subschema, or a list / a map of subschemas (allOf is apart: closed_objects)
_SUBSCHEMA = ("additionalProperties", "items", "not", "if", "then", "else", "contains", "propertyNames",
              "unevaluatedItems", "unevaluatedProperties")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema, close: bool = True):
    """The schema with each object that lists its properties and says nothing of others closed
    ("additionalProperties": false), as llama.cpp's schema converter reads a missing additionalProperties:
    else a small model keeps adding keys until n_predict cuts the JSON. An allOf's members are left open
    (each would forbid the others' properties) but what they hold is closed."""
    if isinstance(schema, list):        # items given as a list (draft 4's tuple form)
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key, v in schema.items():
        if key in _SUBSCHEMA:
            out[key] = closed_objects(v)
        elif key in _SUBSCHEMA_LISTS and isinstance(v, list):
            out[key] = [closed_objects(s) for s in v]
        elif key in _SUBSCHEMA_MAPS and isinstance(v, dict):
            out[key] = {name: closed_objects(s) for name, s in v.items()}
        elif key == "allOf" and isinstance(v, list):
            out[key] = [closed_objects(s, close=False) for s in v]
    if close and isinstance(schema.get("properties"), dict) and not any(
            k in schema for k in ("additionalProperties", "patternProperties", "unevaluatedProperties")):
        out["additionalProperties"] = False
    return out


def _llg():
    try:
        import llguidance
    except ImportError as exc:   # a declared dependency; a broken install says what is missing
        raise RequestError(f"constrained generation needs the llguidance package: {exc}") from None
    return llguidance


def mask_words(n_vocab: int) -> int:
    """uint32 words of one token mask."""
    return (n_vocab + 31) // 32


class _Encoder:
    """Text -> ids for llguidance (it tokenizes forced text): no BOS, no SentencePiece space prefix
    (the text is a continuation), special-token texts as those tokens."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_id = min(tokenizer.eog_ids) if tokenizer.eog_ids else tokenizer.n_vocab - 1
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [(_SPECIAL_MARKER + tokenizer.token_text(i).encode()) if tokenizer.is_special(i)
                       else tokenizer.token_bytes(i) for i in range(tokenizer.n_vocab)]
        self.special_token_ids = [i for i in range(tokenizer.n_vocab) if tokenizer.is_special(i)]

    def __call__(self, text: bytes) -> list[int]:
        s = text.decode("utf-8", "replace") if isinstance(text, (bytes, bytearray)) else text
        return self.tokenizer.encode(s, add_special=False, parse_special=True, space_prefix=False)


def vocabulary(tokenizer):
    """llguidance's LLTokenizer for this vocabulary: built on first use, then kept with the tokenizer."""
    llg = getattr(tokenizer, "_llg_vocabulary", None)
    if llg is not None:
        return llg
    with _lock:
        llg = getattr(tokenizer, "_llg_vocabulary", None)
        if llg is None:
            lib = _llg()
            enc = _Encoder(tokenizer)
            eos = sorted(tokenizer.eog_ids) or [enc.eos_token_id]
            llg = lib.LLTokenizer(lib.TokenizerWrapper(enc), n_vocab=tokenizer.n_vocab, eos_token=eos)
            tokenizer._llg_vocabulary = llg
    return llg


def compile_grammar(*, grammar: str | None = None, json_schema: Any = None, json_object: bool = False,
            lark: str | None = None) -> str | None:
    """One constraint (at most one of them) as llguidance's grammar text; None when none is given.

    grammar: GBNF (llama.cpp's format, as llama-server takes it); lark: llguidance's Lark syntax;
    json_schema: a JSON schema (dict or its JSON text); json_object: any JSON object.
    Raises RequestError with the compiler's message when the input is invalid or unsupported."""
    given = [k for k, v in (("grammar", grammar), ("json_schema", json_schema), ("lark", lark))
             if v is not None] + (["json_object"] if json_object else [])
    if not given:
        return None
    if len(given) > 1:
        raise RequestError(f"give one constraint, not several: {', '.join(given)}")
    lib = _llg()
    try:
        if grammar is not None:
            if not isinstance(grammar, str):
                raise RequestError("'grammar' must be a string (GBNF)")
            if not grammar.strip():
                raise RequestError("'grammar' is empty")
            text = lib.grammar_from("gbnf", grammar)
        elif lark is not None:
            text = lib.grammar_from("lark", lark)
        else:
            schema = {"type": "object"} if json_object else json_schema
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as exc:
                    raise RequestError(f"'json_schema' is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise RequestError("'json_schema' must be a JSON schema object")
            text = lib.LLMatcher.grammar_from_json_schema(closed_objects(schema), defaults=_JSON_OPTIONS)
    except ValueError as exc:
        raise RequestError(f"invalid {given[0]}: {exc}") from None
    err = lib.LLMatcher.validate_grammar(text)
    if err and not err.startswith("WARNING"):
        raise RequestError(f"invalid {given[0]}: {err}")
    return text


class Constraint:
    """One request's matcher over `tokenizer`'s vocabulary for a compiled grammar."""

    __slots__ = ("matcher", "n_vocab", "_eog")

    def __init__(self, tokenizer, grammar_text: str):
        lib = _llg()
        self.n_vocab = tokenizer.n_vocab
        self._eog = tokenizer.eog_ids
        self.matcher = lib.LLMatcher(vocabulary(tokenizer), grammar_text, log_level=0)
        if self.matcher.is_error():
            raise RequestError(f"invalid grammar: {self.matcher.get_error()}")

    def copy(self) -> "Constraint":
        """Another matcher of the same grammar in the same state (the n choices of one request): a deep copy
        (~10 us), no second compile."""
        other = Constraint.__new__(Constraint)
        other.matcher, other.n_vocab, other._eog = self.matcher.deep_copy(), self.n_vocab, self._eog
        return other

    def fill_mask(self, words: np.ndarray) -> None:
        """The allowed tokens of the next position into words (uint32 [mask_words(n_vocab)], C-contiguous)."""
        self.matcher.unsafe_compute_mask_ptr(words.ctypes.data, words.nbytes)

    def commit(self, token: int) -> bool:
        """The sampled token moves the matcher on; False when it was not allowed (an error state)."""
        if token in self._eog and self.matcher.is_accepting():
            return True                 # the end: llguidance's stop state needs nothing more
        return self.matcher.consume_token(token)

    def is_end(self, token: int) -> bool:
        """token ends the generation (an end-of-generation token)."""
        return token in self._eog

    @property
    def error(self) -> str:
        return self.matcher.get_error()

    def accepts(self, tokens, prefix: bool = False) -> bool:
        """Check an output from the grammar's start (the matcher's state is kept): every token taken
        and the grammar complete, or with prefix=True only every token taken (an output cut short)."""
        m = self.matcher.deep_copy()
        m.reset()
        for t in tokens:
            if t in self._eog and m.is_accepting():
                return True
            if not m.consume_token(int(t)):
                return False
        return prefix or m.is_accepting()
