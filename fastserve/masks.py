"""Per-slot constraints and their allowed-token masks, computed off the decode thread's critical path.

    step k:   ... sample (reads masks) → commit → launch(rows) ──worker: consume token, fill mask──┐
    step k+1: admit → build → forward (worker runs meanwhile) → wait() → sample ◀──────────────────┘

The masks are the sampler's own bit array (Sampler.masks, uint32 [n_slots, words]); the worker writes
row s for slot s only, while the decode thread is busy with the next step's admission, batch and
forward pass (llguidance drops the GIL while it computes; so do the forward pass's kernels). The
decode thread waits for the worker before it samples, and before it hands a slot to a new request.

A constrained slot drafts (speculative decoding) only what its masks allow: draft() walks its drafts
with the matcher, keeping each while the mask of its row allows it and writing the next row's mask
(the sampler's draft_masks); after the verification, launch() rolls the matcher back over those drafts
and takes the sampled tokens instead, so a rejected draft leaves nothing in the grammar state. Those
masks are computed on the decode thread, before the batch is built.

A matcher that falls into an error state (a token it could not take, a grammar that dead-ends)
gets an all-zero mask: the sampler then yields -1 for its row, and the engine ends the request
with FINISH_GRAMMAR and the matcher's message instead of sampling a garbage token.
"""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np


class MaskTable:
    """The decode thread's table of constrained slots (its only user); one worker thread, made on first use."""

    def __init__(self, masks: np.ndarray, draft_masks: np.ndarray | None = None):
        self.masks = masks                       # uint32 [n_slots, n_words]: the sampler's
        self.draft_masks = draft_masks           # uint32 [n_slots, most, n_words]: its drafted rows' (None: no drafts)
        self.constraint = [None] * masks.shape[0]
        self.n_drafted = np.zeros(masks.shape[0], np.int32)    # per slot: drafts its matcher took this step
        self.n_active = 0
        self._pool: ThreadPoolExecutor | None = None
        self._pending = None                     # the worker's current job (a Future) or None
        self.wait_ns = 0                         # time the decode thread spent blocked in wait()
        self.waits = 0

    def start(self, slot: int, constraint) -> None:
        """A constrained request takes `slot`: its first mask is computed now (once per request)."""
        self.wait()
        self.constraint[slot] = constraint
        self.n_drafted[slot] = 0
        self.n_active += 1
        _fill(constraint, self.masks[slot])

    def end(self, slot: int) -> None:
        if self.constraint[slot] is not None:
            self.constraint[slot] = None
            self.n_active -= 1

    def draft(self, drafts, n_draft, k_min) -> int:
        """Before the batch is built: each constrained slot's drafts (drafts[s, :n_draft[s]]) cut at the first
        one its row's mask does not allow (or an end of generation: nothing is drafted past it), or to none
        when fewer than k_min[s] remain; its matcher takes the kept ones, writing the mask of each next row
        into draft_masks. Returns the tokens drafted by all slots."""
        self.wait()
        for s in np.flatnonzero(n_draft).tolist():
            c = self.constraint[s]
            if c is None:
                continue
            words, n, most = self.masks[s], 0, min(int(n_draft[s]), self.draft_masks.shape[1])
            while n < most:
                t = int(drafts[s, n])
                if not words[t >> 5] >> (t & 31) & 1 or c.is_end(t) or not c.matcher.consume_token(t):
                    break
                words = self.draft_masks[s, n]
                _fill(c, words)
                n += 1
            if n < k_min[s]:
                c.matcher.rollback(n)
                n = 0
            n_draft[s] = self.n_drafted[s] = n
        return int(n_draft.sum())

    def launch(self, row_slot, sampled, finish) -> None:
        """After commit: each constrained slot's matcher is rolled back over its drafts, its sampled tokens
        (those not REJECTED) move it on, then its next mask is computed, in the worker. A slot with a row
        that finished (finish[r] != 0) is left alone."""
        jobs, done = {}, set()
        for r, s in enumerate(row_slot.tolist()):
            c = self.constraint[s]
            if c is None or s in done:
                continue
            if finish[r]:
                done.add(s)
                jobs.pop(s, None)
            elif sampled[r] >= 0:
                jobs.setdefault(s, (c, int(self.n_drafted[s]), [], self.masks[s]))[2].append(int(sampled[r]))
        self.n_drafted[list(jobs)] = 0
        jobs = list(jobs.values())
        if not jobs:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="fastserve-masks")
        self._pending = self._pool.submit(_advance, jobs)

    def wait(self) -> None:
        """Block until the worker's masks are written (before sampling, before a slot changes hands)."""
        job, self._pending = self._pending, None
        if job is not None:
            t0 = time.perf_counter_ns()
            job.result()
            self.wait_ns += time.perf_counter_ns() - t0
            self.waits += 1

    def error(self, slot: int) -> str:
        """Why slot's constraint allows no token."""
        c = self.constraint[slot]
        msg = c.error if c is not None else ""
        return "the constraint allows no token here" + (f": {msg.splitlines()[0]}" if msg else "")

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def _fill(constraint, words: np.ndarray) -> None:
    constraint.fill_mask(words)
    if constraint.matcher.is_error():
        words[:] = 0


def _advance(jobs) -> None:
    for constraint, drafted, tokens, words in jobs:
        try:
            if drafted:
                constraint.matcher.rollback(drafted)
            if all(constraint.commit(t) for t in tokens):
                _fill(constraint, words)
                continue
        except Exception:           # llguidance refused a call: this request ends, not the decode thread
            pass
        words[:] = 0
