"""Which free slot a waiting request takes: prefix reuse by longest common prefix (ints only).

Like llama.cpp's slot selection: the free slot whose cached tokens share the
longest prefix with the prompt, when that prefix is more than `similarity` of
the prompt (lowest id on ties); else the least recently admitted free slot,
whose cached prefix is the least likely to be wanted again. `id_slot` pins one.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ._slots import IDLE


@dataclass(frozen=True)
class StepPlan:
    """What one step computes, as the engine's schedule left it in the batch (ints only): n_decode decode
    tokens first (one per decoding slot), then each prompt chunk (slot, tokens) in batch order."""
    n_decode: int
    chunks: tuple = ()

    @property
    def n_prompt(self) -> int:
        """Prompt tokens the step computes."""
        return sum(n for _, n in self.chunks)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token id arrays."""
    n = min(len(a), len(b))
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


def slot_prefix(slots, slot: int, prompt: np.ndarray) -> int:
    """Tokens of prompt that slot's cached tokens (KV written) already hold."""
    return common_prefix(slots.tokens[slot, :int(slots.n_tokens[slot])], prompt)


def pick_slot(slots, prompt: np.ndarray, *, id_slot: int, cache_prompt: bool, similarity: float) -> int:
    """The free slot for a request (-1: none free now)."""
    if id_slot >= 0:
        return id_slot if slots.state[id_slot] == IDLE else -1
    free = np.flatnonzero(slots.state == IDLE)
    if len(free) == 0:
        return -1
    if cache_prompt:
        best, best_len = -1, 0
        for s in free:
            n = slot_prefix(slots, int(s), prompt)
            if n > best_len:
                best, best_len = int(s), n
        if best >= 0 and best_len > similarity * len(prompt):
            return best
    return int(free[np.argmin(slots.admit_seq[free])])
