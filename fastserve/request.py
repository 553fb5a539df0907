"""Requests as plain data: what was asked (Job, on the decode thread) and what came out (Completion)."""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any

# llama.cpp's server defaults, applied where a request says nothing.
SAMPLING_DEFAULTS = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.0,
                         repeat_last_n=64, presence_penalty=0.0, frequency_penalty=0.0, logit_bias=None,
                         n_probs=0, post_sampling_probs=False)
_ids = itertools.count(1)


def random_seed() -> int:
    return int.from_bytes(os.urandom(8), "little")


@dataclass(eq=False)
class Job:
    """A request as the decode thread sees it. It holds the reader's buffer, never the Reader,
    so that a Reader nobody holds any more is collected (and cancels itself)."""
    prompt: Any                 # int32 array of prompt token ids
    sampling: dict              # normalized by the sampler's check_config
    max_tokens: int
    buffer: Any                 # the reader's ResultBuffer
    cache_prompt: bool = True
    id_slot: int = -1           # -1: any slot
    id: int = field(default_factory=lambda: next(_ids))
    slot: int = -1              # set when admitted
    n_cached: int = 0           # prompt tokens whose KV was reused
    admission: Any = None       # the reader's Admission, filled in when admitted
    constraint: Any = None      # grammar.Constraint of a constrained request (grammar / JSON schema)


class Admission:
    """Where a request ran and how much of its prompt came from a cache: written once by the
    decode thread when it admits the request, read by its reader (a plain object, no lock)."""
    __slots__ = ("slot", "n_cached")

    def __init__(self):
        self.slot, self.n_cached = -1, 0


@dataclass
class Completion:
    """What generate() returns and reader.result() gives."""
    text: str
    token_ids: list[int]
    finish_reason: str                     # "stop", "length", "cancelled", "error", "closed", "timeout", "grammar"
    prompt_tokens: int = 0
    stopping_word: str = ""
    error: str | None = None
    probs: list | None = None              # per generated token: [(id, prob), ...] when n_probs > 0
    timings: dict = field(default_factory=dict)   # total_ms, first_token_ms, cache_n, prompt_n (llama.cpp's names)
    tokens_cached: int = 0                 # tokens the slot's KV holds at the end: prompt + generated (llama.cpp)
    id_slot: int = -1                      # the slot that ran it
