"""Requests as plain data: what was asked (Job, on the decode thread) and what came out (Completion)."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

from .config import SamplingParams

_ids = itertools.count(1)


class SlotState(enum.IntEnum):
    """A slot's state in Snapshot.slot_state (fastserve/_slots.pyx's S_* codes; a test checks they agree)."""
    IDLE = 0
    PREFILL = 1
    DECODE = 2


@dataclass(eq=False)
class Job:
    """A request as the decode thread sees it. It holds the reader's buffer, never the Reader,
    so that a Reader nobody holds any more is collected (and cancels itself)."""
    prompt: Any                 # int32 array of prompt token ids
    sampling: SamplingParams    # checked once, at submit()
    max_tokens: int
    buffer: Any                 # the reader's ResultBuffer
    cache_prompt: bool = True
    id_slot: int = -1           # -1: any slot
    id: int = field(default_factory=lambda: next(_ids))
    slot: int = -1              # set when admitted
    n_cached: int = 0           # prompt tokens whose KV was reused
    admission: Any = None       # the reader's Admission, filled in when admitted


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
    finish_reason: str                     # "stop", "length", "cancelled", "error", "closed", "timeout"
    prompt_tokens: int = 0
    stopping_word: str = ""
    error: str | None = None
    probs: list | None = None              # per generated token: [(id, prob), ...] when n_probs > 0
    timings: dict = field(default_factory=dict)   # total_ms, first_token_ms, cache_n, prompt_n (llama.cpp's names)
    tokens_cached: int = 0                 # tokens the slot's KV holds at the end: prompt + generated (llama.cpp)
    id_slot: int = -1                      # the slot that ran it
