"""Speculative decoding's policy: how many tokens each decoding slot drafts this step, and what came of it.

    propose(slots, capacity)  before the batch is built: the drafter (fastserve/_drafts.pyx's n-grams, or a draft
                              model, fastserve/draft_model.py) fills drafts[s, :n_draft[s]] for the slots worth
                              drafting; SlotTable.add_decode puts them in
    observe(slots)            after commit: each slot's drafted / accepted tokens move its estimate (a draft
                              model's KV is cut back to the accepted tokens)

The output never depends on this module: the sampler verifies every draft row in order and keeps only
what plain decoding would have produced (fastserve/ref/sampling.py), so a draft changes the speed only.
Speed is what it weighs. A step of n rows takes about a + b n seconds (StepCost, fitted on recent
steps), and drafted row j of a slot yields a token only if the j drafts before it were all accepted:
with alpha the slot's estimated chance that one draft is accepted, row j is worth alpha**j tokens for b
seconds, while the step's other rows yield N tokens for a + b N. Row j is added while alpha**j exceeds
b N / (a + b N) (and the slot's p_min): at one slot on a CPU that is about 0.15 (long drafts pay), with
32 slots busy close to 1 (only near-certain ones do), so speculation backs off under load by itself.
A slot whose drafts keep failing drafts nothing (alpha**1 below the bar); its evidence fades while it
does not draft (FORGET), so it tries again, one token, now and then. A draft model's passes run in the
step too, so the fitted b carries their cost per drafted row; its p_min bars its own top probability.
Decode thread only.
"""
from __future__ import annotations

import math

import numpy as np

from . import _drafts
from ._slots import DECODE, PREFILL
from .config import DraftLimits, SpecConfig

PRIOR_HITS, PRIOR_MISSES = 1.0, 1.0     # the estimate of a slot that has not drafted yet: alpha = 1/2
DECAY = 0.6                             # weight of a verification's evidence one verification later
FORGET = 0.97                           # per step without drafting: the misses fade, the slot tries again
# Accepted tokens per verification, the fastserve histogram of /metrics: its buckets' upper bounds.
ACCEPT_BUCKETS = (0, 1, 3, 7, 15, 31, 63)


class StepCost:
    """Seconds of a step as a + b * rows, least squares over recent steps (exponentially weighted). While the
    rows barely varied, b is taken as ROW_SHARE of a (a decode-bound step on a CPU; measured on the default
    model: a ~6 ms, b ~1.2 ms)."""
    WEIGHT = 0.98           # of a step's sample one step later
    ROW_SHARE = 0.2

    def __init__(self):
        self.w = self.x = self.y = self.xx = self.xy = 0.0

    def observe(self, rows: int, seconds: float) -> None:
        k = self.WEIGHT
        self.w, self.x, self.y = self.w * k + 1.0, self.x * k + rows, self.y * k + seconds
        self.xx, self.xy = self.xx * k + rows * rows, self.xy * k + rows * seconds

    def line(self) -> tuple[float, float]:
        """(a, b): seconds per step and per row; (1, ROW_SHARE) before any step (only their ratio is used)."""
        if self.w <= 0.0:
            return 1.0, self.ROW_SHARE
        mx, my = self.x / self.w, self.y / self.w
        var = self.xx / self.w - mx * mx
        if var >= 1.0:
            b = (self.xy / self.w - mx * my) / var
            a = my - b * mx
            if b > 0.0 and a > 0.0:
                return a, b
        b = self.ROW_SHARE * my / (1.0 + self.ROW_SHARE * mx)
        return b / self.ROW_SHARE, b

    def bar(self, n_rows: int) -> float:
        """What a row must yield (tokens) to add to a step of n_rows rows that each yield one: b N / (a + b N)."""
        a, b = self.line()
        return b * n_rows / (a + b * n_rows)


class Speculation:
    """Per-slot drafting for one engine: limits of the slot's request, its acceptance estimate, and the
    step's drafts (drafts int32 [n_slots, most], n_draft int32 [n_slots]). Counters for /metrics."""

    def __init__(self, cfg: SpecConfig, n_slots: int, n_ctx_slot: int, n_batch: int, impl=_drafts, model=None,
                 constrained_most: int = 0):
        """model: the draft model's drafter (fastserve/draft_model.py) for draft-simple, else the n-gram one of
        impl (fastserve._drafts or its twin). constrained_most: the most drafts of a constrained slot (the
        sampler's draft masks; its grammar then cuts them, fastserve/masks.py)."""
        self.cfg, self.model, self.constrained_most = cfg, model, constrained_most
        self.drafter = model if model is not None else impl.Drafter(n_slots, n_ctx_slot, **cfg.drafter())
        self.most = max(0, min(cfg.most, n_batch - 1, n_ctx_slot - 1))
        self.drafts = np.zeros((n_slots, max(1, self.most)), np.int32)   # [n_slots, most] this step's drafts
        self.n_draft = np.zeros(n_slots, np.int32)                       # [n_slots] their lengths
        self.k_cap = np.zeros(n_slots, np.int32)        # per slot: its request's n_max (0: it does not draft)
        self.k_min = np.zeros(n_slots, np.int32)        # its n_min
        self.p_min = np.zeros(n_slots)                  # its p_min
        self.hits = np.full(n_slots, PRIOR_HITS)        # decayed accepted drafts, and rejections
        self.misses = np.full(n_slots, PRIOR_MISSES)
        self.seen = np.zeros((2, n_slots), np.int64)    # SlotTable's n_drafted / n_accepted at the last look
        self.cost = StepCost()
        self.n_drafted = self.n_accepted = self.n_verified = 0      # totals since start
        self.histogram = [0] * (len(ACCEPT_BUCKETS) + 1)           # verifications by accepted tokens
        self._k = np.zeros(n_slots, np.int32)

    def start(self, slot: int, limits: DraftLimits | None, constrained: bool) -> None:
        """A request starts on slot (after SlotTable.start): its limits (None: the server's); a constrained
        request drafts at most constrained_most tokens a step (a mask for each)."""
        lim = limits if limits is not None else self.cfg.limits
        cap = self.most if lim.n_max is None else min(lim.n_max, self.most)
        self.k_cap[slot] = min(cap, self.constrained_most) if constrained else cap
        self.k_min[slot], self.p_min[slot] = lim.n_min, lim.p_min
        self.hits[slot], self.misses[slot] = PRIOR_HITS, PRIOR_MISSES
        self.seen[:, slot] = 0
        self.drafter.reset(slot)

    def propose(self, slots, capacity: int) -> int:
        """This step's drafts for the DECODE slots (drafts, n_draft), within capacity rows with one decode
        row per DECODE slot kept free. Returns the tokens drafted."""
        decoding = slots.state == DECODE
        n_rows = int(np.count_nonzero(decoding))
        self._k[:] = self._lengths(slots, capacity, decoding & (self.k_cap > 0), n_rows)
        if self.model is not None:          # a model's KV also follows the prompts of the slots that will draft
            follow = ((slots.state == PREFILL) & (self.k_cap > 0)) | (self._k > 0)
            if follow.any():
                return self.model.propose(slots.tokens, slots.n_tokens, self._k, self.k_min, self.drafts,
                                          self.n_draft, follow=follow, p_min=self.p_min)
        elif self._k.any():
            return self.drafter.propose(slots.tokens, slots.n_tokens, self._k, self.k_min, self.drafts, self.n_draft)
        self.n_draft[:] = 0
        return 0

    def _lengths(self, slots, capacity: int, active, n_rows: int) -> np.ndarray:
        """Rows worth drafting per slot (0 where not active), within capacity. p_min bars a row of an n-gram
        draft by its estimated acceptance; a draft model applies it to its own probabilities instead."""
        if not active.any():
            return np.zeros(len(active), np.int32)
        alpha = self.hits / (self.hits + self.misses)
        bar = self.cost.bar(n_rows) if self.model is not None else np.maximum(self.cost.bar(n_rows), self.p_min)
        with np.errstate(divide="ignore"):
            worth = np.floor(np.log(np.maximum(bar, 1e-9)) / np.log(np.minimum(alpha, 1.0 - 1e-9)))
        room = np.minimum(slots.n_ctx_slot - slots.n_tokens, slots.max_gen - slots.n_gen - 1)
        k = np.minimum(np.minimum(worth, self.k_cap), room)
        k = np.where(active, np.maximum(k, 0), 0).astype(np.int32)
        idle = active & (k == 0)
        self.misses[idle] *= FORGET                     # not worth it now: the evidence fades
        total, free = int(k.sum()), capacity - n_rows
        if total > free:                                # the batch first holds every decode row
            k = (k * max(0, free) // total).astype(np.int32)
        return k

    def observe(self, slots) -> np.ndarray:
        """After commit: each slot's drafted and accepted tokens of this step (SlotTable's counters). Returns
        the slots that drafted."""
        drafted = slots.n_drafted - self.seen[0]
        accepted = slots.n_accepted - self.seen[1]
        self.seen[0], self.seen[1] = slots.n_drafted, slots.n_accepted
        ran = np.flatnonzero(drafted > 0)
        if not len(ran):
            return ran
        if self.model is not None:
            self.model.rollback(slots.tokens, slots.n_tokens, ran)
        d, a = drafted[ran], accepted[ran]
        self.hits[ran] = self.hits[ran] * DECAY + a
        self.misses[ran] = self.misses[ran] * DECAY + (a < d)
        self.n_drafted += int(d.sum())
        self.n_accepted += int(a.sum())
        self.n_verified += len(ran)
        for n in np.searchsorted(ACCEPT_BUCKETS, a).tolist():
            self.histogram[n] += 1
        return ran

    def acceptance(self) -> float:
        """Accepted / drafted tokens since start (0 before any draft)."""
        return self.n_accepted / self.n_drafted if self.n_drafted else 0.0


def worth_drafting(alpha: float, bar: float) -> int:
    """Rows worth drafting for a slot with acceptance estimate alpha when a row must yield bar tokens
    (the scalar statement of propose()'s vector rule, for tests and reports)."""
    if alpha <= 0.0 or bar >= 1.0:
        return 0
    if alpha >= 1.0 or bar <= 0.0:
        return 1 << 30
    return max(0, math.floor(math.log(bar) / math.log(alpha)))
