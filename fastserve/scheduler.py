"""Which free slot a waiting request takes: prefix reuse by longest reusable prefix (the slot table's ints, and
the backend asked through `reusable` what a sliding window still holds).

Like llama.cpp's slot selection: the free slot whose cached tokens share the
longest prefix with the prompt, when that prefix is more than `similarity` of
the prompt (lowest id on ties); else the least recently admitted free slot,
whose cached prefix is the least likely to be wanted again. `id_slot` pins one.
A sliding-window model's slot counts its shared prefix only where its ring still
holds the window before it (else the prefix reuses nothing, and counts 0).
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


def pick_slot(slots, prompt: np.ndarray, *, id_slot: int, cache_prompt: bool, similarity: float,
              reusable=None) -> int:
    """The free slot for a request (-1: none free now). reusable(slot, n) -> bool: whether slot's KV can
    still serve a continuation after its first n tokens (the backend's window; None: always)."""
    if id_slot >= 0:
        return id_slot if slots.state[id_slot] == IDLE else -1
    free = np.flatnonzero(slots.state == IDLE)
    if len(free) == 0:
        return -1
    if cache_prompt:
        best, best_len = -1, 0
        for s in free:
            n = slot_prefix(slots, int(s), prompt)
            # judged at the length admission reuses (the prompt's last token is always computed)
            if n > best_len and (reusable is None or reusable(int(s), min(n, len(prompt) - 1))):
                best, best_len = int(s), n
        if best >= 0 and best_len > similarity * len(prompt):
            return best
    return int(free[np.argmin(slots.admit_seq[free])])


# A step that computes prompt tokens while other slots decode delays their next token by the whole
# step: this is the longest that step should take (other streams' inter-token gap while a prompt
# arrives; llama.cpp's is the whole prompt's time).
STEP_TARGET_S = 0.5
# Weight of the newest step in the measured seconds per token (an exponential moving average).
STEP_COST_WEIGHT = 0.25
# A prompt with nobody decoding takes the whole batch, but a step still ends within about this: the
# watchdog counts a step longer than --stall-limit (30 s) as a stall, and 512 prompt tokens of a 7 B
# model take ~36 s on 2 cores (more on a busy machine). Chunks of this size cost 1-5 % of such a
# prompt's time (one more read of the weights a chunk); a small model's batch stays whole.
LONE_STEP_S = 8.0
# Before any step was measured (the server's first prompt, its weights perhaps still on disk): the
# first step's prompt tokens, at most.
FIRST_STEP_TOKENS = 128


def prefill_budget(free: int, n_decode: int, min_chunk: int, s_per_token: float, target_s: float) -> int:
    """Prompt tokens the step may carry after its n_decode decode rows (free: room left in the batch).

    Nobody decoding: the whole batch, so a lone long prompt runs in big chunks, but no more than fit in
    LONE_STEP_S (at most FIRST_STEP_TOKENS before any step was measured). Else as many as fit
    in target_s at s_per_token (seconds of a whole step / its tokens, measured on recent steps),
    never fewer than min_chunk (a prompt always advances). That per-token figure carries the step's
    fixed cost, so it overestimates big steps: from below, the step grows towards target_s
    (n' = target * n / (a + b n) for a step of a + b n seconds; its fixed point is a + b n = target).
    Before any step was measured: min_chunk, or one token per decode row if there are more rows.
    """
    if n_decode == 0:
        lone = FIRST_STEP_TOKENS if s_per_token <= 0.0 else int(LONE_STEP_S / s_per_token)
        return min(free, max(min_chunk, lone))
    if s_per_token <= 0.0:
        return min(free, max(min_chunk, n_decode))
    return min(free, max(min_chunk, int(target_s / s_per_token) - n_decode))
