"""Requests as plain data: a Request (submit to finish), what came out (Completion), how it ended (OUTCOMES)."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .config import SamplingParams

request_ids = itertools.count(1)    # Request.id: Engine.submit draws one per request


class SlotState(enum.IntEnum):
    """A slot's state in Snapshot.slot_state (fastserve/_slots.pyx's S_* codes; a test checks they agree)."""
    IDLE = 0
    PREFILL = 1
    DECODE = 2


@dataclass(frozen=True, eq=False)
class Request:
    """One request as the decode thread holds it from submit() to its end: what was asked, and the buffer its
    results go into. The consumer side holds that buffer (in its Reader), never the Request: the two threads
    share a request's buffer only (where it runs, slot and n_cached, travels in it too: _delivery.pyx)."""
    id: int
    prompt: Any                 # int32 array of prompt token ids
    sampling: SamplingParams    # checked once, at submit()
    max_tokens: int
    buffer: Any                 # the reader's ResultBuffer
    cache_prompt: bool = True
    id_slot: int = -1           # -1: any slot
    constraint: Any = None      # grammar.Constraint of a constrained request (grammar / JSON schema)
    draft: Any = None           # config.DraftLimits of its speculative decoding (None: the engine's)


@dataclass
class Completion:
    """What generate() returns and reader.result() gives."""
    text: str
    token_ids: list[int]
    finish_reason: str                     # "stop", "length", "cancelled", "error", "closed", "grammar"
    prompt_tokens: int = 0
    stopping_word: str = ""
    error: str | None = None
    probs: list | None = None              # per generated token: [(id, prob), ...] when n_probs > 0: the top n,
                                           # then the sampled token's own (id, prob) on the host sampler (CPU)
    timings: dict = field(default_factory=dict)   # total_ms, first_token_ms, cache_n, prompt_n (llama.cpp's names)
    tokens_cached: int = 0                 # tokens the slot's KV holds at the end: prompt + generated (llama.cpp)
    id_slot: int = -1                      # the slot that ran it


class Outcome(NamedTuple):
    """What one way of ending means to each API."""
    stop_type: str          # llama-server's stop_type ("word", "eos", "limit"); "" for a failure
    openai: str             # OpenAI's finish_reason
    status: int             # the HTTP status of a failure, 0 for a success
    message: str = ""       # the failure's message; {error} and {reason} are filled in


# How a request can end (TextReader.outcome()), the one table: "word" is a stop string found by the text
# layer; the others are the engine's finish reasons (fastserve/_delivery.pyx FINISH_REASONS).
OUTCOMES = {
    "word": Outcome("word", "stop", 0),
    "stop": Outcome("eos", "stop", 0),
    "length": Outcome("limit", "length", 0),
    "grammar": Outcome("grammar", "grammar", 0),     # the grammar / JSON schema allowed no next token
    "closed": Outcome("", "", 503, "the server is shutting down"),
    "error": Outcome("", "", 500, "generation failed: {error}"),
}
ENDED_EARLY = Outcome("", "", 503, "the request ended early ({reason})")     # cancelled
