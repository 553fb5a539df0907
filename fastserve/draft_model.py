"""A draft model for speculative decoding (--spec-type draft-simple, -md FILE): a model of the same vocabulary,
usually a smaller one, proposes each drafting slot's next tokens, greedily, on the decode thread.

    propose(...)  before the step's batch is built: each following slot's draft KV catches up with the slot's
                  tokens (a prompt in chunks sized as the target's, so it may lag a few steps), then up to k
                  passes of the draft model over the drafting slots, one token per slot each: its argmax is
                  the draft, which stops where the draft's top probability is below the slot's p_min

Its KV cache is its own (a CpuBackend on the draft's weights, n_slots x n_ctx_slot as the target's; its pages
come in as they are written). What a slot's draft KV holds is kept as the tokens fed (fed[s, :n_fed[s]]).
After each verification (rollback), and before a slot drafts, that record is compared with the slot's tokens
from where they last agreed, and everything after the first difference is dropped: the rejected drafts (so
the draft's n_past is the target's), or, for a new request, what follows the prefix it shares with the last
one (a prompt reuses the draft KV of its prefix as it does the target's). Rows past n_fed are stale, never read.

The output never depends on this module: greedy drafts are one-hot proposals, and the sampler keeps only
what plain decoding gives (fastserve/speculation.py). Decode thread only.
"""
from __future__ import annotations

import time

import numpy as np

from .errors import ConfigError
from .scheduler import STEP_COST_WEIGHT, STEP_TARGET_S, common_prefix, prefill_budget


def check_vocabulary(model, draft) -> None:
    """The draft model must speak the model's vocabulary: the same number of tokens, each the same piece.
    Raises ConfigError saying where they differ."""
    tok, dtok = model.tokenizer, draft.tokenizer
    if tok.n_vocab != dtok.n_vocab:
        raise ConfigError(f"the draft model's vocabulary is not the model's: {dtok.n_vocab} tokens, the model "
                          f"has {tok.n_vocab}")
    for i in range(tok.n_vocab):
        if tok.token_bytes(i) != dtok.token_bytes(i):
            raise ConfigError(f"the draft model's vocabulary is not the model's: token {i} is "
                              f"{dtok.token_bytes(i)!r} in the draft model, {tok.token_bytes(i)!r} in the model")


def load_draft(path: str, model):
    """The draft model of `path` (a Model) for `model`, its vocabulary checked (ConfigError)."""
    from .models.model import load_model

    draft = load_model(path)
    check_vocabulary(model, draft)
    return draft


class DraftModel:
    """The drafter of draft-simple, with the n-gram drafters' surface (reset, propose) and what a model needs
    beside it (the slots it follows, their p_min). backend: a CpuBackend of the draft model (its forward and
    KV cache; made with reuse_logits for max_tokens tokens); min_chunk: the fewest prompt tokens a lagging
    slot catches up by per step."""

    def __init__(self, backend, max_tokens: int, min_chunk: int, name: str = "draft"):
        self.backend, self.max_tokens, self.min_chunk, self.name = backend, max_tokens, min_chunk, name
        n_slots, n_ctx, n_max = backend.n_slots, backend.n_ctx_slot, max_tokens
        self.fed = np.zeros((n_slots, n_ctx), np.int32)     # [n_slots, n_ctx_slot] tokens whose draft KV is written
        self.n_fed = np.zeros(n_slots, np.int32)            # [n_slots]
        self.agreed = np.zeros(n_slots, np.int32)           # [n_slots] fed[s, :agreed[s]] are the slot's own tokens
        self._exp = np.zeros((n_slots, backend.n_vocab), np.float32)    # [n_slots, n_vocab] _sample's scratch
        self._rows = np.zeros((3, n_max), np.int64)         # [3, max_tokens] a pass's tokens, positions, slots
        self._out = np.zeros(n_slots, np.int64)             # [n_slots] a pass's output rows
        self._s_per_token = 0.0                             # measured seconds of a catch-up pass per token
        self.passes = 0                                     # forward passes since start

    def reset(self, slot: int) -> None:
        """A request starts on slot: its tokens are compared with the draft KV's from the first one."""
        self.agreed[slot] = 0

    def propose(self, tokens, n_tokens, k_max, k_min, drafts, n_draft, *, follow, p_min) -> int:
        """For every slot s with k_max[s] > 0 (and in follow): at most k_max[s] greedy drafts into drafts[s];
        n_draft[s]: how many (0: none, fewer than k_min[s], its KV still catching up, or the first draft's
        probability below p_min[s]). follow: bool [n_slots], the slots whose draft KV catches up with their
        tokens this step (the drafting ones and prompts that will draft; a slot that does not draft now
        catches up when it drafts again). Returns the tokens drafted."""
        n_draft[:] = 0
        slots = np.flatnonzero(follow)
        if not len(slots):
            return 0
        for s in slots.tolist():
            self._sync(s, tokens[s], int(n_tokens[s]))
        going = self._catch_up(slots, tokens, n_tokens, k_max)
        total = 0
        for j in range(int(k_max[going].max()) if len(going) else 0):
            if j > 0:
                going = going[k_max[going] > j]
                if not len(going):
                    break
                going = self._feed_drafts(going, n_tokens, drafts, j)
            ids, p_top = self._sample(len(going))
            keep = p_top >= p_min[going]
            going = going[keep]
            drafts[going, j] = ids[keep]
            n_draft[going] = j + 1
            total += len(going)
            if not len(going):
                break
        short = n_draft < k_min
        total -= int(n_draft[short].sum())
        n_draft[short] = 0
        return total

    def rollback(self, tokens, n_tokens, slots) -> None:
        """After a verification: the drafting slots' draft KV cut back to what was accepted (its n_past becomes
        the target's, n_tokens - 1)."""
        for s in slots.tolist():
            self._sync(s, tokens[s], int(n_tokens[s]))

    def _sync(self, s: int, tokens, n: int) -> None:
        """Drop what of slot s's draft KV is not its tokens (rejected drafts, another prompt's tail); the last
        token is always fed again (its logits give the first draft)."""
        a, f = int(self.agreed[s]), min(int(self.n_fed[s]), n)
        keep = a + common_prefix(self.fed[s, a:f], tokens[a:f]) if f > a else min(a, f)
        keep = min(keep, n - 1)
        if keep and self.backend.kv_reuse_from(s, keep) > keep:    # a ring that lost the window: start over
            keep = 0
        self.n_fed[s] = self.agreed[s] = keep

    def _catch_up(self, slots, tokens, n_tokens, k_max) -> np.ndarray:
        """The first pass: each following slot's unfed tokens, within a prompt budget; a drafting slot whose
        tokens are all in gets its output row (the last). Returns the slots that draft, in output row order."""
        tok, pos, slot = self._rows
        drafting = k_max[slots] > 0
        free = self.max_tokens - int(np.count_nonzero(drafting))
        budget = prefill_budget(free, self.max_tokens - free, self.min_chunk, self._s_per_token, STEP_TARGET_S)
        n, going = 0, []
        for s in np.concatenate([slots[drafting], slots[~drafting]]).tolist():   # drafting slots first, then prompts
            lo, hi = int(self.n_fed[s]), int(n_tokens[s])
            c = hi - lo
            if k_max[s] > 0 and n + c <= self.max_tokens and (c <= 2 or c <= budget):
                going.append(s)
            else:                      # a prompt: up to its last token, which a drafting step feeds
                c = min(hi - 1 - lo, budget, self.max_tokens - n)
                if c <= 0:
                    continue
            budget -= c
            tok[n:n + c], pos[n:n + c], slot[n:n + c] = tokens[s, lo:lo + c], np.arange(lo, lo + c), s
            self.fed[s, lo:lo + c] = tokens[s, lo:lo + c]
            self.n_fed[s] = self.agreed[s] = lo + c
            n += c
            if going and going[-1] == s:
                self._out[len(going) - 1] = n - 1
        if n:
            t0 = time.perf_counter()
            self._logits = self.backend.forward(tok[:n], pos[:n], slot[:n], self._out[:len(going)])
            self._measure(n, time.perf_counter() - t0)
        return np.asarray(going, np.int64)

    def _feed_drafts(self, going, n_tokens, drafts, j: int) -> np.ndarray:
        """Pass j >= 1: each going slot's draft j - 1 at its position, one output row each."""
        tok, pos, slot = self._rows
        m = len(going)
        at = n_tokens[going].astype(np.int64) + j - 1
        tok[:m], pos[:m], slot[:m] = drafts[going, j - 1], at, going
        self.fed[going, at] = drafts[going, j - 1]
        self.n_fed[going] = at + 1
        self._out[:m] = np.arange(m)
        self._logits = self.backend.forward(tok[:m], pos[:m], slot[:m], self._out[:m])
        self.passes += 1
        return going

    def _sample(self, m: int) -> tuple[np.ndarray, np.ndarray]:
        """The last pass's m rows: their argmax (the lowest id on ties, as greedy) and its probability."""
        logits, e = self._logits[:m], self._exp[:m]
        ids = np.argmax(logits, axis=1)
        np.subtract(logits, logits[np.arange(m), ids][:, None], out=e)
        np.exp(e, out=e)
        return ids.astype(np.int32), 1.0 / e.sum(axis=1)

    def _measure(self, n: int, seconds: float) -> None:
        """The catch-up pass's seconds per token (a moving average, as the engine's), which sizes its budget."""
        cost, prev = seconds / n, self._s_per_token
        self._s_per_token = cost if not prev else prev + STEP_COST_WEIGHT * (cost - prev)
        self.passes += 1
